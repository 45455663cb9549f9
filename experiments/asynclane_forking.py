"""AsyncLane with forking on and off, against the equal-footing baselines.

Every variant decodes the same held-out problems of the testbed in one process, batch 1,
interleaved problem by problem (in `bench.runner.run_order`'s order), compilation
excluded (one warm-up call per variant), as `asynclane-jax bench` does. Per variant it
reports, besides the bench's accuracy, tokens/s (tokens before the first end-of-text per
second of decoding) and model calls per token:
  steps: mean iterations serving a problem;
  idle: mean iterations that committed no position (LaneStats.idle_steps);
  overlap: mean iterations in which a refine lane was alive (holding a mask) and a
    position outside every live refine lane committed (refinement and advancement at
    once);
  forks, refine lanes (lanes forked with masks left) and their mean lifetime in
    iterations (death - split);
  wrong: length / value: wrong answers with a wrong number of lines (the answer sized
    wrongly) and with the right number (a wrong value);
  acc_diff_vs: accuracy minus the reference variant's on the same problems, with a 95%
    paired bootstrap interval (2000 resamples).
Per-problem records are saved too (with the family; "problem" is the index among the
problems kept), so any other comparison can be made from the JSON, and accuracy is
reported per family. The problems are the held-out split of the model's task set
(--tasks to choose another), optionally only some of its families (--families).
With --first N they are instead those of the first N held-out problems (the order of
`asynclane-jax bench` and `testbed.evaluate`) that are in --families and in the
answer-length --buckets, --n at most; their indices in the split are saved.

--reference-file FILE takes the per-problem results of a `testbed.evaluate` run on the
same problems (e.g. vanilla, too slow to decode beside the others) and adds every
variant's paired difference against it (`acc_diff_vs_file`, the same bootstrap).

Usage: python experiments/asynclane_forking.py --model tiny-llada [--n 200]
       [--gen-length 256] [--variant NAME=SAMPLER:key=value:...]... [--out FILE]
       [--first N --buckets '>256'] [--reference-file EVAL.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results" / "asynclane"
# Results saved before the defaults changed (forking on, refresh_travel=32, no
# relaxation, no visible horizon) ran `asynclane` with the old defaults, whose options
# (relaxed_threshold, horizon, refresh_at_fork, fork_when_fresh, renew) have since been
# removed (docs/asynclane.md, "Removed options"); their JSON files name them in their
# meta, and their rows hold the mean renewal calls per problem (`renewals`).
EQUAL_FOOTING = "cascade=true:early_stop=true:cache=dual"  # the bench's (c), dual cache
DEFAULT_VARIANTS = (
    "lanes-off=asynclane:max_lanes=1",
    "default=asynclane",
    f"fast-dllm-equal=fast-dllm:{EQUAL_FOOTING}",
    f"localleap-equal=localleap:{EQUAL_FOOTING}",
)


def parse_variant(text: str) -> tuple[str, str, dict]:
    from asynclane_jax.bench.spec import parse_spec

    label, eq, spec = text.partition("=")
    if not eq:
        raise SystemExit(f"--variant {text!r}: expected NAME=SAMPLER[:key=value...]")
    name, combos = parse_spec(spec)
    if len(combos) != 1:
        raise SystemExit(f"--variant {text!r}: no alternatives (|) here")
    return label, name, combos[0]


def overlap_iterations(stats, row: int) -> int:
    """Iterations in which a refine lane holding a mask was alive and some position
    outside every such lane committed."""
    kind_split = stats.lane_split[row]
    lanes = [(int(stats.lane_start[row, m]), int(stats.lane_end[row, m]),
              int(kind_split[m]), int(stats.lane_death[row, m]))
             for m in range(kind_split.shape[0]) if kind_split[m] >= 0]
    step = np.asarray(stats.commit_step[row])
    n = 0
    for t in range(int(stats.row_steps[row])):
        # A lane forked at s refines in iterations s + 1 .. death (it forked at the end
        # of iteration s); alive at t when s < t <= death (death -1: never finished).
        alive = [(a, b) for a, b, s, d in lanes if s < t and (d < 0 or t <= d) and d != s]
        if not alive:
            continue
        j = np.flatnonzero(step == t)
        outside = [p for p in j if not any(a <= p < b for a, b in alive)]
        n += bool(outside)
    return n


def line_counts(problem, row) -> dict:
    """Working lines right, in the reference and in the output (a wrong line count is
    an answer sized wrongly; the same count with a line wrong is a wrong value)."""
    from asynclane_jax.testbed import tasks

    right, ref = tasks.line_accuracy(problem, row)
    out = len(tasks.parse_lines(tasks.response_text(tasks.tokenizer.decode_ids(row))))
    return {"lines_right": right, "lines_ref": ref, "lines_out": out}


def record(res, problems, idx, check) -> list[dict]:
    st = res.stats
    out = []
    for r, row in enumerate(res.tokens):
        rec = {"problem": idx[r], "family": problems[idx[r]].family,
               "ok": bool(check(problems[idx[r]], row)),
               "tokens": int(st.generated_tokens[r]),
               "calls": int(st.row_nfe_full[r] + st.row_nfe_partial[r]),
               "full_calls": int(st.row_nfe_full[r]), "steps": int(st.row_steps[r]),
               **line_counts(problems[idx[r]], row)}
        if getattr(st, "idle_steps", None) is not None:
            split, death = st.lane_split[r], st.lane_death[r]
            life = [int(d - s) for s, d in zip(split, death) if s >= 0 and d > s]
            rec.update(idle=int(st.idle_steps[r]), forks=int(st.forks[r]),
                       refine_lifetimes=life, overlap=overlap_iterations(st, r))
        else:  # a baseline: idle iterations from the commit steps
            committed = set(np.asarray(st.commit_step[r]).tolist()) - {-1}
            rec.update(idle=int(st.row_steps[r]) - len(committed), forks=0,
                       refine_lifetimes=[], overlap=0)
        out.append(rec)
    return out


def summarize(recs: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in recs)
    calls = sum(r["calls"] for r in recs)
    life = [x for r in recs for x in r["refine_lifetimes"]]
    families = sorted({r["family"] for r in recs})
    return {"n": len(recs), "accuracy": float(np.mean([r["ok"] for r in recs])),
            "by_family": {f: float(np.mean([r["ok"] for r in recs if r["family"] == f]))
                          for f in families},
            "tps": tokens / wall if wall else 0.0, "calls_per_token": calls / tokens,
            "steps": float(np.mean([r["steps"] for r in recs])),
            "idle": float(np.mean([r["idle"] for r in recs])),
            "overlap": float(np.mean([r["overlap"] for r in recs])),
            "forks": float(np.mean([r["forks"] for r in recs])),
            "refine_lanes": len(life) / len(recs),
            "refine_lifetime": float(np.mean(life)) if life else None,
            "full_calls": float(np.mean([r["full_calls"] for r in recs])),
            # wrong answers by kind: a wrong number of lines, or the right number
            "wrong_length": sum(not r["ok"] and r["lines_out"] != r["lines_ref"]
                                for r in recs),
            "wrong_value": sum(not r["ok"] and r["lines_out"] == r["lines_ref"]
                               for r in recs),
            "wall_s": wall}


def reference_records(path: str, split_index: list[int]) -> list[dict]:
    """[{"ok"}] for each problem of split_index, from a `testbed.evaluate` JSON that
    decoded it (its `problems` are indices in the split; without them, its problems are
    the split's first ones)."""
    data = json.loads(pathlib.Path(path).read_text())
    theirs = data.get("problems") or list(range(len(data["per_problem"])))
    ok = {i: bool(r[0]) for i, r in zip(theirs, data["per_problem"])}
    missing = [i for i in split_index if i not in ok]
    if missing:
        raise SystemExit(f"--reference-file {path}: it did not decode {len(missing)} of "
                         f"these problems (the first: held-out problem {missing[0]})")
    return [{"ok": ok[i]} for i in split_index]


def paired_diff(a: list[dict], b: list[dict], seed: int = 0) -> dict:
    x = np.array([r["ok"] for r in a], float) - np.array([r["ok"] for r in b], float)
    rng = np.random.default_rng(seed)
    boots = rng.choice(x, (2000, len(x)), replace=True).mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {"diff": float(x.mean()), "ci95": [float(lo), float(hi)],
            "only_this_right": int((x > 0).sum()), "only_ref_right": int((x < 0).sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=SAMPLER[:key=value...] (repeatable; default: the five above)")
    ap.add_argument("--reference", default="lanes-off", help="variant the accuracy "
                    "differences are taken against")
    ap.add_argument("--tasks", default=None, metavar="v1|v2|v3|v4",
                    help="testbed task set (default: the model's)")
    ap.add_argument("--families", default=None,
                    help="comma-separated families to keep (default: all of the set); "
                         "--n counts the problems kept")
    ap.add_argument("--first", type=int, default=None,
                    help="take the problems from the first N held-out ones (in the split's "
                         "order), those in --families and --buckets")
    ap.add_argument("--buckets", default=None,
                    help="with --first: comma-separated answer-length buckets to keep "
                         "(<=64, 65-128, 129-256, >256)")
    ap.add_argument("--reference-file", default=None,
                    help="a testbed.evaluate JSON of the same problems: each variant's "
                         "paired accuracy difference against it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if (args.buckets or args.reference_file) and args.first is None:
        ap.error("--buckets and --reference-file need --first")

    import asynclane_jax
    from asynclane_jax.bench.runner import run_order
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import evaluate, tasks

    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    model, tok, _ = asynclane_jax.load(args.model)
    task_set = args.tasks or tasks.model_task_set(args.model)
    keep = set(args.families.split(",")) if args.families else set(tasks.families_of(task_set))
    unknown = keep - set(tasks.families_of(task_set))
    if unknown:
        raise SystemExit(f"--families: {', '.join(sorted(unknown))} not in {task_set}")
    if args.first is None:
        problems = [p for p in tasks.heldout(len(tasks.families_of(task_set)) * args.n,
                                             task_set) if p.family in keep][:args.n]
        split_index = None
    else:
        pool = tasks.split("heldout", args.first, task_set)
        buckets = args.buckets.split(",") if args.buckets else None
        try:
            split_index = evaluate.select(pool, task_set, sorted(keep), buckets)[:args.n]
        except ValueError as e:
            raise SystemExit(f"--first/--buckets: {e}") from None
        problems = [pool[i] for i in split_index]
        args.n = len(problems)
    reference = None
    if args.reference_file:
        reference = reference_records(args.reference_file, split_index)
    prompts = evaluate.prompts_for(problems, tok)
    bucket = max(len(p) for p in prompts)
    G = args.gen_length

    def run(k, i):
        _, name, opts = variants[k]
        return generate(model, [prompts[i]], sampler=name, gen_length=G, bucket=bucket,
                        tokenizer=tok, **opts)

    compile_s = [run(k, 0).stats.compile_time for k in range(len(variants))]
    recs = [[] for _ in variants]
    wall = [0.0] * len(variants)
    for i in range(args.n):
        for k in run_order(i, len(variants)):
            res = run(k, i)
            wall[k] += res.stats.decode_time
            recs[k] += record(res, problems, [i], evaluate.check)
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{args.n}", file=sys.stderr, flush=True)

    ref = [v[0] for v in variants].index(args.reference) if args.reference in \
        [v[0] for v in variants] else 0
    rows = []
    for k, (label, name, opts) in enumerate(variants):
        row = {"variant": label, "sampler": name, "options": opts,
               **summarize(recs[k], wall[k]), "compile_s": compile_s[k],
               f"acc_diff_vs_{variants[ref][0]}": paired_diff(recs[k], recs[ref])}
        if reference is not None:
            row["acc_diff_vs_file"] = paired_diff(recs[k], reference)
        rows.append(row)
    meta = {"model": args.model, "gen_length": G, "n": args.n, "batch": 1,
            "split": "heldout", "task_set": task_set, "families": sorted(keep),
            "reference": variants[ref][0], "first": args.first, "buckets": args.buckets,
            "split_index": split_index, "reference_file": args.reference_file,
            **({} if reference is None else {
                "reference_file_accuracy": float(np.mean([r["ok"] for r in reference]))}),
            "command": shlex.join(["python", "experiments/asynclane_forking.py",
                                   *sys.argv[1:]])}
    if reference is not None:
        print(f"{args.reference_file}: {100 * np.mean([r['ok'] for r in reference]):.1f}% "
              f"of the same {len(reference)} problems")
        for r in rows:
            d = r["acc_diff_vs_file"]
            print(f"  {r['variant']}: {100 * r['accuracy']:.1f}%, {100 * d['diff']:+.1f} "
                  f"[{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}] against it "
                  f"(only it right {d['only_ref_right']}, only {r['variant']} right "
                  f"{d['only_this_right']})")
    head = ("variant", "accuracy", "diff vs ref [95% CI]", "tok/s", "calls/token", "steps",
            "idle", "overlap", "forks", "refine lanes", "lifetime", "wrong: length / value")
    print(" | ".join(head))
    for r in rows:
        d = r[f"acc_diff_vs_{variants[ref][0]}"]
        print(" | ".join([r["variant"], f"{100 * r['accuracy']:.1f}%",
                          f"{100 * d['diff']:+.1f} [{100 * d['ci95'][0]:+.1f}, "
                          f"{100 * d['ci95'][1]:+.1f}]",
                          f"{r['tps']:.0f}", f"{r['calls_per_token']:.3f}",
                          f"{r['steps']:.2f}", f"{r['idle']:.2f}", f"{r['overlap']:.2f}",
                          f"{r['forks']:.2f}", f"{r['refine_lanes']:.2f}",
                          "-" if r["refine_lifetime"] is None else f"{r['refine_lifetime']:.2f}",
                          f"{r['wrong_length']} / {r['wrong_value']}"]))
    out = pathlib.Path(args.out or RESULTS / f"asynclane_forking_{pathlib.Path(args.model).name}"
                       f"_{G}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows,
                               "problems": {v[0]: recs[k] for k, v in enumerate(variants)}},
                              indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
