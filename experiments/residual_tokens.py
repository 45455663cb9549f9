"""The residual-token table: per family, what a block sampler still decodes in a block
after its first line delimiter is committed (asynclane_jax.testbed.residual), under
Fast-dLLM (dual cache, threshold 0.9, early stop) and LocalLeap (dual cache, its
defaults, early stop). It bounds what forking can save, family by family.

  python experiments/residual_tokens.py --model tiny-llada --n 200 --gen-length 256

Writes experiments/results/residual_tokens_<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SAMPLERS = {
    "fast-dllm": {"cache": "dual", "threshold": 0.9, "early_stop": True},
    "localleap": {"cache": "dual", "early_stop": True},
}


def run(model_name: str, n: int, gen_length: int, batch: int, task_set: str | None):
    import asynclane_jax
    from asynclane_jax.testbed import evaluate, residual, tasks

    model, tokenizer, _ = asynclane_jax.load(model_name)
    task_set = task_set or tasks.model_task_set(model_name)
    problems = tasks.heldout(n, task_set)
    prompts = evaluate.prompts_for(problems, tokenizer)
    bucket = max(len(p) for p in prompts)
    out = {"model": model_name, "n": n, "gen_length": gen_length, "task_set": task_set,
           "samplers": {}}
    for name, opts in SAMPLERS.items():
        per_family: dict = {}
        right: dict = {}
        t0 = time.time()
        block = None
        for s in range(0, n, batch):
            res = asynclane_jax.generate(model, prompts[s:s + batch], sampler=name,
                                         gen_length=gen_length, bucket=bucket,
                                         tokenizer=tokenizer, **opts)
            block = res.stats.options.get("block_length") or 32
            for k, p in enumerate(problems[s:s + batch]):
                ok = tasks.check(p, res.tokens[k])
                right.setdefault(p.family, []).append(ok)
                if not ok:  # the reading rules assume the task's own line format
                    continue
                per_family.setdefault(p.family, []).append(residual.block_residuals(
                    res.tokens[k], res.stats.commit_step[k], res.stats.generated_tokens[k],
                    block, p.family))
        out["samplers"][name] = {
            "options": dict(opts, block_length=block), "seconds": round(time.time() - t0, 1),
            "families": {f: dict(residual.summarise(per_family.get(f, [])),
                                 accuracy=sum(v) / len(v), problems=len(v))
                         for f, v in right.items()}}
        print(json.dumps({name: out["samplers"][name]}), flush=True)
    return out


def markdown(res: dict, command: str) -> str:
    lines = [f"# Residual tokens after the first delimiter: {res['model']}", "",
             f"Held-out split ({res['task_set']}), first {res['n']} problems, gen length "
             f"{res['gen_length']}, batch as run; rows answered right only (the reading "
             "rules assume the task's line format). A content block is a block that holds a "
             "line delimiter before the end of the answer. *wait* = iterations from the step "
             "that committed the block's first delimiter to the step that completed the "
             "block; *refine* = iterations from that step until the last position before the "
             "delimiter is committed (how long a refine lane forked there would live); "
             "*masked before* = positions before that delimiter still masked then (the "
             "refine lane's work), split by kind; *read* = share of them the next line "
             "reads; *masked after* = the block's positions after the delimiter still "
             "masked (the continuation's). Per problem: a row's summed wait and refine "
             "iterations. Forking can save at most the refine iterations of blocks whose "
             "residual positions the next line does not read.", "",
             f"Command: `{command}`", "",
             "| sampler | family | accuracy | rows | content blocks | wait / block | "
             "refine / block | masked before / block | free-choice | value | format | "
             "read by next line | masked after / block | wait / problem | "
             "refine / problem |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, s in res["samplers"].items():
        for fam, f in s["families"].items():
            if not f.get("blocks"):
                lines.append(f"| {name} | {fam} | {100 * f['accuracy']:.1f}% | {f['rows']} | "
                             "0 | | | | | | | | | | |")
                continue
            k = f["kind_share"]
            lines.append(
                f"| {name} | {fam} | {100 * f['accuracy']:.1f}% | {f['rows']} | "
                f"{f['blocks']} | {f['wait_steps_per_block']:.2f} | "
                f"{f['refine_steps_per_block']:.2f} | "
                f"{f['masked_before_delimiter_per_block']:.2f} | "
                f"{100 * k['free-choice']:.0f}% | {100 * k['value']:.0f}% | "
                f"{100 * k['format']:.0f}% | {100 * f['read_by_next_line_share']:.0f}% | "
                f"{f['masked_after_delimiter_per_block']:.2f} | "
                f"{f['wait_steps_per_row']:.2f} | {f['refine_steps_per_row']:.2f} |")
    opts = "; ".join(f"{n}: {s['options']}" for n, s in res["samplers"].items())
    lines += ["", f"Sampler settings: {opts}.", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tasks", default=None, help="task set (default: the model's)")
    args = ap.parse_args(argv)
    if args.n <= 0 or args.batch <= 0:
        ap.error("--n and --batch must be positive")
    res = run(args.model, args.n, args.gen_length, args.batch, args.tasks)
    command = (f"python experiments/residual_tokens.py --model {args.model} --n {args.n} "
               f"--gen-length {args.gen_length} --batch {args.batch}"
               + (f" --tasks {args.tasks}" if args.tasks else ""))
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"residual_tokens_{pathlib.Path(args.model).name}"
    stem.with_suffix(".json").write_text(json.dumps(dict(res, command=command), indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(res, command))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
