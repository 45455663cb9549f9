"""Compile time with JAX's persistent compilation cache: a second process that builds
the same decode program reads it from the cache instead of compiling it.

For each sampler, two fresh processes run `asynclane-jax generate --json
--compile-cache DIR` on the same prompt (tiny-llada by default); the first fills an
empty DIR, the second finds its program there. Reported: each process's
`stats.compile_time` (tracing + lowering + compiling, or loading) and the ratio
second / first. Writes experiments/results/compile/compile_cache.md with --write.

    python experiments/compile_cache.py [--model tiny-llada] [--gen-length 256] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

RESULTS = pathlib.Path(__file__).parent / "results" / "compile"
PROMPT = "ann has 7 coins . (1) finds 2 (2) loses 5 (3) buys 4 (4) eats 1 . how many coins ?"


def run(model: str, sampler: str, gen_length: int, cache: str) -> dict:
    cmd = [sys.executable, "-m", "asynclane_jax.cli", "generate", "--json", "--chat",
           "--model", model, "--sampler", sampler, "--gen-length", str(gen_length),
           "--compile-cache", cache, PROMPT]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.stdout.strip().splitlines()[-1])["stats"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--samplers", default="asynclane,fast-dllm,vanilla")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for sampler in args.samplers.split(","):
        with tempfile.TemporaryDirectory() as cache:
            first = run(args.model, sampler, args.gen_length, cache)
            entries = len(list(pathlib.Path(cache).iterdir()))
            second = run(args.model, sampler, args.gen_length, cache)
        rows.append({"sampler": sampler, "first_s": first["compile_time"],
                     "second_s": second["compile_time"], "cache_entries": entries,
                     "ratio": second["compile_time"] / first["compile_time"]})
        print(json.dumps(rows[-1]))
    lines = ["# Persistent compilation cache", "",
             f"`python experiments/compile_cache.py --model {args.model} --samplers "
             f"{args.samplers} --gen-length {args.gen_length} --write`", "",
             "Two fresh processes per sampler run `asynclane-jax generate --compile-cache "
             "DIR` on the same prompt; the first fills an empty DIR. Compile time is "
             "`stats.compile_time` (trace, lower, compile or load from the cache). "
             "On this machine's CPUs (2 cores, shared).", "",
             "| sampler | first process s | second process s | second / first | entries |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['sampler']} | {r['first_s']:.2f} | {r['second_s']:.2f} | "
              f"{r['ratio']:.2f} | {r['cache_entries']} |" for r in rows]
    if args.write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "compile_cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
