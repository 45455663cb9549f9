"""Does a testbed model fetch a line's statement from the prompt? The teacher-forced
probe of asynclane_jax.testbed.lookup on held-out chain and list problems, per family
and by the line's index (1-4, 5-8, 9-16, 17-34), so a model that finds early statements
by position and later ones not at all shows it.

  python experiments/lookup_probe.py --models tiny-llada-v2 --n 96

Writes experiments/results/lookup_probe.{json,md} (rows of earlier runs for other
models are kept).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def to_markdown(results: dict) -> str:
    out = ["# Lookup probe: does the model fetch a line's statement from the prompt?", "",
           "`python experiments/lookup_probe.py --models MODEL --n N` (teacher-forced: the",
           "prompt and the reference's earlier lines shown, the line and all after it masked;",
           "one forward, argmax). *lookup*: the tokens the line copies from its statement",
           "(list: value, sign, operand; chain: sign, operand); *result*: the value after",
           "`=`; *line*: the whole line, free choices graded as the grader does.", ""]
    for name, r in results.items():
        out += [f"## {name} ({r['problems']} held-out chain / list problems, "
                f"{r['per_problem']} lines each at most)", "",
                "| family | line index | rows | lookup | result | line |",
                "|---|---|--:|--:|--:|--:|"]
        for family, by in r["families"].items():
            for bucket, v in by.items():
                out.append(f"| {family} | {bucket} | {v['rows']} | {100 * v['lookup']:.1f}% | "
                           f"{100 * v['result']:.1f}% | {100 * v['line']:.1f}% |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True,
                    help="comma-separated shipped model names, converted folders or "
                         "training run folders (runs/NAME: its last checkpoint; copy "
                         "the folder first if its training is still running)")
    ap.add_argument("--n", type=int, default=96, help="held-out chain / list problems")
    ap.add_argument("--per-problem", type=int, default=6, help="probed lines per problem")
    ap.add_argument("--out", default=str(RESULTS / "lookup_probe.json"))
    args = ap.parse_args(argv)
    if args.n < 1 or args.per_problem < 1:
        ap.error("--n and --per-problem must be at least 1")

    import asynclane_jax
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed.lookup import probe

    out_path = pathlib.Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    problems = [p for p in tasks.heldout(4 * args.n, "v2")
                if p.family in tasks.LONG_FAMILIES][:args.n]
    for name in args.models.split(","):
        run = pathlib.Path(name)
        t0 = time.time()
        if (run / "log.json").is_file() and (run / "ckpt").is_dir():
            from asynclane_jax.testbed.train import Trainer

            trainer = Trainer.from_run(run)
            if trainer.tc.task_set != "v2":
                ap.error(f"{name}: not a run of the task set v2")
            model = trainer.current_model()
            name = f"{run.name} (run, step {trainer.step}, {trainer.elapsed / 60:.0f} min)"
        else:
            if tasks.model_task_set(name) != "v2":
                ap.error(f"{name}: not a model of the task set v2")
            model = asynclane_jax.load(name)[0]
        families = probe(model, problems, args.per_problem)
        results[name] = {"problems": len(problems), "per_problem": args.per_problem,
                         "families": families, "seconds": round(time.time() - t0, 1)}
        print(json.dumps({name: families}, indent=1), flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out_path)
    out_path.with_suffix(".md").write_text(to_markdown(results) + "\n")
    print(f"wrote {out_path} and {out_path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
