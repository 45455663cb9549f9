"""Why AsyncLane with forking on loses accuracy: a problem-by-problem look at the cache.

Each variant decodes the same held-out problems (batch 1) with the decode loop stepped
from Python (one jitted iteration, the same code `generate` runs in its while_loop; the
tokens are checked against `generate`'s on the first problems), so the schedule's state
can be read between iterations. Per variant it reports:
  accuracy, iterations and calls per problem, full forwards per problem;
  stale: per problem, the (position, call) pairs in which a call attended the cached K/V
    of a committed generated position that was computed while the position was still
    masked (or before its token changed) and that the call did not re-encode, split by
    where the position lies: in a refine lane (the prefix a fork left behind), before
    the window elsewhere, or in the window (the window's own queries re-encode it);
    the end-of-text tail (positions after the first end-of-text, which the cascade
    fills without a call; counted apart, the same with and without forking);
  stale_calls: calls per problem with at least one such position outside the tail;
  at_fork: per fork made by a loop call, the prefix's masked positions and its dirty
    (stale) committed ones. A fork in the row's first call (split 0 in refine_spans)
    is not among them: that call encoded its whole view as masks, so every committed
    position of such a prefix is dirty;
  first_diff: for every problem this variant gets wrong and the reference gets right,
    the first position where its tokens differ from the reference's, classified by the
    reference's text there (the result after "=", an operand copied from the previous
    line after "(k)", the second operand, a state value "x = v", the answer after ":",
    end-of-text, other), whether a refine lane committed it, and how many stale
    positions the committing call attended.

Usage: python experiments/asynclane_fork_diagnosis.py --model tiny-llada [--n 200]
       [--gen-length 256] [--variant NAME=SAMPLER:key=value:...]... [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import shlex
import sys

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"
# The run in results/ was made while refresh_at_fork defaulted to off; the variants
# without the refresh name it, so that this default list reproduces it.
DEFAULT_VARIANTS = (
    "lanes-off=asynclane:max_lanes=1",
    "fork=asynclane:max_lanes=16:refresh_at_fork=false",
    "fork-eq8=asynclane:max_lanes=16:extra_queries=8:refresh_at_fork=false",
    "fork-eq16=asynclane:max_lanes=16:extra_queries=16:refresh_at_fork=false",
    "fork-refresh=asynclane:max_lanes=16:refresh_at_fork=true",
    "fork-refresh-eq8=asynclane:max_lanes=16:refresh_at_fork=true:extra_queries=8",
)


def classify(tok, ref: list[int], p: int, eos_ids) -> str:
    """The kind of position p in the reference text."""
    if ref[p] in eos_ids:
        return "end-of-text"
    text = [tok.decode([t]).strip() for t in ref[max(0, p - 3):p + 1]]
    cur, prev = text[-1], (text[-2] if len(text) > 1 else "")
    prev2 = text[-3] if len(text) > 2 else ""
    if not cur.lstrip("-").isdigit():
        return "structure (not a number)"
    if prev == "=":
        return "state value (x = v)" if prev2 in ("x", "y", "z") else "result (after =)"
    if prev.startswith("(") and prev.endswith(")"):
        return "operand copied from the previous line"
    if prev in ("+", "-", "*", "x", "/"):
        return "second operand"
    if prev == ":":
        return "answer"
    return "other number"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--reference", default="lanes-off")
    ap.add_argument("--check", type=int, default=3,
                    help="problems whose tokens are checked against generate's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import asynclane_jax
    from asynclane_jax.decoding import driver, generate
    from asynclane_jax.decoding.api import build_canvas, make_schedule
    from asynclane_jax.decoding.lanes import REFINE
    from asynclane_jax.testbed import evaluate, tasks
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from asynclane_forking import paired_diff, parse_variant

    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    labels = [v[0] for v in variants]
    model, tok, _ = asynclane_jax.load(args.model)
    cfg = model.cfg
    eos_ids = set(cfg.stop_token_ids)
    problems = tasks.split("heldout", args.n)
    prompts = evaluate.prompts_for(problems, tok)
    bucket = max(len(p) for p in prompts)
    G = args.gen_length
    graphdef, params = nnx.split(model)

    def programs(schedule):
        def first(params, canvas, pad_len, live, rng):
            return driver.build_loop(graphdef, params, canvas, pad_len, live, rng,
                                     schedule=schedule)[0]

        def step(params, canvas, pad_len, live, rng, st):
            return driver.build_loop(graphdef, params, canvas, pad_len, live, rng,
                                     schedule=schedule)[1](st)
        return jax.jit(first), jax.jit(step)

    scheds = [make_schedule(name, gen_length=G, **opts).bind(tok, cfg)
              for _, name, opts in variants]
    progs = [programs(s) for s in scheds]

    def decode(k, i):
        """Steps variant k on problem i; returns the tokens and the per-call records."""
        canvas, pad_len, P = build_canvas([prompts[i]], G, cfg, bucket)
        call = (params, jnp.asarray(canvas), jnp.asarray(pad_len), jnp.ones((1,), bool),
                jax.random.key(0))
        first, step = progs[k]
        st = first(*call)
        calls = [{"full": True, "stale": {}, "forks": []}]  # the first call: nothing stale
        j = np.arange(G)
        while not bool(st.finished[0]) and int(st.step) < scheds[k].max_iterations():
            sc = jax.device_get(st.sched)
            gen = np.asarray(st.canvas)[0, P:]
            committed = gen != cfg.mask_token_id
            vis = int(sc.visible[0]) if not bool(sc.extend[0]) else G
            stale0 = committed & ~np.asarray(sc.fresh[0]) & (j < vis)
            nfe_full = int(st.nfe_full)
            forks0 = int(sc.forks[0])
            st = step(*call, st)
            sc1 = jax.device_get(st.sched)
            full = int(st.nfe_full) > nfe_full
            stale = stale0 & ~np.asarray(sc1.fresh[0]) if not full else np.zeros(G, bool)
            win = int(sc.win[0])
            refine = np.zeros(G, bool)
            for m in range(sc.kind.shape[1]):
                if sc.kind[0, m] == REFINE:
                    refine |= (j >= sc.start[0, m]) & (j < sc.end[0, m])
            tail = j > int(sc.eos[0])  # filled with end-of-text by the cascade
            text = stale & ~tail
            rec = {"full": full, "stale": {
                "refine lane": int((text & refine).sum()),
                "before the window": int((text & ~refine & (j < win)).sum()),
                "in or after the window": int((text & ~refine & (j >= win)).sum()),
                "end-of-text tail": int((stale & tail).sum())},
                "forks": []}
            if int(sc1.forks[0]) > forks0:  # a fork at the end of this call
                new = np.asarray(st.canvas)[0, P:]
                m = int(sc1.gen_slot[0])
                par = int(sc1.parent[0, m])
                lo, hi = int(sc1.start[0, par]), int(sc1.end[0, par])
                span = slice(lo, hi)
                fresh1 = np.asarray(sc1.fresh[0])
                rec["forks"].append({
                    "prefix": hi - lo,
                    "masked": int((new[span] == cfg.mask_token_id).sum()),
                    "dirty": int(((new[span] != cfg.mask_token_id) & ~fresh1[span]).sum())})
            calls.append(rec)
        st = jax.device_get(st)
        sc = st.sched
        spans = [(int(sc.start[0, m]), int(sc.end[0, m]), int(sc.split[0, m]))
                 for m in range(sc.kind.shape[1]) if sc.split[0, m] >= 0]
        return (np.asarray(st.canvas)[0, P:], np.asarray(st.commit_step)[0], calls, spans,
                int(st.row_steps[0]), int(st.row_full[0] + st.row_partial[0]),
                int(st.row_full[0]))

    for k in range(len(variants)):  # the stepped loop decodes as generate does
        for i in range(min(args.check, args.n)):
            ref = generate(model, [prompts[i]], sampler=variants[k][1], gen_length=G,
                           bucket=bucket, tokenizer=tok, **variants[k][2]).tokens[0]
            got = decode(k, i)[0]
            if not np.array_equal(ref, got):
                raise SystemExit(f"{labels[k]}: the stepped loop differs from generate on "
                                 f"problem {i}")

    recs = [[] for _ in variants]
    for i in range(args.n):
        for off in range(len(variants)):
            k = (i + off) % len(variants)
            tokens, cstep, calls, spans, steps, ncalls, nfull = decode(k, i)
            stale = collections.Counter()
            for c in calls:
                stale.update(c["stale"])
            recs[k].append({
                "problem": i, "ok": bool(evaluate.check(problems[i], tokens)),
                "tokens": tokens.tolist(), "commit_step": cstep.tolist(),
                "steps": steps, "calls": ncalls, "full_calls": nfull,
                "stale": dict(stale),
                "stale_calls": sum(any(v for key, v in c["stale"].items()
                                       if key != "end-of-text tail") for c in calls),
                "stale_by_call": [sum(v for key, v in c["stale"].items()
                                      if key != "end-of-text tail") for c in calls],
                "at_fork": [f for c in calls for f in c["forks"]],
                "refine_spans": spans})
        if (i + 1) % 25 == 0:
            print(f"{i + 1}/{args.n}", file=sys.stderr, flush=True)

    ref = labels.index(args.reference) if args.reference in labels else 0
    rows = []
    for k, label in enumerate(labels):
        rs = recs[k]
        kinds = collections.Counter()
        in_refine = 0
        stale_at_commit = []
        wrong = 0
        for r, q in zip(rs, recs[ref]):
            if r["ok"] or not q["ok"]:
                continue
            wrong += 1
            diff = np.flatnonzero(np.asarray(r["tokens"]) != np.asarray(q["tokens"]))
            if not diff.size:
                continue
            p = int(diff[0])
            kinds[classify(tok, q["tokens"], p, eos_ids)] += 1
            t = r["commit_step"][p]
            in_refine += any(a <= p < b and s < t for a, b, s in r["refine_spans"])
            # The call that committed p is call t (call 0 is the first call).
            stale_at_commit.append(r["stale_by_call"][t] if 0 <= t < len(r["stale_by_call"])
                                   else 0)
        forks = [f for r in rs for f in r["at_fork"]]
        stale_tot = collections.Counter()
        for r in rs:
            stale_tot.update(r["stale"])
        row = {"variant": label, "sampler": variants[k][1], "options": variants[k][2],
               "n": len(rs), "accuracy": float(np.mean([r["ok"] for r in rs])),
               "steps": float(np.mean([r["steps"] for r in rs])),
               "calls": float(np.mean([r["calls"] for r in rs])),
               "full_calls": float(np.mean([r["full_calls"] for r in rs])),
               "stale_per_problem": {key: v / len(rs) for key, v in stale_tot.items()},
               "stale_calls": float(np.mean([r["stale_calls"] for r in rs])),
               "forks": len(forks) / len(rs),
               **{f"fork_prefix_{key}": (float(np.mean([f[name] for f in forks]))
                                          if forks else None)
                  for key, name in (("masked", "masked"), ("dirty", "dirty"),
                                    ("len", "prefix"))},
               "lost_vs_ref": wrong,
               "first_diff_kind": dict(kinds.most_common()),
               "first_diff_committed_by_refine_lane": in_refine,
               "first_diff_stale_at_commit_mean": (float(np.mean(stale_at_commit))
                                                   if stale_at_commit else None),
               f"acc_diff_vs_{labels[ref]}": paired_diff(rs, recs[ref])}
        rows.append(row)
        d = row[f"acc_diff_vs_{labels[ref]}"]
        print(f"{label}: acc {100 * row['accuracy']:.1f}% ({100 * d['diff']:+.1f} "
              f"[{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]) steps "
              f"{row['steps']:.2f} calls {row['calls']:.2f} full {row['full_calls']:.2f} "
              f"stale/problem {row['stale_per_problem']} stale calls {row['stale_calls']:.2f} "
              f"forks {row['forks']:.2f} prefix len/masked/dirty {row['fork_prefix_len']}/"
              f"{row['fork_prefix_masked']}/{row['fork_prefix_dirty']} lost {wrong}: "
              f"{row['first_diff_kind']} by refine lane {in_refine} stale at commit "
              f"{row['first_diff_stale_at_commit_mean']}")
    meta = {"model": args.model, "gen_length": G, "n": args.n, "batch": 1,
            "split": "heldout", "reference": labels[ref],
            "command": shlex.join(["python", "experiments/asynclane_fork_diagnosis.py",
                                   *sys.argv[1:]])}
    out = pathlib.Path(args.out or RESULTS / f"asynclane_fork_diagnosis_"
                       f"{pathlib.Path(args.model).name}_{G}.json")
    for rs in recs:  # keep the JSON small: the per-call lists are summarized above,
        for r in rs:  # and the tokens end at the first end-of-text (the rest is too)
            del r["stale_by_call"], r["commit_step"]
            cut = next((i for i, t in enumerate(r["tokens"]) if t in eos_ids), G - 1)
            r["tokens"] = r["tokens"][:cut + 1]
    out.write_text(json.dumps({"meta": meta, "rows": rows,
                               "problems": {lab: recs[k] for k, lab in enumerate(labels)}})
                   + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
