"""The decode loop's own cost, two ways.

Part `loop` (the first measurement): what the single jitted while_loop saves, the same
decode three ways, side by side.

  while_loop   decode_loop under one jax.jit (the library's path)
  python_loop  a Python loop calling a jitted loop body, one host round trip per step
  eager        the loop body run op by op without jit (what an unjitted reference does)

Same model, prompts, sampler and tokens in all three (checked). Steady-state times
exclude compilation (each variant runs once to warm up).

Part `update` (issue 42, "the update's own cost"): per loop iteration, on the testbed's
one-block math answers at batch 1, what the model call costs (a cached call of each
sampler's query count, and a full forward, timed as `asynclane_jax.costs.measure` times
calls) and what the schedule's own work costs: its plan, its update and its `done`.
The schedule's work is timed by replay. A real decode of each math problem is recorded
(the logits of every call, through the driver's `tap`); then one compiled loop runs the
schedule's plan, update and done over those iterations with each call replaced by the
recorded logits, carrying the canvas and the schedule's state exactly as the decode does
(the replay's final canvas is checked against the decode's). Its time over the recorded
iterations, after a compile and half a second of untimed runs (the `_timer` convention of
asynclane_jax/costs/measure.py), is the schedule's per-iteration cost. Variants are
interleaved round by round and the median of the rounds is kept. Whole decodes of the
same problems (`generate`, decode time, compilation excluded) are timed interleaved too.

With `--before REV`, AsyncLane's schedule as it was at git revision REV
(asynclane_jax/decoding/asynclane.py there, loaded as a module of its own) runs beside
today's: the replay and the whole decodes time both, and a token check decodes
`--check-n` problems of each family with both and asserts identical tokens, commit steps
and call counts.

Results are printed and written to experiments/results/decode/loop_overhead.{md,json}
(each part keeps the other's last results).

Usage: python experiments/loop_overhead.py --part loop [--model tiny-llada] [--gen-length 64]
       python experiments/loop_overhead.py --part update [--models tiny-llada-v4b,tiny-dream-v4]
           [--gen-lengths 512,256] [--n 20] [--before REV]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import shlex
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asynclane_jax.decoding import driver
from asynclane_jax.decoding.api import build_canvas, make_schedule
from asynclane_jax.decoding.schedule import CallOutput

RESULTS = pathlib.Path(__file__).parent / "results" / "decode"
ROOT = pathlib.Path(__file__).resolve().parents[1]
ASYNCLANE_SOURCE = "asynclane_jax/decoding/asynclane.py"
# The fastest equal-footing baseline of the v4 benches, at AsyncLane's threshold.
FAST_DLLM_DUAL = {"cache": "dual", "cascade": True, "early_stop": True, "threshold": 0.95}
BUCKET = 32
REPLAYS_PER_RUN = 16  # replays of a problem's iterations per timed run of the program


def _model(name: str):
    if name.startswith("random:"):
        from asynclane_jax.models import init_model, preset

        return init_model(preset(name.split(":", 1)[1]), 0)
    import asynclane_jax

    return asynclane_jax.load(name)[0]


def measure(model, prompts, sampler, opts, args) -> dict:
    """Times one sampler three ways; asserts they produce the same canvas."""
    cfg = model.cfg
    schedule = make_schedule(sampler, gen_length=args.gen_length,
                             block_length=args.block_length, **opts)
    canvas, pad_len, _ = build_canvas(prompts, args.gen_length, cfg, 32)
    graphdef, params = nnx.split(model)
    call = (graphdef, params, jnp.asarray(canvas), jnp.asarray(pad_len),
            jnp.ones((len(prompts),), bool), jax.random.key(0))

    whole = jax.jit(driver.decode_loop, static_argnums=0, static_argnames=("schedule",))

    def run_while():
        return jax.block_until_ready(whole(*call, schedule=schedule))

    state0, body, cond = driver.build_loop(*call, schedule=schedule)
    body_jit = jax.jit(body)

    def run_python(step_fn=body_jit):
        st = state0
        while bool(cond(st)):
            st = step_fn(st)
        return jax.block_until_ready(st)

    variants = {"while_loop": run_while, "python_loop": run_python}
    # Eager stepping is timed for cache-free samplers only: with a cache, the body's
    # lax.cond runs op by op and one decode takes minutes.
    if not args.skip_eager and not schedule.uses_cache:
        variants["eager"] = lambda: run_python(body)
    times, finals = {}, {}
    for name, fn in variants.items():
        t0 = time.perf_counter()
        finals[name] = fn()
        first = time.perf_counter() - t0
        reps = 1 if name == "eager" else args.repeats
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        times[name] = {"first_call_s": first, "steady_s": float(np.median(ts))}
    ref = np.asarray(finals["while_loop"].canvas)
    for name, st in finals.items():
        assert np.array_equal(np.asarray(st.canvas), ref), f"{name} differs"
    steps = int(finals["while_loop"].step)
    row = {"sampler": sampler, "options": opts, "steps": steps, **{
        f"{k}_{m}": v[m] for k, v in times.items() for m in v}}
    base = times["while_loop"]["steady_s"]
    for k in times:
        row[f"{k}_vs_while"] = times[k]["steady_s"] / base
    return row


# -- part "update": the schedule's own work per iteration -----------------------------


def schedule_class_at(rev: str):
    """AsyncLaneSchedule as asynclane.py was at git revision `rev`, loaded as a module of
    its own; its `name` is cleared, so the registry keeps naming today's class."""
    src = subprocess.run(["git", "show", f"{rev}:{ASYNCLANE_SOURCE}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    mod_name = "asynclane_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    mod = types.ModuleType(mod_name)
    mod.__file__ = f"{rev}:{ASYNCLANE_SOURCE}"
    sys.modules[mod_name] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    cls = mod.AsyncLaneSchedule
    cls.name = None
    return cls


def variants(gen_length: int, tokenizer, cfg, before_cls=None, before_rev=None) -> dict:
    """label -> bound schedule of each variant timed."""
    out = {"asynclane": make_schedule("asynclane", gen_length=gen_length)}
    if before_cls is not None:
        out[f"asynclane@{before_rev}"] = before_cls(gen_length=gen_length)
    out["fast-dllm dual"] = make_schedule("fast-dllm", gen_length=gen_length,
                                          **FAST_DLLM_DUAL)
    return {k: v.bind(tokenizer, cfg) for k, v in out.items()}


@functools.lru_cache(maxsize=64)
def _recorder(graphdef, schedule):
    """Jitted (init, step) of the decode loop whose iterations also return the call's
    logits (the driver's `tap`)."""
    def tap(ctx, canvas, st, out, key):
        canvas, st = schedule.update(ctx, canvas, st, out, key)
        return canvas, st, out.logits

    def pieces(params, canvas, pad_len):
        live = jnp.ones((canvas.shape[0],), bool)
        return driver.build_loop(graphdef, params, canvas, pad_len, live, jax.random.key(0),
                                 schedule=schedule, tap=tap)

    init = jax.jit(lambda params, canvas, pad_len: pieces(params, canvas, pad_len)[0])
    step = jax.jit(lambda params, canvas, pad_len, st: pieces(params, canvas, pad_len)[1](st))
    cond = jax.jit(lambda params, canvas, pad_len, st: pieces(params, canvas, pad_len)[2](st))
    return init, step, cond


def record(model, schedule, prompt, gen_length):
    """One decode of `prompt` (batch 1): (canvas [1, T], pad_len [1], the calls' logits
    [iterations, 1, n, V], the final canvas)."""
    canvas, pad_len, _ = build_canvas([prompt], gen_length, model.cfg, BUCKET)
    canvas, pad_len = jnp.asarray(canvas), jnp.asarray(pad_len)
    graphdef, params = nnx.split(model)
    init, step, cond = _recorder(graphdef, schedule)
    st, logits = init(params, canvas, pad_len), []
    while bool(cond(params, canvas, pad_len, st)):
        st, lg = step(params, canvas, pad_len, st)
        logits.append(lg)
    return canvas, pad_len, jnp.stack(logits), st.canvas


@functools.lru_cache(maxsize=256)
def _replayer(cfg, schedule, reps: int):
    """A compiled program that runs the schedule's plan, update and done over recorded
    iterations (each call replaced by its recorded logits), `reps` times over."""
    def run(canvas0, pad_len, logits_seq):
        ctx = driver.make_context(cfg, schedule, canvas0.shape, pad_len)
        T, key = ctx.length, jax.random.key(0)

        def one(carry, logits):
            canvas, sched, finished = carry
            plan = schedule.plan(ctx, canvas, sched, ~finished)
            serve = plan.serve & ~finished
            targets = jnp.where(plan.positions < T, plan.positions + ctx.shift, T)
            out = CallOutput(logits=logits, targets=targets, serve=serve,
                             full=jnp.asarray(plan.full))
            new, sched = schedule.update(ctx, canvas, sched, out, key)
            new = jnp.where(serve[:, None], new, canvas)
            return (new, sched, finished | schedule.done(ctx, new, sched)), None

        def replay(_, acc_canvas):
            acc, _ = acc_canvas
            # The start depends on the carry, so that no replay is hoisted out.
            start = canvas0 + (acc == -1).astype(canvas0.dtype)
            sched0 = schedule.init(ctx)
            carry0 = (start, sched0, schedule.done(ctx, start, sched0))
            (canvas, _, _), _ = jax.lax.scan(one, carry0, logits_seq)
            return acc + jnp.sum(canvas), canvas

        return jax.lax.fori_loop(0, reps, replay, (jnp.zeros((), jnp.int32), canvas0))[1]

    return jax.jit(run)


def _warm(fn, *args):
    """Compiles fn and runs it, untimed, for half a second (measure._timer's convention)."""
    from asynclane_jax.costs.measure import WARMUP_S

    jax.block_until_ready(fn(*args))
    end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < end:
        jax.block_until_ready(fn(*args))


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def call_costs(model, gen_length: int, queries: dict) -> dict:
    """Seconds of one cached call per query count in `queries` (label -> Q) and of one
    full forward, batch 1, measured in interleaved rounds
    (asynclane_jax.costs.measure.MeasuredCosts.measure_all)."""
    from asynclane_jax.costs.measure import MeasuredCosts
    from asynclane_jax.decoding.stats import CallShape

    T = BUCKET + gen_length
    shapes = {f"cached_{k}": CallShape("cached", 1, q, T, q, True, T)
              for k, q in queries.items()}
    shapes["full"] = CallShape("full", 1, T, T, max(queries.values()), True, T)
    costs = MeasuredCosts(model, repeat=15)
    costs.measure_all(list(shapes.values()))
    return {k: costs.times[s] for k, s in shapes.items()}


def update_cost(model, tokenizer, problems, gen_length, args, before_cls=None) -> dict:
    """Per-iteration schedule time (replay) and whole-decode time of each variant on
    `problems` (batch 1), interleaved, median over rounds."""
    from asynclane_jax.decoding.api import generate
    from asynclane_jax.testbed import evaluate

    cfg = model.cfg
    prompts = evaluate.prompts_for(problems, tokenizer)
    scheds = variants(gen_length, tokenizer, cfg, before_cls, args.before)
    names = list(scheds)
    rec = {}
    for name, sch in scheds.items():
        runs = []
        for p in prompts:
            canvas, pad_len, logits, final = record(model, sch, p, gen_length)
            fn = _replayer(cfg, sch, REPLAYS_PER_RUN)
            replayed = fn(canvas, pad_len, logits)
            assert np.array_equal(np.asarray(replayed), np.asarray(final)), \
                f"{name}: the replay differs from the decode"
            runs.append((fn, (canvas, pad_len, logits), logits.shape[0]))
        for fn, a, _ in runs:  # every program compiled; then half a second untimed
            jax.block_until_ready(fn(*a))
        _warm(runs[0][0], *runs[0][1])
        rec[name] = runs
    per_iter = {n: [] for n in names}
    for r in range(args.rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            total = sum(_timed(fn, *a) for fn, a, _ in rec[name])
            iters = sum(n for _, _, n in rec[name]) * REPLAYS_PER_RUN
            per_iter[name].append(total / iters)
    iterations = {n: float(np.mean([it for _, _, it in rec[n]])) for n in names}

    # Whole decodes, batch 1, interleaved problem by problem.
    for sch in scheds.values():
        generate(model, [prompts[0]], sampler=sch, tokenizer=tokenizer, bucket=BUCKET)
    decode = {n: [] for n in names}
    calls = {n: [0, 0] for n in names}
    for r in range(args.rounds):
        tot = dict.fromkeys(names, 0.0)
        for i, p in enumerate(prompts):
            for k in range(len(names)):
                name = names[(i + r + k) % len(names)]
                st = generate(model, [p], sampler=scheds[name], tokenizer=tokenizer,
                              bucket=BUCKET).stats
                tot[name] += st.decode_time
                if r == 0:
                    calls[name][0] += int(st.nfe_full)
                    calls[name][1] += int(st.nfe_partial)
        for n in names:
            decode[n].append(tot[n] / len(prompts))
    B, E = 32, scheds["asynclane"].extra_queries
    costs = call_costs(model, gen_length, {"asynclane": B + E, "fast-dllm": B})
    return {"variants": names, "iterations": iterations,
            "schedule_s_per_iteration": {n: float(np.median(v)) for n, v in per_iter.items()},
            "schedule_s_per_iteration_rounds": per_iter,
            "decode_s_per_problem": {n: float(np.median(v)) for n, v in decode.items()},
            "decode_s_per_problem_rounds": decode,
            "full_calls": {n: c[0] / len(prompts) for n, c in calls.items()},
            "cached_calls": {n: c[1] / len(prompts) for n, c in calls.items()},
            "call_s": costs}


def check_tokens(model, tokenizer, problems, gen_length, before_cls) -> dict:
    """Decodes each problem (batch 1) with today's AsyncLane and the one at --before;
    asserts identical tokens, commit steps and calls. Returns counts."""
    from asynclane_jax.decoding.api import generate
    from asynclane_jax.testbed import evaluate

    cfg = model.cfg
    now = make_schedule("asynclane", gen_length=gen_length).bind(tokenizer, cfg)
    then = before_cls(gen_length=gen_length).bind(tokenizer, cfg)
    tokens = 0
    for p in evaluate.prompts_for(problems, tokenizer):
        a = generate(model, [p], sampler=now, tokenizer=tokenizer, bucket=BUCKET)
        b = generate(model, [p], sampler=then, tokenizer=tokenizer, bucket=BUCKET)
        assert np.array_equal(a.tokens, b.tokens), "tokens differ"
        assert np.array_equal(a.stats.commit_step, b.stats.commit_step), "commit steps differ"
        for f in ("nfe_full", "nfe_partial", "row_steps", "forks", "refreshes"):
            assert np.array_equal(getattr(a.stats, f), getattr(b.stats, f)), f"{f} differs"
        tokens += int(np.asarray(a.tokens).size)
    return {"problems": len(problems), "tokens_compared": tokens, "differ": 0}


def _problems(task_set, n_math: int, n_other: int):
    from asynclane_jax.testbed import tasks

    pool = tasks.split("heldout", 200, task_set)
    math = [p for p in pool if p.family == "math"][:n_math]
    other = [p for p in pool if p.family != "math"][:n_other]
    return math, other


def main_update(args):
    import asynclane_jax
    from asynclane_jax.testbed import tasks

    before_cls = schedule_class_at(args.before) if args.before else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", ASYNCLANE_SOURCE,
                                 "asynclane_jax/decoding/lanes.py"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    rows, checks = [], []
    for name in args.models.split(","):
        model, tokenizer = asynclane_jax.load(name)[:2]
        math, other = _problems(tasks.model_task_set(name), max(args.n, args.check_n),
                                args.check_n)
        for g in (int(x) for x in args.gen_lengths.split(",")):
            row = {"model": name, "gen_length": g, "n": args.n,
                   **update_cost(model, tokenizer, math[:args.n], g, args, before_cls)}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("model", "gen_length",
                                                  "schedule_s_per_iteration",
                                                  "decode_s_per_problem", "call_s")}))
            if before_cls is not None and args.check_n:
                for fam, probs in (("math", math[:args.check_n]), ("other", other)):
                    c = {"model": name, "gen_length": g, "families": fam,
                         **check_tokens(model, tokenizer, probs, g, before_cls)}
                    checks.append(c)
                    print(json.dumps(c))
    meta = {"command": shlex.join(["python", "experiments/loop_overhead.py", *sys.argv[1:]]),
            "commit": commit + (" (with uncommitted changes to asynclane.py)" if dirty else ""),
            "before": args.before, "batch": 1, "bucket": BUCKET, "rounds": args.rounds,
            "replays_per_run": REPLAYS_PER_RUN, "fast_dllm": FAST_DLLM_DUAL,
            "backend": jax.default_backend(),
            "cpu": platform.processor() or platform.machine(),
            "shared_cpu": "the 2-core machine was shared with a benchmark running at the time"}
    return {"meta": meta, "rows": rows, "token_checks": checks}


