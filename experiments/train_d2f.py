"""Distil the D2F student of a shipped tiny model and ship it (asynclane_jax.testbed.distill).

Trains for a wall-clock budget (or a step count), evaluates the student on held-out
problems with the d2f sampler, writes it as a shipped model folder
(asynclane_jax/testbed/models/<name>/, with a model card) and the run's log and loss
curve to experiments/results/baselines/d2f_<name>.{json,png}.

The problems are the teacher's own (its recorded task set, family weights and, for a
task set with long answers, its length buckets: `DistillConfig.for_teacher`); the
held-out check runs at gen_length 256, or 512 for a task set with long answers.

Usage: python experiments/train_d2f.py [--teacher tiny-llada] [--minutes 20] [--steps N]
       [--eval-n 200] [--eval-gen-length N] [--no-export]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

from asynclane_jax import checkpoint
from asynclane_jax.testbed import distill, tasks
from asynclane_jax.testbed.evaluate import evaluate

RESULTS = pathlib.Path(__file__).parent / "results" / "baselines"


def shapes(dc: dict) -> str:
    """The card's words for the training problems and batch shapes."""
    if dc.get("buckets"):
        weights = (f", family weights {dc['family_weights']}" if dc.get("family_weights")
                   else "")
        return (f"problems of the task set {dc['task_set']}{weights}, in length buckets "
                f"(prompt length, response region, rows, probability; each takes the "
                f"stream's next problems that fit it): {dc['buckets']}")
    return f"batch shapes (response region, rows, probability): {dc['regions']}"


def card(name: str, dc: dict, run: dict, evals: list[dict]) -> str:
    rows = "\n".join(
        f"| {e['sampler']} | {e['gen_length']} | {e['n']} | {100 * e['accuracy']:.1f}% | "
        f"{e['nfe_per_token']:.3f} | {e['tps']:.0f} |" for e in evals)
    return f"""# {name}

The D2F student of `{dc['teacher']}`: the same weights fine-tuned to block-causal
attention (the prompt bidirectional; each generated block of {dc['block_length']} sees the
prompt, earlier blocks and itself), so that `sampler="d2f"` caches finished blocks and
decodes later blocks before earlier ones finish. Its config says `block_causal: true`.
Load it with `asynclane_jax.load("{name}")`.

## Training

Asymmetric distillation (`asynclane_jax.testbed.distill`): per row the response is cut
into blocks masked with ratios drawn and sorted to rise along the sequence (smallest
{dc['t_eps']}); the teacher reads the noisy sequence bidirectionally, the student
block-causally; loss: the cross-entropy of the student against the teacher's
distribution at masked positions, weighted by 1 / ratio. Starting from the teacher's
weights, only the attention and MLP projection kernels are trained, at full rank
(embeddings, norms, biases and the output head stay the teacher's), so the student is
exactly a LoRA adapter over the teacher
(`checkpoints_convert.export.write_lora_adapter`), the form of the published 8B
students. AdamW (lr {dc['lr']}, warmup {dc['warmup_steps']} steps, cosine to
{dc['min_lr_ratio']}x over the budget), {shapes(dc)}.

Steps: {run['steps']:,}; training time: {run['train_minutes']:.1f} min of training steps
on a 2-core CPU. Command: `{run['command']}`. Final running means
over the last 100 steps: loss {run['final']['loss']:.3f}, KL(teacher || student) at
masked positions {run['final']['kl']:.3f}, argmax agreement with the teacher
{100 * run['final']['agree']:.1f}%. Curve: `experiments/results/baselines/d2f_{name}.png`.

## Held-out accuracy

| sampler | gen length | problems | exact answer | model calls / token | tokens/s |
|---|---|---|---|---|---|
{rows}

Model calls per token count a row's model calls over its tokens before end-of-text.
{breakdown(evals)}"""


def breakdown(evals: list[dict]) -> str:
    """The card's accuracy per family and per answer-length bucket (empty when the
    evaluations have none)."""
    fams = [k[len("accuracy_"):] for k in evals[0] if k.startswith("accuracy_")
            and k != "accuracy_length" and isinstance(evals[0][k], float)]
    lens = list(evals[0].get("accuracy_length") or {})
    if not fams and not lens:
        return ""
    head = ["sampler"] + fams + [f"{b} tokens ({evals[0]['accuracy_length'][b]['n']})"
                                 for b in lens]
    lines = ["", "By family and by answer length (tokens of the reference answer; "
             "problems in brackets):", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for e in evals:
        cells = [e["sampler"]] + [f"{100 * e['accuracy_' + f]:.1f}%" for f in fams]
        cells += [f"{100 * e['accuracy_length'][b]['accuracy']:.1f}%" for b in lens]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="tiny-llada")
    ap.add_argument("--name", default=None, help="default: <teacher>-d2f")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--eval-gen-length", type=int, default=None,
                    help="default: 256, or 512 for a teacher trained on long answers")
    ap.add_argument("--no-export", action="store_true")
    args = ap.parse_args(argv)
    name = args.name or f"{args.teacher}-d2f"
    dc = distill.DistillConfig.for_teacher(args.teacher, name=name, minutes=args.minutes,
                                           steps=args.steps, lr=args.lr)
    gen_length = args.eval_gen_length or tasks.default_gen_length(dc.task_set)
    d = distill.Distiller(dc)
    t0 = time.time()
    d.fit(on_log=lambda s, a: print(f"step {s}: " + " ".join(
        f"{k} {v:.4f}" for k, v in a.items()), flush=True))
    tail = {k: sum(v[-100:]) / len(v[-100:]) for k, v in d.log.items() if k != "step"}
    run = {"steps": d.step, "train_minutes": d.train_seconds / 60,
           "wall_minutes": (time.time() - t0) / 60, "final": tail,
           "command": shlex.join(["python", "experiments/train_d2f.py",
                                  *(sys.argv[1:] if argv is None else argv)])}
    student = d.student()
    teacher, tok, _ = checkpoint.load(args.teacher)
    evals = [evaluate(m, tok, sampler="d2f", gen_length=gen_length, n=args.eval_n,
                      progress=True, task_set=dc.task_set) for m in (student, teacher)]
    evals[1]["sampler"] = "d2f on the teacher (bidirectional, full forwards)"
    for e in evals:
        print(f"{e['sampler']}: accuracy {e['accuracy']:.3f}, {e['nfe_per_token']:.3f} "
              f"calls/token, {e['tps']:.0f} tok/s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"d2f_{name}.json").write_text(json.dumps(
        {"config": dc.to_dict(), "run": run, "evals": evals, "log": d.log}) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        ax[0].plot(d.log["step"], d.log["loss"], lw=0.6)
        ax[0].set(xlabel="step", ylabel="distillation loss", yscale="log")
        ax[1].plot(d.log["step"], d.log["agree"], lw=0.6)
        ax[1].set(xlabel="step", ylabel="argmax agreement with the teacher")
        fig.tight_layout()
        fig.savefig(RESULTS / f"d2f_{name}.png", dpi=110)
    except ImportError:
        pass
    if not args.no_export:
        dest = checkpoint.BUILTIN_MODELS_DIR / name
        d.export(dest, tokenizer_dir=checkpoint.resolve(args.teacher))
        (dest / "README.md").write_text(card(name, dc.to_dict(), run, evals))
        print(f"exported {dest}")


if __name__ == "__main__":
    main()
