"""Why a parallel sampler gets a math answer wrong: the iteration that committed each token,
and how confident the first full forward was of the answer.

Decodes every math problem among the first --n held-out problems of a shipped model with
one sampler (AsyncLane at its defaults unless --option says otherwise), one problem per
call. For each wrong answer it records the prompt, the expected and the generated
response, and the row iteration that committed each generated token (`commit_step`).
For every problem it records the first full forward's confidence in the answer's number
(the last token of the expected response, read at the position it would take in the
generated region; the last token of a math answer is its number): a wrong answer
committed at iteration 0 is the model's guess before any of its working lines was
written. Results: printed, and written to experiments/results/math_answers_<model>_<G>.json.

Usage: python experiments/math_answers.py [--model tiny-llada-v4b] [--gen-length 512]
       [--n 500] [--sampler asynclane] [--option threshold=0.9 ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


def first_forward_confidence(model, prompt_ids, gen_length: int, bucket: int, k: int):
    """(confidence, predicted id) of the first full forward at generated position k."""
    from asynclane_jax.decoding.api import build_canvas

    canvas, _, P = build_canvas([prompt_ids], gen_length, model.cfg, bucket)
    logits = model(jnp.asarray(canvas))
    logits = logits[0] if isinstance(logits, tuple) else logits
    # A logit-shifted model (Dream) predicts column c at c - 1, as the driver reads it.
    col = P + k - (1 if model.cfg.logit_shift else 0)
    probs = jax.nn.softmax(logits[0, col].astype(jnp.float32))
    return float(probs.max()), int(probs.argmax())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada-v4b")
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--sampler", default="asynclane")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a sampler option (repeatable)")
    args = ap.parse_args()
    for item in args.option:
        key, eq, _ = item.partition("=")
        if not eq or not key:
            ap.error(f"--option {item!r}: expected KEY=VALUE")

    from tqdm import tqdm

    import asynclane_jax
    from asynclane_jax.decoding.api import generate
    from asynclane_jax.decoding.registry import parse_options
    from asynclane_jax.testbed import evaluate, tasks

    options = parse_options(args.option)

    model, tokenizer, _ = asynclane_jax.load(args.model)
    problems = tasks.split("heldout", args.n, tasks.model_task_set(args.model))
    prompts = evaluate.prompts_for(problems, tokenizer)
    bucket = max(len(ids) for ids in prompts)  # the bench's prompt shape: the longest
    maths = [(i, p) for i, p in enumerate(problems) if p.family == "math"]
    if not maths:
        print(f"no math problem among the first {args.n} held-out problems", file=sys.stderr)
        return 1
    records, wrong = [], []
    for i, p in tqdm(maths, unit="problem", file=sys.stderr):
        ids = prompts[i]
        res = generate(model, [ids], sampler=args.sampler, gen_length=args.gen_length,
                       bucket=bucket, tokenizer=tokenizer, **options)
        want = tokenizer.encode(" " + p.response, add_special_tokens=False)
        k = len(want) - 1
        conf, pred = first_forward_confidence(model, ids, args.gen_length, bucket, k)
        ok = bool(evaluate.check(p, res.tokens[0]))
        rec = {"problem": i, "right": ok, "answer_confidence": round(conf, 4),
               "answer_guess_right": pred == want[k], "steps": int(res.stats.steps)}
        records.append(rec)
        if not ok:
            n_shown = min(len(want) + 2, args.gen_length)
            rec.update(prompt=p.prompt, expected=p.response, generated=res.text[0],
                       commits=[[tokenizer.decode([int(t)]), int(s)] for t, s in
                                zip(res.tokens[0][:n_shown], res.stats.commit_step[0][:n_shown])])
            wrong.append(rec)
    confs = np.array([r["answer_confidence"] for r in records])
    guessed = np.array([r["answer_guess_right"] for r in records])
    summary = {
        "math_problems": len(records), "right": sum(r["right"] for r in records),
        "answer_confidence_over_0.9": int((confs >= 0.9).sum()),
        "answer_confidence_over_0.9_guess_wrong": int(((confs >= 0.9) & ~guessed).sum()),
        "answer_confidence_over_0.95_guess_wrong": int(((confs >= 0.95) & ~guessed).sum()),
    }
    print(json.dumps(summary, indent=1))
    for rec in wrong:
        print(f"\nproblem {rec['problem']} (first forward: {rec['answer_confidence']:.3f} "
              f"on the answer)\n  want: {rec['expected']!r}\n  got:  {rec['generated']!r}")
        print("  committed at: " + " ".join(f"{t.strip() or repr(t)}@{s}"
                                             for t, s in rec["commits"]))
    out = RESULTS / f"math_answers_{args.model}_{args.gen_length}.json"
    meta = {"command": "python experiments/math_answers.py " + shlex.join(sys.argv[1:]),
            "model": args.model, "gen_length": args.gen_length, "n": args.n,
            "sampler": args.sampler, "options": options}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summary, "wrong": wrong,
                               "problems": records}, indent=1) + "\n")
    tmp.replace(out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
