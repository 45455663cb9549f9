"""Samplers side by side on a shipped testbed model: accuracy, tokens/s, model calls.

Every sampler runs on the same held-out problems in one process, at several generation
budgets; speed ratios are against the vanilla sampler (steps = gen_length) of the same
budget. Tokens/s counts tokens before the first end-of-text, over decoding wall time
(compilation is timed apart and excluded). Results are printed and written to
experiments/results/samplers_<model>.{md,json}.

Usage: python experiments/bench_samplers.py --model tiny-llada [--n 200]
       [--gen-lengths 128 256 512]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import jax

import asynclane_jax
from asynclane_jax.testbed.evaluate import evaluate

RESULTS = pathlib.Path(__file__).parent / "results"


def sampler_grid(family: str) -> list[tuple[str, str, dict]]:
    grid = [("vanilla", "vanilla", {}),
            ("fast-dllm (no cache)", "fast-dllm", {"cache": "none"}),
            ("fast-dllm prefix", "fast-dllm", {"cache": "prefix"}),
            ("fast-dllm dual", "fast-dllm", {"cache": "dual"}),
            ("localleap dual", "localleap", {"cache": "dual"})]
    if family == "dream":
        grid.insert(1, ("dream maskgit_plus", "dream", {"alg": "maskgit_plus"}))
    return grid


def write_results(args, cfg, rows) -> pathlib.Path:
    """Writes the rows so far to results/samplers_<model>.{json,md}; returns the .md path."""
    meta = {"model": args.model, "family": cfg.family, "n": args.n,
            "block_length": args.block_length, "batch_size": args.batch_size,
            "backend": jax.default_backend(), "machine": platform.machine()}
    RESULTS.mkdir(exist_ok=True)
    stem = f"samplers_{args.model.replace('/', '_')}"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Samplers on `{args.model}`", "",
             f"{args.n} held-out problems per row, batch {args.batch_size}, block length "
             f"{args.block_length} (Dream's own sampler: one block), greedy; backend "
             f"{meta['backend']} ({meta['machine']}). Tokens/s: tokens before the first "
             "end-of-text per second of decoding, compilation excluded. Speed-up: tokens/s "
             "over vanilla's (steps = gen_length) at the same budget.", "",
             "| gen_length | sampler | accuracy | lines right | tokens/s | speed-up | "
             "calls / token | calls / problem |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['gen_length']} | {r['sampler']} | {100 * r['accuracy']:.1f}% | "
            f"{100 * r['line_accuracy']:.1f}% | {r['tps']:.0f} | "
            f"{r['speedup_vs_vanilla']:.2f}x | {r['nfe_per_token']:.3f} | "
            f"{r['nfe_per_row']:.1f} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return RESULTS / f"{stem}.md"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--gen-lengths", type=int, nargs="+", default=[128, 256, 512])
    args = ap.parse_args()

    model, tokenizer, cfg = asynclane_jax.load(args.model)
    rows = []
    for g in args.gen_lengths:
        base_tps = None
        for label, sampler, opts in sampler_grid(cfg.family):
            block = None if sampler == "dream" else args.block_length
            r = evaluate(model, tokenizer, sampler=sampler, gen_length=g, n=args.n,
                         batch_size=args.batch_size, block_length=block, **opts)
            tps = r["tps"]
            if sampler == "vanilla":
                base_tps = tps
            row = {"gen_length": g, "sampler": label, "accuracy": r["accuracy"],
                   "line_accuracy": r["line_accuracy"], "tps": tps,
                   "speedup_vs_vanilla": tps / base_tps if base_tps else None,
                   "nfe_per_token": r["nfe_per_token"], "nfe_per_row": r["nfe_per_row"],
                   "n": r["n"], "wall_s": r["wall_s"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            md = write_results(args, cfg, rows)  # after every row: nothing lost if stopped
    print(md.read_text())


if __name__ == "__main__":
    main()
