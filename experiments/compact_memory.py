"""What the compacted full forwards cost in TPU memory at 8B: each decode compiled ahead of
time for a TPU slice (`asynclane_jax.aot.compile_for_topology`, no TPU, no weights; needs
the tpu extra) with compaction on and off (`driver.COMPACT_FULL`), interleaved, so the
per-chip temporaries and peak of the two programs stand side by side.

A compacted full forward gathers the rows it serves into a bucket of 1, 2, 4, ... rows
(at most half the batch) with a fresh K/V cache of that many rows (driver.py,
`ModelCalls.full_compact`), so the program holds one more cache of up to half the batch.
Compaction is on for AsyncLane and for the block samplers with a cache.

Results: experiments/results/compile/compact_memory.{md,json}.

Usage: python experiments/compact_memory.py [--out experiments/results/compile/compact_memory]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import subprocess
import sys

RESULTS = pathlib.Path(__file__).parent / "results" / "compile"
GIB = 2 ** 30
# (topology, mesh, quantize, sampler, options): the one-chip int8 case and the v5e-8
# slice, the layouts the compile results already size (memory-8b.md), at batch 8, 512.
CASES = (
    ("v5e:1x1", "tensor", "int8", "asynclane", {}),
    ("v5e:1x1", "tensor", "int8", "fast-dllm", {"cache": "dual", "row_refresh": True}),
    ("v5e:2x4", "data=1,tensor=8", None, "asynclane", {}),
)
MODEL = "llada-8b-instruct"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                              capture_output=True, check=True,
                              cwd=pathlib.Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "compact_memory"))
    args = ap.parse_args(argv)

    from asynclane_jax import aot
    from asynclane_jax.decoding import driver

    rows = []
    for topology, mesh, quantize, sampler, options in CASES:
        for on in (True, False):
            with driver.switched(driver.COMPACT_FULL, on):
                rep = aot.compile_for_topology(
                    MODEL, sampler=sampler, options=options, gen_length=512, batch=8,
                    prompt_len=128, topology=topology, mesh=mesh, quantize=quantize,
                    scan_layers=True)
            row = dict(topology=topology, mesh=mesh, quantize=quantize or "none",
                       sampler=sampler, options=options, compact=on, **{
                           k: getattr(rep, k) for k in (
                               "temp_bytes", "peak_bytes", "argument_bytes",
                               "hbm_bytes", "fits", "compile_s")})
            rows.append(row)
            print(f"{topology} {sampler} compact={on}: temporaries "
                  f"{row['temp_bytes'] / GIB:.2f} GiB, peak {row['peak_bytes'] / GIB:.2f} GiB, "
                  f"compiled in {row['compile_s']:.0f} s", flush=True)

    command = "python " + " ".join(shlex.quote(a) for a in [
        "experiments/compact_memory.py", *(argv if argv is not None else sys.argv[1:])])
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "commit": _commit(), "date": when, "model": MODEL,
         "gen_length": 512, "batch": 8, "prompt_len": 128, "scan_layers": True,
         "rows": rows}, indent=1))
    lines = [
        "# Compacted full forwards: TPU memory at 8B", "",
        f"Made by `{command}` at {_commit()}, {when}: `{MODEL}` compiled ahead of time "
        "for each slice (no TPU, no weights; layers scanned), batch 8, gen_length 512, "
        "prompt 128, with compaction on and off. Per chip, from the TPU compiler.", "",
        "| slice | mesh | weights | sampler | temporaries on | off | peak on | off | "
        "peak added | HBM |",
        "|---|---|---|---|--:|--:|--:|--:|--:|--:|"]
    for on, off in zip(rows[::2], rows[1::2]):
        opts = " ".join(f"{k}={v}" for k, v in on["options"].items())
        lines.append(
            f"| {on['topology']} | {on['mesh']} | {on['quantize']} | {on['sampler']}"
            f"{' ' + opts if opts else ''} | {on['temp_bytes'] / GIB:.2f} GiB | "
            f"{off['temp_bytes'] / GIB:.2f} GiB | {on['peak_bytes'] / GIB:.2f} GiB | "
            f"{off['peak_bytes'] / GIB:.2f} GiB | "
            f"{(on['peak_bytes'] - off['peak_bytes']) / GIB:+.2f} GiB | "
            f"{on['hbm_bytes'] / GIB:.2f} GiB |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