def _ms(x):
    return f"{1e3 * x:.3f}"


def update_markdown(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    if not rows:
        return []
    names = rows[0]["variants"]
    lines = [
        "## The schedule's own cost per iteration (issue 42, item 3)",
        "",
        f"Command: `{meta['command']}`, at commit {meta['commit']}"
        + (f"; `asynclane@{meta['before']}` is AsyncLane's schedule as it was at "
           f"{meta['before']}, before the cut" if meta.get("before") else "") + ". "
        f"Backend {meta['backend']} ({meta['cpu']}); {meta['shared_cpu']}, so the figures "
        "carry its noise (variants interleaved, medians). Batch 1, the first "
        f"{rows[0]['n']} held-out math problems of each model's task set (one-block "
        f"answers), prompts bucketed to {meta['bucket']}; Fast-dLLM with "
        f"{meta['fast_dllm']}.",
        "",
        "- *schedule ms / iteration*: the schedule's plan, update and done per loop "
        "iteration, replayed over the recorded iterations of real decodes in one compiled "
        "loop (the module docstring of `experiments/loop_overhead.py`), median of "
        f"{meta['rounds']} interleaved rounds.",
        "- *cached call ms*, *full forward ms*: one model call at batch 1, the three "
        "shapes timed in interleaved rounds "
        "(`asynclane_jax.costs.measure.MeasuredCosts.measure_all`), AsyncLane's cached "
        "call with its B + 4 queries, Fast-dLLM's with B.",
        "- *decode ms / problem*: whole decodes (`generate`, decode time, compilation "
        "excluded), problem by problem, variants interleaved, median of rounds of the "
        "mean over the problems.",
        "",
        "| model | gen | sampler | iterations | full + cached calls | schedule ms / iteration "
        "| cached call ms | full forward ms | decode ms / problem |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["call_s"]
        for n in names:
            cached = c["cached_fast-dllm"] if n.startswith("fast-dllm") else c["cached_asynclane"]
            lines.append(
                f"| {r['model']} | {r['gen_length']} | {n} | {r['iterations'][n]:.2f} | "
                f"{r['full_calls'][n]:.2f} + {r['cached_calls'][n]:.2f} | "
                f"{_ms(r['schedule_s_per_iteration'][n])} | {_ms(cached)} | "
                f"{_ms(c['full'])} | {_ms(r['decode_s_per_problem'][n])} |")
    if data.get("token_checks"):
        lines += ["", f"Token check against `asynclane@{meta['before']}` (batch 1, "
                  "tokens, commit steps, full and cached calls, forks and refreshes "
                  "compared):", "",
                  "| model | gen | problems | tokens compared | differing |",
                  "|---|---|---|---|---|"]
        for c in data["token_checks"]:
            lines.append(f"| {c['model']} | {c['gen_length']} | {c['problems']} "
                         f"{c['families']} | {c['tokens_compared']:,} | {c['differ']} |")
    return lines


def loop_markdown(data: dict) -> list[str]:
    meta, rows = data.get("meta"), data.get("rows") or []
    if not rows:
        return []
    lines = [
        "## One jitted while_loop vs a Python loop vs eager",
        "",
        f"Command: `python experiments/loop_overhead.py --part loop`. "
        f"Model `{meta['model']}` ({meta['params']:,} params), batch {meta['batch']}, "
        f"gen_length {meta['gen_length']}, block_length {meta['block_length']}, "
        f"backend {meta['backend']}. Steady-state seconds per full decode (median), "
        "compilation excluded; identical tokens in all variants.",
        "",
        "| sampler | steps | while_loop s | python_loop s | eager s | python / while | "
        "eager / while |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eager = r.get("eager_steady_s")
        eager_s = "" if eager is None else f"{eager:.2f}"
        eager_x = "" if eager is None else f"{r['eager_vs_while']:.1f}x"
        lines.append(
            f"| {r['sampler']} {r['options']} | {r['steps']} | {r['while_loop_steady_s']:.3f} "
            f"| {r['python_loop_steady_s']:.3f} | {eager_s} | "
            f"{r['python_loop_vs_while']:.2f}x | {eager_x} |")
    return lines


def write_results(part: str, data: dict) -> None:
    """Writes loop_overhead.{json,md}: this part's data, the other part's kept."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "loop_overhead.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if "loop" not in old and "rows" in old:  # the first layout: the loop part only
        old = {"loop": {"meta": old["meta"], "rows": old["rows"]}}
    old[part] = data
    path.write_text(json.dumps(old, indent=2))
    lines = ["# The decode loop's own cost", "",
             "Written by `experiments/loop_overhead.py` (two parts, each rewriting its own "
             "section).", ""]
    lines += update_markdown(old.get("update", {"meta": {}, "rows": []}))
    lines += [""] + loop_markdown(old.get("loop", {}))
    (RESULTS / "loop_overhead.md").write_text("\n".join(lines).rstrip() + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("loop", "update"), default="update")
    ap.add_argument("--model", default="tiny-llada",
                    help="part loop: shipped model / folder, or random:PRESET")
    ap.add_argument("--gen-length", type=int, default=64, help="part loop")
    ap.add_argument("--block-length", type=int, default=32, help="part loop")
    ap.add_argument("--batch", type=int, default=4, help="part loop")
    ap.add_argument("--repeats", type=int, default=3, help="part loop")
    ap.add_argument("--skip-eager", action="store_true", help="part loop")
    ap.add_argument("--models", default="tiny-llada-v4b,tiny-dream-v4", help="part update")
    ap.add_argument("--gen-lengths", default="512,256", help="part update")
    ap.add_argument("--n", type=int, default=20, help="part update: math problems timed")
    ap.add_argument("--rounds", type=int, default=5, help="part update")
    ap.add_argument("--before", default=None,
                    help="part update: git revision of asynclane.py to compare with")
    ap.add_argument("--check-n", type=int, default=50,
                    help="part update, with --before: problems of math and of the other "
                    "families whose tokens are compared")
    args = ap.parse_args()
    if args.part == "update":
        write_results("update", main_update(args))
    else:
        write_results("loop", main_loop(args))


def main_loop(args):
    model = _model(args.model)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(cfg.vocab_size, 200) - 3, size=int(n)).tolist()
               for n in rng.integers(8, 24, size=args.batch)]
    rows = []
    for sampler, opts in [("vanilla", {"steps": args.gen_length}),
                          ("fast-dllm", {"cache": "dual"})]:
        row = measure(model, prompts, sampler, opts, args)
        rows.append(row)
        print(json.dumps(row))

    meta = {"model": args.model, "params": int(sum(x.size for x in jax.tree.leaves(
        nnx.state(model, nnx.Param)))), "gen_length": args.gen_length,
        "block_length": args.block_length, "batch": args.batch,
        "backend": jax.default_backend(), "cpu": platform.processor() or platform.machine()}
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
