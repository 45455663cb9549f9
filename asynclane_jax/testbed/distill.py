"""Asymmetric distillation of a block-causal D2F student from a bidirectional teacher.

D2F (arXiv 2508.09192) turns a bidirectional diffusion LM into one whose generated
blocks attend only to the prompt, earlier blocks and themselves, so that a finished
block's K/V can be cached and later blocks can be decoded before earlier ones finish
(`sampler="d2f"`). The student learns to predict what the teacher predicts:

  * one noisy sequence per row: the prompt kept, the response cut into blocks of
    `block_length`, block k masked with ratio r_k, the ratios drawn per row and sorted so
    they rise along the sequence (later blocks noisier, as in pipelined decoding, where
    a new block starts fully masked while earlier ones are nearly done);
  * the teacher reads it with full bidirectional attention, the student with
    block-causal attention (`DiffusionLM(..., block_ids=...)`);
  * loss: at masked positions, the cross-entropy of the student's distribution against
    the teacher's (the KL up to the teacher's entropy), weighted 1/r_k, summed and
    divided by the number of response tokens (the diffusion loss's normalisation).

The student starts from the teacher's weights. Only the kernels of the attention and
MLP projections are trained, at full rank; embeddings, norms, biases and the output head
stay the teacher's. At 0.4M parameters a low-rank adapter would save nothing worth
having, while keeping the change to the projection kernels makes the student exactly a
PEFT LoRA adapter over the teacher (rank = the kernels' smaller side), the form in which
the published 8B students arrive (`asynclane-jax convert --lora`): the same converter
path serves both (tests/testbed/test_distill.py round-trips it).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asynclane_jax.models.model import DiffusionLM
from asynclane_jax.testbed import tasks
from asynclane_jax.testbed.train import BucketedStream, lr_at, make_optimizer, sample_batch


@dataclasses.dataclass
class DistillConfig:
    """Everything a distillation run depends on (saved with the student)."""

    teacher: str = "tiny-llada"
    name: str = "tiny-llada-d2f"
    block_length: int = 32
    prompt_length: int = 28
    # (response region length, rows, probability) of each batch shape.
    regions: tuple = ((64, 32, 0.75), (128, 16, 0.15), (256, 8, 0.10))
    # The task set of the training problems, the families' weights in the stream (None:
    # uniform) and length buckets ((prompt length, region, rows, probability), each
    # taking the stream's next problems that fit it; None: `regions`, whose problems all
    # fit). `for_teacher` fills the three from the teacher's own training config.
    task_set: str = "v1"
    family_weights: tuple | None = None
    buckets: tuple | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    b1: float = 0.9
    b2: float = 0.98
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    t_eps: float = 0.05  # smallest block mask ratio
    minutes: float | None = 20.0  # wall-clock budget; the cosine schedule spans it
    steps: int | None = None  # or a fixed step count (wins when set)
    seed: int = 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["regions"] = [list(r) for r in self.regions]
        if self.buckets is not None:
            d["buckets"] = [list(b) for b in self.buckets]
        if self.family_weights is not None:
            d["family_weights"] = list(self.family_weights)
        return d

    @classmethod
    def for_teacher(cls, teacher: str, **overrides) -> DistillConfig:
        """A config whose problems are the teacher's: its task set, family weights and
        (for a task set with long answers) its length buckets, read from the training
        config recorded in its folder. A teacher trained on the first task set (or with
        none recorded) keeps the default regions."""
        import json

        from asynclane_jax import checkpoint

        recorded = json.loads((checkpoint.resolve(teacher) / checkpoint.CONFIG_FILE)
                              .read_text())
        tc = (recorded.get("testbed") or {}).get("train_config") or {}
        kw: dict = {"teacher": teacher, "task_set": tasks.recorded_task_set(recorded)}
        if tc.get("family_weights"):
            kw["family_weights"] = tuple(tc["family_weights"])
        if tc.get("buckets") and kw["task_set"] != tasks.DEFAULT_TASK_SET:
            kw["buckets"] = tuple(tuple(b) for b in tc["buckets"])
            kw["prompt_length"] = max(b[0] for b in kw["buckets"])
        kw.update(overrides)
        return cls(**kw)


def trainable(path) -> bool:
    """Whether a parameter (by its path in the model state) is trained: the projection
    kernels of the layers."""
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if keys and keys[-1] == "value":  # the Variable's own attribute
        keys = keys[:-1]
    return "layers" in keys and keys[-1] == "kernel"


def block_ids(n: int, prompt_length: int, block_length: int) -> np.ndarray:
    """[n] block id of each column: 0 for the prompt, k + 1 for response block k."""
    cols = np.arange(n)
    return np.where(cols < prompt_length, 0, (cols - prompt_length) // block_length + 1)


def distill_loss(student: DiffusionLM, teacher: DiffusionLM, batch: dict, key, *,
                 block_length: int, prompt_length: int, t_eps: float):
    """The distillation loss of one batch (see the module docstring).

    Returns:
      (loss, aux): aux["kl"] the mean KL(teacher || student) at masked positions,
      aux["acc"] the student's argmax accuracy there against the data, aux["agree"]
      its agreement with the teacher's argmax.
    """
    tokens, response, key_mask = batch["tokens"], batch["response"], batch["key_mask"]
    b, n = tokens.shape
    nb = -(-(n - prompt_length) // block_length)
    k_r, k_m = jax.random.split(key)
    ratios = jnp.sort(t_eps + (1 - t_eps) * jax.random.uniform(k_r, (b, nb)), axis=-1)
    col_ratio = jnp.concatenate(
        [jnp.ones((b, prompt_length)), jnp.repeat(ratios, block_length, axis=1)], axis=1)[:, :n]
    masked = response & (jax.random.uniform(k_m, (b, n)) < col_ratio)
    return masked_distill_loss(student, teacher, tokens, response, key_mask, masked,
                               col_ratio, block_length=block_length,
                               prompt_length=prompt_length, t_eps=t_eps)


def masked_distill_loss(student: DiffusionLM, teacher: DiffusionLM, tokens, response,
                        key_mask, masked, col_ratio, *, block_length: int,
                        prompt_length: int, t_eps: float, read=None):
    """The loss and its aux for a drawn noisy state: the tokens at `masked` [b, n]
    replaced by the mask token, the student read block-causally and the teacher
    bidirectionally; the soft cross-entropy at the masked positions (those in `read`
    [b, n] only, when given), each weighted by 1 / its column's mask ratio `col_ratio`
    [b, n] (floored at t_eps), over the response's length. Shared by `distill_loss` and
    other draws of the state (experiments/train_d2f.py)."""
    cfg = student.cfg
    b, n = tokens.shape
    noisy = jnp.where(masked, cfg.mask_token_id, tokens)
    if read is not None:
        masked = masked & read
    ids = jnp.broadcast_to(jnp.asarray(block_ids(n, prompt_length, block_length)), (b, n))
    s_logits = student(noisy, key_mask=key_mask, block_ids=ids)
    t_logits = jax.lax.stop_gradient(teacher(noisy, key_mask=key_mask))
    targets = tokens
    if cfg.logit_shift:  # position i is read from the output at i - 1
        s_logits, t_logits = s_logits[:, :-1], t_logits[:, :-1]
        targets, masked, col_ratio = tokens[:, 1:], masked[:, 1:], col_ratio[:, 1:]
    t_logp = jax.nn.log_softmax(t_logits, axis=-1)
    s_logp = jax.nn.log_softmax(s_logits, axis=-1)
    t_p = jnp.exp(t_logp)
    soft_ce = -jnp.sum(t_p * s_logp, axis=-1)
    kl = jnp.sum(t_p * (t_logp - s_logp), axis=-1)
    m = masked.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(m), 1.0)
    loss = jnp.sum(soft_ce * m / jnp.maximum(col_ratio, t_eps)) / jnp.sum(response)
    s_top = jnp.argmax(s_logits, -1)
    return loss, {"kl": jnp.sum(kl * m) / count,
                  "acc": jnp.sum((s_top == targets) * m) / count,
                  "agree": jnp.sum((s_top == jnp.argmax(t_logits, -1)) * m) / count}


class Distiller:
    """Trains a block-causal student from a teacher; `fit` runs the budget."""

    def __init__(self, dc: DistillConfig):
        from asynclane_jax import checkpoint

        self.dc = dc
        teacher, _, cfg = checkpoint.load(dc.teacher)
        if cfg.block_causal:
            raise ValueError(f"teacher {dc.teacher} is already block-causal")
        self.teacher_cfg = cfg
        self.graphdef, self.teacher_params = nnx.split(teacher)
        student = nnx.clone(teacher)
        student.cfg = cfg.replace(block_causal=True)
        self.s_graphdef, params = nnx.split(student)
        self.params = jax.tree.map(jnp.copy, params)  # own buffers: the step donates them
        # The optimizer's lr is applied per step (the wall-clock cosine), as in train.py
        # (whose helpers read the same optimizer fields of this config).
        self.tx = make_optimizer(dc)
        self.opt_state = self.tx.init(self.params)
        self.stream = tasks.problem_stream(seed=dc.seed + 1, families=dc.task_set,
                                           weights=dc.family_weights)
        self.buckets = (BucketedStream(self.stream, dc.buckets, "fits",
                                       families=dc.task_set, seed=dc.seed)
                        if dc.buckets else None)
        self.rng = np.random.default_rng(dc.seed)
        self.key = jax.random.key(dc.seed)
        self.step = 0
        self.train_seconds = 0.0
        self.log: dict = {"step": [], "loss": [], "kl": [], "acc": [], "agree": []}
        self._step_fn = self._make_step()

    def _make_step(self):
        dc, graphdef, s_graphdef, tx = self.dc, self.graphdef, self.s_graphdef, self.tx

        def step(params, opt_state, teacher_params, batch, key, lr):
            teacher = nnx.merge(graphdef, teacher_params)

            def f(p):
                return distill_loss(nnx.merge(s_graphdef, p), teacher, batch, key,
                                    block_length=dc.block_length,
                                    prompt_length=dc.prompt_length, t_eps=dc.t_eps)

            (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = jax.tree_util.tree_map_with_path(
                lambda path, p, u: p - lr * u if trainable(path) else p, params, updates)
            return params, opt_state, dict(aux, loss=loss)

        return jax.jit(step, donate_argnums=(0, 1))

    def progress(self) -> float:
        if self.dc.steps:
            return self.step / self.dc.steps
        return self.train_seconds / (60.0 * self.dc.minutes)

    def student(self) -> DiffusionLM:
        return nnx.merge(self.s_graphdef, self.params)

    def train_step(self) -> dict:
        raw = (self.buckets.batch(self.rng) if self.buckets is not None else
               sample_batch(self.stream, self.dc.regions, self.dc.prompt_length, self.rng))
        batch = {k: jnp.asarray(v) for k, v in raw.items()}
        self.key, sub = jax.random.split(self.key)
        lr = lr_at(self.dc, self.step, self.progress())
        t0 = time.perf_counter()
        self.params, self.opt_state, aux = self._step_fn(
            self.params, self.opt_state, self.teacher_params, batch, sub, lr)
        aux = {k: float(v) for k, v in aux.items()}
        self.train_seconds += time.perf_counter() - t0
        self.step += 1
        for k in self.log:
            self.log[k].append(self.step if k == "step" else aux[k])
        return aux

    def fit(self, progress_bar: bool = True, on_log=None, log_every: int = 100) -> None:
        from tqdm import tqdm

        bar = tqdm(total=100, unit="%", disable=not progress_bar, desc=self.dc.name)
        shown = 0
        while self.progress() < 1.0:
            aux = self.train_step()
            pct = min(100, int(100 * self.progress()))
            bar.update(pct - shown)
            shown = pct
            bar.set_postfix(loss=f"{aux['loss']:.3f}", kl=f"{aux['kl']:.3f}",
                            agree=f"{aux['agree']:.3f}", refresh=False)
            if on_log is not None and self.step % log_every == 0:
                on_log(self.step, aux)
        bar.close()

    def export(self, folder, *, tokenizer_dir, extra: dict | None = None):
        from asynclane_jax import checkpoint

        return checkpoint.save(folder, self.student(), tokenizer_dir=tokenizer_dir,
                               extra={"distill": self.dc.to_dict(), **(extra or {})},
                               overwrite=True)


__all__ = ["DistillConfig", "Distiller", "block_ids", "distill_loss", "masked_distill_loss",
           "trainable"]
