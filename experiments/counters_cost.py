"""What the call-shape counters cost a decode: the same decodes with and without them.

The driver counts every model call by shape in the loop state (`ModelCalls.count`:
`shape_calls`, `row_shape_calls`, `row_shape_keys`, a few scalar and [b] adds per
call). Here each sampler decodes the same problems twice per round, once as shipped
and once with `ModelCalls.count` replaced by a no-op (the counter arrays are still
carried, never written), the two compiled programs kept apart, the order alternating
from round to round. Tokens must be identical; the decode time (the compiled loop,
`stats.decode_time`) is summed over the problems per round and the ratio taken per
round, so that a slow spell of a shared machine hits both sides of a pair.

Results: experiments/results/decode/counters_cost.{md,json}.

Usage: python experiments/counters_cost.py [--model tiny-llada-v4b] [--problems 20]
       [--rounds 5] [--gen-length 512]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import subprocess
import sys

import numpy as np

import asynclane_jax
from asynclane_jax.decoding import driver, generate
from asynclane_jax.testbed import evaluate, tasks

RESULTS = pathlib.Path(__file__).parent / "results" / "decode"
SAMPLERS = (("fast-dllm", {"cache": "dual"}), ("asynclane", {}))


def _no_count(self, st, *args, **kwargs):
    return st


def decode(model, tok, prompts, sampler, opts, gen_length, counters: bool, caches):
    """Every prompt decoded at batch 1 with (or without) the counters; returns the
    tokens and the summed decode seconds."""
    shipped = driver.ModelCalls.count
    driver.PROGRAMS, saved = caches[counters], driver.PROGRAMS
    if not counters:
        driver.ModelCalls.count = _no_count
    try:
        bucket = max(len(p) for p in prompts)
        out, seconds = [], 0.0
        for p in prompts:
            r = generate(model, [p], sampler=sampler, gen_length=gen_length,
                         tokenizer=tok, bucket=bucket, **opts)
            out.append(r.tokens)
            seconds += r.stats.decode_time
        return np.concatenate(out), seconds
    finally:
        driver.ModelCalls.count = shipped
        driver.PROGRAMS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llada-v4b")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gen-length", type=int, default=512)
    args = ap.parse_args()
    command = " ".join(["python experiments/counters_cost.py", *sys.argv[1:]])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=pathlib.Path(__file__).parent).stdout.strip()
    model, tok, _ = asynclane_jax.load(args.model)
    prompts = evaluate.prompts_for(tasks.split("heldout", args.problems, "v4"), tok)
    caches = {True: driver.ProgramCache(8), False: driver.ProgramCache(8)}
    rows = []
    for sampler, opts in SAMPLERS:
        # A warm-up decode each way compiles both programs.
        for side in (True, False):
            decode(model, tok, prompts[:1], sampler, opts, args.gen_length, side, caches)
        ratios, secs = [], {True: [], False: []}
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {}
            for side in order:
                got[side] = decode(model, tok, prompts, sampler, opts, args.gen_length,
                                   side, caches)
            if not np.array_equal(got[True][0], got[False][0]):
                raise SystemExit(f"{sampler}: tokens differ with and without the counters")
            for side in (True, False):
                secs[side].append(got[side][1])
            ratios.append(got[True][1] / got[False][1])
            print(f"{sampler} round {r}: with {got[True][1]:.2f} s, without "
                  f"{got[False][1]:.2f} s, ratio {ratios[-1]:.3f}", flush=True)
        row = {"sampler": sampler, "options": opts, "with_s": secs[True],
               "without_s": secs[False], "ratios": ratios,
               "median_ratio": statistics.median(ratios),
               "min_ratio": min(ratios), "max_ratio": max(ratios)}
        rows.append(row)
    data = {"command": command, "commit": commit, "model": args.model,
            "problems": args.problems, "rounds": args.rounds,
            "gen_length": args.gen_length,
            "machine": f"{platform.machine()} {platform.system()}, "
                       f"{len(__import__('os').sched_getaffinity(0))} CPUs",
            "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "counters_cost.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        "# What the call-shape counters cost a decode",
        "",
        f"Made by `{command}` at commit {commit}, {data['machine']}. {args.model}, "
        f"gen_length {args.gen_length}, the first {args.problems} held-out v4 problems "
        f"at batch 1, {args.rounds} rounds. Each round decodes every problem with the "
        "counters (as shipped) and without them (`ModelCalls.count` a no-op), the order "
        "alternating; tokens identical in every round. Decode seconds summed over the "
        "problems; ratio = with / without, per round.",
        "",
        "| sampler | with, s (median) | without, s (median) | ratio, median | ratio, "
        "min-max |",
        "|---|--:|--:|--:|--:|",
    ]
    for row in rows:
        name = row["sampler"] + "".join(f":{k}={v}" for k, v in row["options"].items())
        lines.append(f"| {name} | {statistics.median(row['with_s']):.2f} | "
                     f"{statistics.median(row['without_s']):.2f} | "
                     f"{row['median_ratio']:.3f} | {row['min_ratio']:.3f}-"
                     f"{row['max_ratio']:.3f} |")
    (RESULTS / "counters_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
