"""The decode-order picture of every sampler on one prompt of a shipped model.

Each picture (asynclane_jax.decoding.trace) shows, for the prompt's generated
positions, the iteration at which each was committed, with the blocks (block samplers)
or lanes (AsyncLane) outlined. Written to experiments/results/decode_order_<sampler>.png.

Usage: python experiments/decode_order.py [--model tiny-llada] [--gen-length 128]
       [--problem 0]
"""

from __future__ import annotations

import argparse
import pathlib

import asynclane_jax
from asynclane_jax.decoding.trace import save_decode_order
from asynclane_jax.testbed import evaluate, tasks

RESULTS = pathlib.Path(__file__).parent / "results"
SAMPLERS = {
    "vanilla": ("vanilla", {}),
    "fast-dllm": ("fast-dllm", {"cache": "dual"}),
    "localleap": ("localleap", {"cache": "dual"}),
    "asynclane": ("asynclane", {}),
    "asynclane-forking": ("asynclane", {"max_lanes": 16, "extra_queries": 8}),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--problem", type=int, default=0, help="index in the held-out split")
    args = ap.parse_args()
    model, tokenizer, cfg = asynclane_jax.load(args.model)
    problem = tasks.split("heldout", args.problem + 1)[args.problem]
    prompt = evaluate.prompts_for([problem], tokenizer)
    RESULTS.mkdir(exist_ok=True)
    for label, (sampler, opts) in SAMPLERS.items():
        res = asynclane_jax.generate(model, prompt, sampler=sampler,
                                     gen_length=args.gen_length, tokenizer=tokenizer, **opts)
        path = RESULTS / f"decode_order_{label}.png"
        ok = evaluate.check(problem, res.tokens[0])
        save_decode_order(res, path, tokenizer=tokenizer, stop_ids=cfg.stop_token_ids,
                          title=f"{label}{f' {opts}' if opts else ''} on {args.model}, gen_length "
                                f"{args.gen_length}: {'right' if ok else 'wrong'} answer")
        print(f"{label}: {res.stats.steps} iterations, "
              f"{int(res.stats.row_nfe_full[0] + res.stats.row_nfe_partial[0])} calls, "
              f"answer {'right' if ok else 'wrong'} -> {path}")


if __name__ == "__main__":
    main()
