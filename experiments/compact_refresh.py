"""A driver switch on and off at batch 8, interleaved: compacted full forwards
(`--switch compact`, `driver.COMPACT_FULL`: a full forward that serves at most half the
rows computes only those rows, gathered into a bucket of 1, 2 or 4 rows, instead of all
8) or mixed calls (`--switch mixed`, `driver.MIXED_CALLS`: the rows due a full forward
served in the same model call as the others' cached queries, `DiffusionLM.forward_mixed`,
instead of the others waiting an iteration).

Decodes the first `--n` held-out problems of the model's task set, `--batch` at a time,
with one sampler (`--sampler`, a bench spec: AsyncLane's defaults unless given), once
with the switch on and once off on every batch, alternating which goes first; both
programs compiled on the first batch before anything is timed. Counts the rows whose
tokens, commit steps or per-row call counts differ between the two (none expected), and
reports tokens/s (tokens before the first end-of-text over the compiled loop's
`decode_time`), the calls by shape, and the model calls priced by the cost model
(asynclane_jax.costs) on the v5e, v6e and H200 chips at 8B size. --out: another place
for the JSON (a run elsewhere).

Results: experiments/results/decode/compact_refresh.{md,json} (compact),
experiments/results/decode/mixed_calls_*.{md,json} (mixed).

Usage: python experiments/compact_refresh.py [--switch compact|mixed]
       [--sampler SPEC] [--model tiny-llada-v4b] [--n 128] [--batch 8]
       [--gen-length 512]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import platform
import shlex
import subprocess
import sys

import jax
import numpy as np

import asynclane_jax
from asynclane_jax.bench import project, spec
from asynclane_jax.costs import roofline
from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.testbed import evaluate, tasks

RESULTS = pathlib.Path(__file__).parent / "results" / "decode"
CHIPS = (("v5e", "int8"), ("v6e", "bf16"), ("h200", "bf16"))
# Per-row figures that a switch must not change (those the sampler's stats have).
SAME = ("commit_step", "row_steps", "row_nfe_full", "row_nfe_partial", "refreshes")
SWITCHES = {"compact": driver.COMPACT_FULL, "mixed": driver.MIXED_CALLS}


def decode(model, tokenizer, prompts, bucket, gen_length, sampler, options, switch, on):
    with driver.switched(switch, on):
        return generate(model, prompts, sampler=sampler, gen_length=gen_length,
                        bucket=bucket, tokenizer=tokenizer, **options)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada-v4b")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="compact")
    ap.add_argument("--sampler", default="asynclane",
                    help="a bench spec, NAME:key=value:... (no alternatives)")
    ap.add_argument("--out", default=None,
                    help="default: results/decode/compact_refresh.json (compact), "
                         "mixed_calls_MODEL_SAMPLER_GEN.json (mixed)")
    args = ap.parse_args()
    sampler, combos = spec.parse_spec(args.sampler)
    if len(combos) != 1:
        ap.error(f"--sampler {args.sampler!r}: give one value per option")
    options, switch = combos[0], SWITCHES[args.switch]
    if args.out is None:
        args.out = str(RESULTS / ("compact_refresh.json" if args.switch == "compact" else
                                  f"mixed_calls_{args.model}_{sampler}_{args.gen_length}.json"))

    model, tokenizer, _ = asynclane_jax.load(args.model)
    problems = tasks.split("heldout", args.n, tasks.model_task_set(args.model))
    prompts = evaluate.prompts_for(problems, tokenizer)
    bucket = max(len(p) for p in prompts)
    chunks = [range(s, min(s + args.batch, args.n)) for s in range(0, args.n, args.batch)]
    run = lambda rows, on: decode(model, tokenizer, [prompts[j] for j in rows], bucket,
                                  args.gen_length, sampler, options, switch, on)
    for on in (True, False):  # compile both before timing anything
        run(chunks[0], on)

    runs = {on: dict(time=0.0, tokens=0, right=0, calls=collections.Counter(),
                     row_calls=collections.Counter()) for on in (True, False)}
    differ, mismatch = 0, dict.fromkeys(SAME, 0)
    for c, chunk in enumerate(chunks):
        got = {}
        for on in ((True, False) if c % 2 == 0 else (False, True)):
            res = run(chunk, on)
            got[on] = res
            r = runs[on]
            r["time"] += res.stats.decode_time
            r["tokens"] += int(sum(res.stats.generated_tokens))
            r["right"] += sum(evaluate.check(problems[j], row)
                              for j, row in zip(chunk, res.tokens))
            for d in res.stats.calls_by_shape():
                shape = CallShape.from_dict(d)
                r["calls"][shape] += d["calls"]
                r["row_calls"][shape] += d["row_calls"]
        differ += int(np.sum(got[True].tokens != got[False].tokens))
        for f in SAME:  # rows whose figure differs with the switch (none expected)
            if not hasattr(got[True].stats, f):
                mismatch.pop(f, None)
                continue
            mismatch[f] += int(np.sum(np.any(
                (np.asarray(getattr(got[True].stats, f)) != np.asarray(
                    getattr(got[False].stats, f))).reshape(len(chunk), -1), axis=1)))
        print(f"batch {c + 1}/{len(chunks)}: {runs[True]['time']:.1f}s on, "
              f"{runs[False]['time']:.1f}s off", file=sys.stderr, flush=True)

    cfg8 = project.project_model_config(None, model.cfg.family)
    out = {}
    for on, r in runs.items():
        counts = list(r["calls"].items())
        out["on" if on else "off"] = {
            "decode_time": r["time"], "tokens": r["tokens"], "right": r["right"],
            "tokens_per_s": r["tokens"] / r["time"],
            "calls": [{**s.to_dict(), "calls": n, "row_calls": r["row_calls"][s]}
                      for s, n in sorted(counts, key=lambda x: (x[0].kind, -x[0].rows))],
            "projected_tokens_per_s": {
                project.label(chip, w): roofline.tokens_per_s(chip, cfg8, counts,
                                                              r["tokens"], w)
                for chip, w in CHIPS}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"command": shlex.join(["python", "experiments/compact_refresh.py",
                                   *sys.argv[1:]]),
            "commit": commit, "switch": args.switch, "sampler": sampler,
            "options": options, "model": args.model, "n": args.n, "batch": args.batch,
            "gen_length": args.gen_length, "bucket": bucket,
            "machine": f"{platform.machine()} CPU, {platform.processor() or ''}".strip(", "),
            "backend": jax.default_backend(), "tokens_differ": differ,
            "rows_differ": mismatch,
            "project_model": project.DEFAULT_PROJECT_MODELS[model.cfg.family]}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "runs": out}, indent=1) + "\n")
    print(json.dumps({"meta": meta, "runs": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
