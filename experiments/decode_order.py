"""The decode-order picture of every sampler on one prompt of a shipped model.

Each picture (asynclane_jax.decoding.trace) shows, for the prompt's generated
positions, the iteration at which each was committed, with the blocks (block samplers)
or lanes (AsyncLane) outlined. Written to experiments/results/asynclane/decode_order_<sampler>.png.

The problem is a held-out problem of the model's own task set; the generation length
defaults to the one that task set needs (tasks.default_gen_length).

Usage: python experiments/decode_order.py [--model tiny-llada-v4b] [--gen-length N]
       [--problem 7]
"""

from __future__ import annotations

import argparse
import pathlib

import asynclane_jax
from asynclane_jax.decoding.trace import save_decode_order
from asynclane_jax.generate_cli import DEFAULT_MODEL
from asynclane_jax.testbed import evaluate, tasks

RESULTS = pathlib.Path(__file__).parent / "results" / "asynclane"
SAMPLERS = {
    "vanilla": ("vanilla", {}),
    "fast-dllm": ("fast-dllm", {"cache": "dual"}),
    "localleap": ("localleap", {"cache": "dual"}),
    "asynclane": ("asynclane", {}),
    "asynclane-lanes-off": ("asynclane", {"max_lanes": 1}),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--gen-length", type=int, default=None,
                    help="default: the model's task set's (256 or 512)")
    ap.add_argument("--problem", type=int, default=7, help="index in the held-out split "
                    "(7: in v4 a table-down problem of 13 lines, 146 answer tokens)")
    args = ap.parse_args()
    model, tokenizer, cfg = asynclane_jax.load(args.model)
    task_set = tasks.model_task_set(args.model)
    args.gen_length = args.gen_length or tasks.default_gen_length(task_set)
    problem = tasks.split("heldout", args.problem + 1, task_set)[args.problem]
    prompt = evaluate.prompts_for([problem], tokenizer)
    RESULTS.mkdir(parents=True, exist_ok=True)
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
