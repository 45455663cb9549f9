"""How a long-task model fails its walk / table (v3) or walk-down / table-down (v4)
problems: whether it stops after the last line, and the kind of the first wrong
working line (label, direction, left operand, result), under Fast-dLLM (dual cache,
threshold 0.9) at gen length 512.

  python experiments/testbed_failures.py --model tiny-llada-v3 --n 50

Writes experiments/results/testbed_failures_<model>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

from asynclane_jax.testbed import tasks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def first_error(family: str, ref: list[str], got: list[str]) -> str:
    """The kind of the first differing token group of a working line."""
    if ref[0] != got[0]:
        return "label"
    if family in tasks.CHAINED_HEADER and ref[2] == got[2] and ref[3] != got[3]:
        return "direction"
    if ref[2] != got[2]:
        return "left operand"
    return "result" if ref[6] != got[6] else "other"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llada-v3")
    ap.add_argument("--n", type=int, default=50, help="held-out problems per family")
    args = ap.parse_args(argv)

    import asynclane_jax
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import evaluate
    from asynclane_jax.testbed import tokenizer as tok

    model, tokenizer, _ = asynclane_jax.load(args.model)
    task_set = tasks.model_task_set(args.model)
    families = [f for f in tasks.families_of(task_set) if f in tasks.HEADER_FAMILIES]
    if not families:
        ap.error(f"--model {args.model}: trained on {task_set}, which has no walk / table")
    problems = [p for p in tasks.heldout(8 * args.n, task_set) if p.family in families]
    picked = {f: [p for p in problems if p.family == f][:args.n] for f in families}
    out = {}
    for family, probs in picked.items():
        res = generate(model, evaluate.prompts_for(probs, tokenizer), sampler="fast-dllm",
                       gen_length=512, cache="dual", threshold=0.9, tokenizer=tokenizer)
        c = collections.Counter()
        for p, row in zip(probs, res.tokens):
            got = tasks.parse_lines(tasks.response_text(tok.decode_tokens(row)))
            ref = tasks.parse_lines(p.response)
            c["rows"] += 1
            c["stops_after_its_last_line"] += len(got) == len(ref) and got[-1].startswith("answer")
            c["runs_past_its_last_line"] += len(got) > len(ref)
            c["stops_early"] += len(got) < len(ref)
            bad = next(((r, g) for r, g in zip(ref[:-1], got)
                        if tasks.normalise_line(r) != tasks.normalise_line(g)), None)
            if bad is None and len(got) >= len(ref) - 1:
                c["every_working_line_right"] += 1
            elif bad is not None:
                c["first_error_" + first_error(family, bad[0].split(), bad[1].split())] += 1
        out[family] = dict(c)
    text = json.dumps({"model": args.model, "sampler": "fast-dllm (dual, 0.9)",
                       "gen_length": 512, "families": out}, indent=1)
    print(text)
    (RESULTS / f"testbed_failures_{args.model}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
