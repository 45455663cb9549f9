"""Distil the D2F student of a shipped tiny model and ship it (asynclane_jax.testbed.distill).

Trains for a wall-clock budget (or a step count), evaluates the student on held-out
problems with the d2f sampler, writes it as a shipped model folder
(asynclane_jax/testbed/models/<name>/, with a model card) and the run's log and loss
curve to experiments/results/baselines/d2f_<name>.{json,png}.

The problems are the teacher's own (its recorded task set, family weights and, for a
task set with long answers, its length buckets: `DistillConfig.for_teacher`); the
held-out check runs at gen_length 256, or 512 for a task set with long answers.

Noisy states (`--states`): "sorted" is `distill.distill_loss`'s draw (per row one mask
ratio per block, sorted to rise along the response), the draw of the students shipped
so far. It gives the first blocks of a long row only small ratios and the late blocks a
noisy left context, while decoding writes every block from fully masked with the blocks
before it (nearly) done (experiments/results/baselines/d2f_contexts.md). "decode" (the
default) draws, for a share `--p-decode` of the rows, a state of pipelined decoding
(`decode_state_ratios`): the blocks before a first in-flight block clean, up to
`--in-flight` blocks with rising ratios, the rest fully masked, the first in-flight
block drawn uniformly over the row's answer blocks (so a late block of a long answer
is trained as often as an early one); the other rows keep the sorted draw.
`--bucket-policy smallest` fills each length bucket only with the problems it is the
smallest fit for (the long bucket then holds only long answers); "fits", the shipped
students' policy, fills it with the stream's mix.

Usage: python experiments/train_d2f.py [--teacher tiny-llada] [--minutes 20] [--steps N]
       [--eval-n 200] [--eval-gen-length N] [--no-export] [--out DIR]
       [--states decode|sorted] [--p-decode 0.75] [--in-flight 4]
       [--bucket-policy smallest|fits] [--init-student NAME]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from asynclane_jax import checkpoint
from asynclane_jax.testbed import distill, tasks
from asynclane_jax.testbed.evaluate import evaluate
from asynclane_jax.testbed.train import BucketedStream

RESULTS = pathlib.Path(__file__).parent / "results" / "baselines"


# --------------------------------------------------------------------------- noisy states

def answer_blocks(tokens, prompt_length: int, block_length: int, eos_id: int):
    """[b] int32: the response blocks that hold answer tokens or the answer's first
    end-of-text (at least 1, at most the response's blocks)."""
    resp = tokens[:, prompt_length:]
    nb = -(-resp.shape[1] // block_length)
    is_eos = resp == eos_id
    n_ans = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), resp.shape[1])
    return jnp.clip(n_ans // block_length + 1, 1, nb).astype(jnp.int32)


def decode_state_ratios(key, n_answer_blocks, n_blocks: int, *, t_eps: float,
                        p_decode: float, in_flight: int):
    """(ratios [b, n_blocks] mask ratio of each response block, queried [b, n_blocks]
    bool: the blocks whose masked positions the loss reads).

    A share p_decode of the rows get a state of pipelined decoding: a first in-flight
    block f drawn uniformly in [0, n_answer_blocks) of its row, a window of w blocks (w
    uniform in 1..in_flight) from f, the blocks before f clean (ratio 0: decoded and
    cached) and those after the window fully masked (ratio 1: not yet added). Block f's
    ratio is uniform in [t_eps, 1] (decoding takes each block through every ratio with
    the blocks before it done), the window's later blocks' ratios are drawn in
    [ratio of f, 1] and sorted to rise. Only the window is queried: decoding never asks
    for a block it has not added, so the masked blocks after the window are there for
    the teacher to read, not to train on. The other rows get the sorted rising ratios
    of `distill.distill_loss`, every block queried.
    """
    b = n_answer_blocks.shape[0]
    k_s, k_u, k_w, k_f, k_d = jax.random.split(key, 5)
    sorted_r = jnp.sort(t_eps + (1 - t_eps) * jax.random.uniform(k_s, (b, n_blocks)),
                        axis=-1)
    w = jax.random.randint(k_w, (b, 1), 1, in_flight + 1)
    f = jnp.floor(jax.random.uniform(k_f, (b, 1)) * n_answer_blocks[:, None]).astype(jnp.int32)
    idx = jnp.arange(n_blocks)[None, :]
    in_win = (idx >= f) & (idx < f + w)
    u = jax.random.uniform(k_u, (b, n_blocks + 1))
    r_f = t_eps + (1 - t_eps) * u[:, :1]
    # The window's later blocks: sorted uniforms (those outside the window sort last
    # and are not read), scaled into [r_f, 1].
    later = jnp.sort(jnp.where(in_win & (idx > f), u[:, 1:], 2.0), axis=-1)
    later = jnp.take_along_axis(later, jnp.clip(idx - f - 1, 0, n_blocks - 1), axis=1)
    win = jnp.where(idx == f, r_f, r_f + (1 - r_f) * later)
    state = jnp.where(idx < f, 0.0, jnp.where(in_win, win, 1.0))
    decode = jax.random.uniform(k_d, (b, 1)) < p_decode
    return jnp.where(decode, state, sorted_r), ~decode | (idx < f + w)


def decode_state_loss(student, teacher, batch: dict, key, *, block_length: int,
                      prompt_length: int, t_eps: float, p_decode: float, in_flight: int):
    """`distill.distill_loss` with the states of `decode_state_ratios` (its loss, its
    aux, read at the queried blocks' masked positions); a clean block (ratio 0) has no
    masked position and adds nothing."""
    cfg = student.cfg
    tokens, response, key_mask = batch["tokens"], batch["response"], batch["key_mask"]
    b, n = tokens.shape
    nb = -(-(n - prompt_length) // block_length)
    k_r, k_m = jax.random.split(key)
    ratios, queried = decode_state_ratios(
        k_r, answer_blocks(tokens, prompt_length, block_length, cfg.eos_token_id), nb,
        t_eps=t_eps, p_decode=p_decode, in_flight=in_flight)
    col_ratio = jnp.concatenate(
        [jnp.ones((b, prompt_length)), jnp.repeat(ratios, block_length, axis=1)], axis=1)[:, :n]
    col_queried = jnp.concatenate(
        [jnp.zeros((b, prompt_length), bool), jnp.repeat(queried, block_length, axis=1)],
        axis=1)[:, :n]
    masked = response & (jax.random.uniform(k_m, (b, n)) < col_ratio)
    # The noisy state is drawn over every block; the loss reads the queried ones only.
    return distill.masked_distill_loss(
        student, teacher, tokens, response, key_mask, masked, col_ratio,
        block_length=block_length, prompt_length=prompt_length, t_eps=t_eps,
        read=col_queried)


class StateDistiller(distill.Distiller):
    """A Distiller whose noisy states, bucket policy and starting student are chosen
    (see the module docstring); states "sorted", policy "fits" and no starting student
    train as `distill.Distiller` does."""

    def __init__(self, dc, *, states: str = "decode", p_decode: float = 0.75,
                 in_flight: int = 4, bucket_policy: str = "smallest",
                 init_student: str | None = None):
        self.states = {"states": states, "p_decode": p_decode, "in_flight": in_flight,
                       "bucket_policy": bucket_policy, "init_student": init_student}
        super().__init__(dc)
        if dc.buckets and bucket_policy != "fits":
            self.buckets = BucketedStream(self.stream, dc.buckets, bucket_policy,
                                          families=dc.task_set, seed=dc.seed)
        if init_student:
            start, _, cfg = checkpoint.load(init_student)
            if not cfg.block_causal:
                raise ValueError(f"--init-student {init_student} is not block-causal")
            self.params = jax.tree.map(jnp.copy, nnx.split(start)[1])
            self.opt_state = self.tx.init(self.params)

    def _make_step(self):
        if self.states["states"] == "sorted":
            return super()._make_step()
        dc, graphdef, s_graphdef, tx = self.dc, self.graphdef, self.s_graphdef, self.tx
        p_decode, in_flight = self.states["p_decode"], self.states["in_flight"]

        def step(params, opt_state, teacher_params, batch, key, lr):
            teacher = nnx.merge(graphdef, teacher_params)

            def f(p):
                return decode_state_loss(nnx.merge(s_graphdef, p), teacher, batch, key,
                                         block_length=dc.block_length,
                                         prompt_length=dc.prompt_length, t_eps=dc.t_eps,
                                         p_decode=p_decode, in_flight=in_flight)

            (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = jax.tree_util.tree_map_with_path(
                lambda path, p, u: p - lr * u if distill.trainable(path) else p,
                params, updates)
            return params, opt_state, dict(aux, loss=loss)

        return jax.jit(step, donate_argnums=(0, 1))



def shapes(dc: dict) -> str:
    """The card's words for the training problems and batch shapes."""
    if dc.get("buckets"):
        weights = (f", family weights {dc['family_weights']}" if dc.get("family_weights")
                   else "")
        return (f"problems of the task set {dc['task_set']}{weights}, in length buckets "
                f"(prompt length, response region, rows, probability; each takes the "
                f"stream's next problems that fit it): {dc['buckets']}")
    return f"batch shapes (response region, rows, probability): {dc['regions']}"


def states_words(states: dict | None, dc: dict) -> str:
    """The card's words for how the blocks are masked."""
    sorted_words = (f"masked with ratios drawn and sorted to rise along the sequence "
                    f"(smallest {dc['t_eps']})")
    if not states or states.get("states") == "sorted":
        return sorted_words
    start = (f"; training started from `{states['init_student']}`"
             if states.get("init_student") else "")
    return (f"masked, for a share {states['p_decode']} of the rows, as in pipelined "
            f"decoding (the blocks before a first in-flight block clean, up to "
            f"{states['in_flight']} blocks in flight with rising ratios from "
            f"{dc['t_eps']}, the rest fully masked; the first in-flight block uniform over "
            f"the row's answer blocks), the other rows {sorted_words}; length buckets "
            f"filled by the policy \"{states['bucket_policy']}\"{start}")


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
into blocks {states_words(run.get('states'), dc)}; the teacher reads the noisy sequence
bidirectionally, the student
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
    if not evals:
        return ""
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
    ap.add_argument("--eval-n", type=int, default=200, help="0: no held-out check")
    ap.add_argument("--eval-gen-length", type=int, default=None,
                    help="default: 256, or 512 for a teacher trained on long answers")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--out", default=None,
                    help="export folder (default: the shipped models' folder / name)")
    ap.add_argument("--states", choices=("decode", "sorted"), default="decode")
    ap.add_argument("--p-decode", type=float, default=0.75,
                    help="share of rows in a decode-time state (--states decode)")
    ap.add_argument("--in-flight", type=int, default=4,
                    help="most blocks in flight in a decode-time state")
    ap.add_argument("--bucket-policy", choices=("smallest", "fits"), default="smallest")
    ap.add_argument("--init-student", default=None,
                    help="start from this block-causal student's weights, not the teacher's")
    args = ap.parse_args(argv)
    name = args.name or f"{args.teacher}-d2f"
    dc = distill.DistillConfig.for_teacher(args.teacher, name=name, minutes=args.minutes,
                                           steps=args.steps, lr=args.lr)
    gen_length = args.eval_gen_length or tasks.default_gen_length(dc.task_set)
    d = StateDistiller(dc, states=args.states, p_decode=args.p_decode,
                       in_flight=args.in_flight, bucket_policy=args.bucket_policy,
                       init_student=args.init_student)
    t0 = time.time()
    d.fit(on_log=lambda s, a: print(f"step {s}: " + " ".join(
        f"{k} {v:.4f}" for k, v in a.items()), flush=True))
    tail = {k: sum(v[-100:]) / len(v[-100:]) for k, v in d.log.items() if k != "step"}
    run = {"steps": d.step, "train_minutes": d.train_seconds / 60,
           "wall_minutes": (time.time() - t0) / 60, "final": tail, "states": d.states,
           "command": shlex.join(["python", "experiments/train_d2f.py",
                                  *(sys.argv[1:] if argv is None else argv)])}
    student = d.student()
    teacher, tok, _ = checkpoint.load(args.teacher)
    evals = [evaluate(m, tok, sampler="d2f", gen_length=gen_length, n=args.eval_n,
                      progress=True, task_set=dc.task_set)
             for m in (student, teacher)] if args.eval_n else []
    if evals:
        evals[1]["sampler"] = "d2f on the teacher (bidirectional, full forwards)"
    for e in evals:
        print(f"{e['sampler']}: accuracy {e['accuracy']:.3f}, {e['nfe_per_token']:.3f} "
              f"calls/token, {e['tps']:.0f} tok/s", flush=True)
    # With --out (a trial), the log and curve go beside the exported folder, not into
    # the results.
    results = pathlib.Path(args.out).resolve().parent if args.out else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    (results / f"d2f_{name}.json").write_text(json.dumps(
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
        fig.savefig(results / f"d2f_{name}.png", dpi=110)
    except ImportError:
        pass
    if not args.no_export:
        dest = pathlib.Path(args.out) if args.out else checkpoint.BUILTIN_MODELS_DIR / name
        d.export(dest, tokenizer_dir=checkpoint.resolve(args.teacher),
                 extra={"distill_states": d.states})
        (dest / "README.md").write_text(card(name, dc.to_dict(), run, evals))
        print(f"exported {dest}")


if __name__ == "__main__":
    main()
