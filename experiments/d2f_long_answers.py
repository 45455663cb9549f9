"""Where the D2F students lose the long answers: the pipeline, or the student itself.

Decodes the first long held-out problems (walk-down and table-down) of each student
with `d2f` at its defaults (up to 4 blocks in flight, a block added when the one before
is 10% decoded) and with `max_active_blocks=1` (a block starts only once the one before
is complete, so every block reads a fully decoded left context). For each wrong answer
it records whether the first line that differs from the reference (free choices
aside) has a wrong line label (the countdown `(n)`), and keeps the first wrong answer
of each setting as an example.

  python experiments/d2f_long_answers.py --models tiny-llada-v4b-d2f,tiny-dream-v4-d2f

Writes experiments/results/d2f_long_answers.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SETTINGS = {"defaults": {}, "one block in flight": {"max_active_blocks": 1}}


def first_wrong_line(ref: list[str], got: list[str]):
    """(reference line, generated line) of the first line that differs, free choices aside
    (`tasks.normalise_line`; the answer line included), or None."""
    from asynclane_jax.testbed import tasks

    return next(((r, g) for r, g in zip(ref, got)
                 if tasks.normalise_line(r) != tasks.normalise_line(g)), None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-llada-v4b-d2f,tiny-dream-v4-d2f")
    ap.add_argument("--n", type=int, default=40, help="long held-out problems per model")
    ap.add_argument("--gen-length", type=int, default=512)
    args = ap.parse_args(argv)

    import asynclane_jax
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import evaluate, tasks
    from asynclane_jax.testbed import tokenizer as tok

    out = {"gen_length": args.gen_length, "n": args.n, "settings": SETTINGS, "models": {}}
    for name in args.models.split(","):
        model, tokenizer, _ = asynclane_jax.load(name)
        task_set = tasks.model_task_set(name)
        long = [p for p in tasks.heldout(4 * args.n, task_set)
                if p.family in ("walk-down", "table-down")][:args.n]
        if len(long) < args.n:
            ap.error(f"{name}: only {len(long)} long problems in the first {4 * args.n}")
        rows = {}
        for label, options in SETTINGS.items():
            res = generate(model, evaluate.prompts_for(long, tokenizer), sampler="d2f",
                           gen_length=args.gen_length, tokenizer=tokenizer, **options)
            texts = [tasks.response_text(tok.decode_tokens(r)) for r in res.tokens]
            right = wrong_label = 0
            example = None
            for p, text in zip(long, texts):
                if tasks.check(p, text):
                    right += 1
                    continue
                bad = first_wrong_line(tasks.parse_lines(p.response), tasks.parse_lines(text))
                if bad is not None and bad[0].split()[:1] != bad[1].split()[:1]:
                    wrong_label += 1
                if example is None:
                    example = {"prompt": p.prompt, "reference": p.response, "generated": text,
                               "first_wrong_line": bad}
            rows[label] = {"right": right, "wrong": len(long) - right,
                           "first_wrong_line_has_wrong_label": wrong_label,
                           "model_calls": int(res.stats.nfe), "example": example}
            print(f"{name} {label}: {right}/{len(long)} right; of the "
                  f"{len(long) - right} wrong, {wrong_label} have a wrong label in their "
                  f"first wrong line", flush=True)
        out["models"][name] = rows
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "d2f_long_answers.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
