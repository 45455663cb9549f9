"""Masked-diffusion training of the tiny testbed models (optax + orbax).

Objective (LLaDA, Nie et al. 2025, Eq. 5 / the SFT variant of its appendix): per row draw
t ~ U(eps, 1], mask each response token with probability t, and minimise
sum over masked positions of CE / t, divided by the number of response tokens. The
prompt is never masked. The response region is the answer followed by end-of-text up to
the end of the canvas — as LLaDA-Instruct is trained — so the model learns where to stop
and to fill the tail with EOS.

Mask-ratio curriculum (TrainConfig.t_max_start, t_ramp): early in the budget t is drawn
from U(eps, t_max] with t_max rising linearly to 1, so early batches mask few tokens and
each masked value mostly has its operands and the prompt statement in view. At this size
it shortens the loss plateau on which both objectives otherwise sit while the model has
learned the format but not yet to fetch values (experiments/results/testbed/testbed_summary.md).

Dream variant (`logit_shift=True` in the model config): the token at position i is
predicted from the output at i - 1, so the masked position i is scored with logits[i-1].

Causal variant (`TrainConfig.objective = "causal"`, the autoregressive baseline
tiny-ar-v4): the same batches, nothing masked; causal attention over the whole canvas
(the block-causal path with blocks of one column) and a next-token loss, the output at
i - 1 scoring the token at i, over the answer and its first end-of-text (the tail after
it is never decoded: the `ar` sampler stops there). The model config says `causal` and
shifts its logits, and the monitor decodes with `ar`.

Block-diffusion variant (`TrainConfig.objective = "block"`, the LLaDA2-style
mixture-of-experts model tiny-llada2-v4): blocks of `block_length` columns laid out from
each row's first prompt token, as the `llada2` sampler lays them out. Each (row, block)
draws its own t and masks its response tokens with that probability; the model reads a
doubled canvas, the noisy copy then the clean one at the same RoPE positions, where a
noisy block sees itself and the clean copies of the blocks before it, and a clean block
sees the clean blocks up to its own (`block_diffusion_ids`): every block is trained in
one forward exactly as the sampler will see it, its prefix finished. The loss is the
masked-diffusion one over the noisy copy.

Cost is dominated by canvas length, so most batches use a short response region and a
minority long ones (256, 512) with fewer rows, keeping tokens per step roughly constant:
the long batches teach EOS at far positions and a canvas mostly made of masks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from asynclane_jax.models.config import LLaDA2Config, ModelConfig
from asynclane_jax.models.model import DiffusionLM
from asynclane_jax.testbed import tasks
from asynclane_jax.testbed import tokenizer as tok

OBJECTIVES = ("diffusion", "causal", "block")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on (saved beside its checkpoints)."""

    name: str = "tiny-llada"
    family: str = "llada"  # "llada" or "dream"
    d_model: int = 64
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 16
    mlp_hidden: int = 256
    # q/k/v projection biases (None: the family's own choice, Dream yes, LLaDA no).
    qkv_bias: bool | None = None
    max_seq_len: int = 576  # covers a 32-token prompt bucket + a 512-token generation
    prompt_length: int = 28  # prompts are left-padded to this many tokens
    # (response region length, rows, probability) of each batch shape.
    regions: tuple = ((64, 32, 0.92), (256, 8, 0.064), (512, 4, 0.016))
    # The task set trained on (tasks.TASK_SETS) and, for sets whose prompts and answers
    # vary in length, length buckets (prompt length, response region, rows, probability)
    # that replace prompt_length and regions: a problem goes to the smallest bucket it
    # fits, and a batch of a bucket holds only problems whose smallest bucket it is.
    task_set: str = "v1"
    buckets: tuple | None = None
    # Which problems a length bucket takes: "smallest" (only those whose smallest bucket
    # it is) or "fits" (any problem that fits it, so short answers also train with the
    # long end-of-text tails a long generation gives them).
    bucket_policy: str = "smallest"
    # Line-count curriculum of the long families (chain, list): (start, ramp_from,
    # ramp_to): at most `start` working lines until progress ramp_from, rising linearly
    # to all of them (tasks.LONG_STEPS) at ramp_to. None: off.
    lines_curriculum: tuple | None = None
    # Probability that a chain / list training problem lists its statements in a random
    # order (tasks.shuffle_statements), so that they can be found only by their labels.
    shuffle_statements: float = 0.0
    # Relative weights of the task set's families in the training stream (one per
    # family, in tasks.TASK_SETS order); None: uniform.
    family_weights: tuple | None = None
    lr: float = 2e-3
    min_lr_ratio: float = 0.03
    warmup_steps: int = 200
    b1: float = 0.9
    b2: float = 0.98
    weight_decay: float = 0.05
    clip_norm: float = 1.0
    t_eps: float = 1e-3
    # Mask-ratio curriculum: t ~ U(t_eps, t_max] with t_max rising linearly from
    # t_max_start to 1 over the first t_ramp fraction of the budget (t_ramp 0: off).
    t_max_start: float = 0.25
    t_ramp: float = 0.2
    # Fraction of rows whose left padding is attended (robustness to decoders that do
    # not mask padding keys).
    attended_pad_frac: float = 0.25
    minutes: float | None = 55.0  # wall-clock budget; the cosine schedule spans it
    steps: int | None = None  # or a fixed step count (wins when set)
    eval_every_s: float = 600.0
    eval_n: int = 32
    eval_gen_length: int = 64
    eval_sampler: str = "vanilla"  # "vanilla" (steps = gen length) or "fast-dllm"
    ckpt_every_s: float = 300.0
    seed: int = 0
    # Warm start: a shipped model's name or a converted folder whose weights a fresh run
    # starts from (same architecture; a vocabulary that grew at its end keeps the new
    # rows' random initialisation). None: random initialisation.
    init_from: str | None = None
    # "diffusion" (the masked-diffusion loss above) or "causal" (a next-token loss with
    # causal attention: an autoregressive model, decoded by the `ar` sampler; the
    # mask-ratio curriculum does not apply).
    objective: str = "diffusion"
    # The block-diffusion objective's block length (the `llada2` sampler's).
    block_length: int = 32
    # Family "llada2": the LLaDA2Config fields of the mixture-of-experts layers (n_experts,
    # n_experts_per_tok, moe_hidden, n_shared_experts, first_dense_layers,
    # n_expert_groups, n_topk_groups, routed_scaling, rotary_dim); mlp_hidden is then the
    # dense layers' width.
    moe: dict | None = None

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}: expected one of {OBJECTIVES}")
        if (self.objective == "causal") != (self.eval_sampler == "ar"):
            raise ValueError(f"objective={self.objective!r} with eval_sampler="
                             f"{self.eval_sampler!r}: a causal model is monitored with "
                             "the ar sampler, and only a causal model can be")
        block = (self.objective == "block", self.family == "llada2",
                 self.eval_sampler == "llada2", self.moe is not None)
        if any(block) and not all(block):
            raise ValueError(f"objective={self.objective!r}, family={self.family!r}, "
                             f"eval_sampler={self.eval_sampler!r}, moe given: "
                             f"{self.moe is not None}: the block-diffusion objective "
                             "trains a llada2 mixture-of-experts model, monitored with the "
                             "llada2 sampler, and nothing else does")
        if all(block) and self.qkv_bias:
            raise ValueError("qkv_bias=True: a llada2 model has no q/k/v biases")

    @property
    def causal(self) -> bool:
        return self.objective == "causal"

    def model_config(self) -> ModelConfig:
        dream = self.family == "dream"
        bias = dream if self.qkv_bias is None else self.qkv_bias
        if self.family == "llada2":
            return LLaDA2Config(
                family="llada2", vocab_size=tok.vocab_size(), d_model=self.d_model,
                n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                head_dim=self.head_dim, mlp_hidden=self.mlp_hidden, rope_theta=10000.0,
                norm_eps=1e-6, tie_embeddings=False, max_seq_len=self.max_seq_len,
                dtype="float32", param_dtype="float32", block_causal=True,
                **tok.special_ids(), **self.moe)
        return ModelConfig(
            family=self.family, vocab_size=tok.vocab_size(), d_model=self.d_model,
            n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, mlp_hidden=self.mlp_hidden, rope_theta=10000.0,
            norm_eps=1e-6 if dream else 1e-5, qkv_bias=bias, tie_embeddings=False,
            logit_shift=dream or self.causal, max_seq_len=self.max_seq_len,
            dtype="float32", param_dtype="float32", causal=self.causal, **tok.special_ids())

    def with_long_frac(self, frac: float) -> TrainConfig:
        """A copy whose long regions together get probability `frac`, keeping their
        proportions to each other; the short (first) region gets the rest."""
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"long fraction {frac}: expected a value in [0, 1)")
        (short, rows, _), *long = self.regions
        total = sum(r[2] for r in long)
        if not total:
            raise ValueError("the configuration has no long batch shapes")
        return dataclasses.replace(self, regions=((short, rows, 1.0 - frac),) + tuple(
            (r[0], r[1], frac * r[2] / total) for r in long))

    def with_bucket_probs(self, probs) -> TrainConfig:
        """A copy whose length buckets are drawn with the relative weights `probs` (one
        per bucket, in order; normalised to sum to 1)."""
        if not self.buckets:
            raise ValueError("the configuration has no length buckets")
        probs = [float(p) for p in probs]
        if len(probs) != len(self.buckets):
            raise ValueError(f"{len(probs)} weights for {len(self.buckets)} length buckets")
        if any(not math.isfinite(p) or p < 0 for p in probs) or not sum(probs) > 0:
            raise ValueError(f"weights {probs}: expected finite non-negative numbers, "
                             "at least one above 0")
        total = sum(probs)
        return dataclasses.replace(self, buckets=tuple(
            tuple(b[:3]) + (round(p / total, 6),) for b, p in zip(self.buckets, probs)))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["regions"] = [list(r) for r in self.regions]
        if self.buckets is not None:
            d["buckets"] = [list(b) for b in self.buckets]
        for key in ("lines_curriculum", "family_weights"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config `to_dict` wrote (a run's log.json "config"); unknown keys refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"training config: unknown fields {', '.join(unknown)}")
        d = dict(d)
        for key in ("regions", "buckets"):
            if d.get(key) is not None:
                d[key] = tuple(tuple(x) for x in d[key])
        for key in ("lines_curriculum", "family_weights"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    @property
    def eval_prompt_length(self) -> int:
        """The longest prompt a batch can hold (the monitor's prompt bucket)."""
        if self.buckets:
            return max(b[0] for b in self.buckets)
        return self.prompt_length


def long_frac(regions) -> float:
    """Share of batches with a long response region, for TrainConfig.regions or its
    saved (list) form."""
    return 1.0 - regions[0][2]


def llada_config(**changes) -> TrainConfig:
    """tiny-llada: MHA, no biases, no logit shift."""
    return dataclasses.replace(TrainConfig(name="tiny-llada", family="llada"), **changes)


def dream_config(**changes) -> TrainConfig:
    """tiny-dream: GQA (4 query / 2 key-value heads), q/k/v biases, shifted logits."""
    return dataclasses.replace(
        TrainConfig(name="tiny-dream", family="dream", n_kv_heads=2), **changes)


# Length buckets of the task set v2 (prompt tokens, response region, rows, probability):
# tokens per step stay near 3,000, and the step probabilities follow how often each
# bucket's problems occur (half the problems are math / code, all in the first bucket;
# chain and list have 2..34 lines, 11 tokens each) divided by the bucket's rows.
V2_BUCKETS = ((32, 64, 32, 0.19), (64, 128, 16, 0.06), (96, 256, 8, 0.25),
              (144, 512, 4, 0.50))


# Length buckets of the task sets v3 and v4: their prompts are all within v1's 28 tokens (walk and
# table have an 11-token header), so every bucket has the same prompt length.
V3_BUCKETS = ((28, 64, 32, 0.19), (28, 128, 16, 0.06), (28, 256, 8, 0.25),
              (28, 512, 4, 0.50))


def v3_config(family: str = "llada", **changes) -> TrainConfig:
    """A model of the task set v3: v2's generation lengths and monitors, V3_BUCKETS."""
    base = v2_config(family)
    v3 = dict(name=base.name.replace("-v2", "-v3"), task_set="v3", buckets=V3_BUCKETS)
    return dataclasses.replace(base, **{**v3, **changes})


def v4_config(family: str = "llada", **changes) -> TrainConfig:
    """A model of the task set v4 (v3 with the labels counting down): v3's settings."""
    base = v3_config(family)
    v4 = dict(name=base.name.replace("-v3", "-v4"), task_set="v4")
    return dataclasses.replace(base, **{**v4, **changes})


def ar_v4_config(family: str = "llada", **changes) -> TrainConfig:
    """tiny-ar-v4: the autoregressive baseline of a v4 teacher (v4_config(family)): the
    same size, task set, buckets and budget, the causal objective (its config causal
    and logit-shifted), monitored with the `ar` sampler; no mask-ratio curriculum (it
    masks nothing)."""
    base = v4_config(family)
    ar = dict(name="tiny-ar-v4", objective="causal", eval_sampler="ar", t_ramp=0.0)
    return dataclasses.replace(base, **{**ar, **changes})


# tiny-llada2-v4's mixture-of-experts layers: LLaDA2.0-mini's structure at the testbed's
# size (the first layer dense, then 8 experts of width 64 in 4 groups, top-2 of the best
# 2 groups, one shared expert, sigmoid routing scaled by 2.5, half-rotary heads).
LLADA2_V4_MOE = {"n_experts": 8, "n_experts_per_tok": 2, "moe_hidden": 64,
                 "n_shared_experts": 1, "first_dense_layers": 1, "n_expert_groups": 4,
                 "n_topk_groups": 2, "routed_scaling": 2.5, "rotary_dim": 8}


def llada2_v4_config(**changes) -> TrainConfig:
    """tiny-llada2-v4: a LLaDA2-style block-diffusion mixture-of-experts model of the task
    set v4 (v4_config's buckets and monitors; GQA 4/2 heads of 16 as LLaDA2's 16/4;
    LLADA2_V4_MOE), trained with the block-diffusion objective and monitored with the
    `llada2` sampler."""
    base = v4_config("llada")
    llada2 = dict(name="tiny-llada2-v4", family="llada2", objective="block",
                  eval_sampler="llada2", n_kv_heads=2, qkv_bias=False,
                  moe=dict(LLADA2_V4_MOE))
    return dataclasses.replace(base, **{**llada2, **changes})


def v2_config(family: str = "llada", **changes) -> TrainConfig:
    """A model of the task set v2: the long families need a 144-token prompt bucket and
    a 1024-token generation (max_seq_len 1168) and train with V2_BUCKETS; monitors use
    Fast-dLLM at gen length 512 (vanilla there is gen length calls per problem)."""
    base = llada_config() if family == "llada" else dream_config()
    v2 = dict(name=f"{base.name}-v2", task_set="v2", buckets=V2_BUCKETS, max_seq_len=1168,
              eval_gen_length=512, eval_sampler="fast-dllm")
    return dataclasses.replace(base, **{**v2, **changes})


# --------------------------------------------------------------------------- data

def make_batch(stream, rows: int, region: int, prompt_length: int, rng: np.random.Generator,
               attended_pad_frac: float = 0.0) -> dict:
    """One batch: left-padded chat prompt, then response + EOS up to `region` tokens.

    Returns:
      dict of numpy arrays: tokens [b, T], key_mask [b, T] (False on padding keys),
      response [b, T] (True on the response region, answer and EOS tail alike), start [b]
      (each row's first prompt column).
    """
    eos = tok.special_ids()["eos_token_id"]
    total = prompt_length + region
    tokens = np.full((rows, total), eos, np.int32)
    key_mask = np.ones((rows, total), bool)
    start = np.zeros(rows, np.int32)
    for i in range(rows):
        p = next(stream)
        prompt, resp = tok.prompt_ids(p.prompt), tok.encode(p.response)
        if len(prompt) > prompt_length or len(resp) >= region:
            raise ValueError(f"problem does not fit: prompt {len(prompt)} > {prompt_length} "
                             f"or response {len(resp)} >= {region}")
        start[i] = prompt_length - len(prompt)
        tokens[i, start[i]:prompt_length] = prompt
        tokens[i, prompt_length:prompt_length + len(resp)] = resp
        if rng.random() >= attended_pad_frac:
            key_mask[i, :prompt_length - len(prompt)] = False
    response = np.zeros((rows, total), bool)
    response[:, prompt_length:] = True
    return {"tokens": tokens, "key_mask": key_mask, "response": response, "start": start}


def sample_batch(stream, regions, prompt_length: int, rng: np.random.Generator,
                 attended_pad_frac: float = 0.0) -> dict:
    """One batch of a shape drawn from `regions` ((region, rows, probability) each)."""
    probs = np.array([r[2] for r in regions], float)
    region, rows, _ = regions[rng.choice(len(regions), p=probs / probs.sum())]
    return make_batch(stream, rows, region, prompt_length, rng, attended_pad_frac)


def smallest_bucket(buckets, problem: tasks.Problem) -> int:
    """Index of the first bucket (prompt length, region, ...) a problem fits: its chat
    prompt within the prompt length and its response strictly shorter than the region
    (at least one end-of-text follows the answer)."""
    n_prompt = len(tok.prompt_ids(problem.prompt))
    n_resp = len(tok.split_words(problem.response))
    for i, (p_len, region, *_) in enumerate(buckets):
        if n_prompt <= p_len and n_resp < region:
            return i
    raise ValueError(f"a {problem.family} problem (prompt {n_prompt} tokens, response "
                     f"{n_resp}) fits no length bucket of {[b[:2] for b in buckets]}")


def fits_bucket(bucket, problem: tasks.Problem) -> bool:
    """Whether a problem fits a bucket (prompt length, region, ...): its chat prompt
    within the prompt length, its response strictly shorter than the region."""
    return (len(tok.prompt_ids(problem.prompt)) <= bucket[0]
            and len(tok.split_words(problem.response)) < bucket[1])


POLICIES = ("smallest", "fits")


class BucketedStream:
    """Sorts a problem stream into length buckets: `batch(rng)` draws a bucket by its
    probability and returns a batch of it.

    policy "smallest": a bucket's problems are those whose smallest bucket it is
    (problems drawn for other buckets wait in their queues, so none is thrown away).
    policy "fits": a bucket takes the stream's next problems that fit it (the others
    are skipped), so every bucket sees the stream's mix of families up to its length.
    `max_lines` (the line-count curriculum): a chain / list / walk / table problem with
    more working lines is replaced by one of its family with a line count drawn
    uniformly up to max_lines (never a held-out prompt of `families`). `shuffle`: the
    probability that a chain / list problem's statements come in a random order
    (tasks.shuffle_statements).
    """

    def __init__(self, stream, buckets, policy: str = "smallest", *, families="v2",
                 seed: int = 0, shuffle: float = 0.0):
        if policy not in POLICIES:
            raise ValueError(f"bucket policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if not 0.0 <= shuffle <= 1.0:
            raise ValueError(f"shuffle probability {shuffle}: expected a value in [0, 1]")
        self.stream, self.buckets = stream, tuple(tuple(b) for b in buckets)
        self.policy, self.families, self.shuffle = policy, families, shuffle
        self.max_lines = tasks.LONG_STEPS[1]
        self.queues: list[list[tasks.Problem]] = [[] for _ in self.buckets]
        self._rng = random.Random(seed)
        self._reach: dict[int, int] = {}  # max_lines -> the last bucket it can fill

    def _next(self) -> tasks.Problem:
        p = self._capped(next(self.stream))
        if self.shuffle and p.family in tasks.LONG_FAMILIES and self._rng.random() < self.shuffle:
            q = tasks.shuffle_statements(p, self._rng)
            if not tasks.is_heldout(q.prompt, self.families):
                return q
        return p

    def _capped(self, p: tasks.Problem) -> tasks.Problem:
        if p.family not in tasks.LINE_FAMILIES or len(p.lines) - 1 <= self.max_lines:
            return p
        while True:
            n = self._rng.randint(tasks.LONG_STEPS[0], max(tasks.LONG_STEPS[0], self.max_lines))
            q = tasks.MAKERS[p.family](self._rng, n)
            if not tasks.is_heldout(q.prompt, self.families):
                return q

    def take(self, index: int, rows: int) -> list[tasks.Problem]:
        if self.policy == "fits":
            out = []
            while len(out) < rows:
                p = self._next()
                if fits_bucket(self.buckets[index], p):
                    out.append(p)
            return out
        queue = self.queues[index]
        while len(queue) < rows:
            p = self._next()
            self.queues[smallest_bucket(self.buckets, p)].append(p)
        out, self.queues[index] = queue[:rows], queue[rows:]
        return out

    def feedable(self) -> list[bool]:
        """Which buckets can be filled while the curriculum caps the line count: under
        "smallest", a bucket whose problems are all longer than the longest chain / list
        now allowed (and than every math / code problem) gets none."""
        if self.policy == "fits" or self.max_lines >= tasks.LONG_STEPS[1]:
            return [True] * len(self.buckets)
        if self.max_lines not in self._reach:
            rng = random.Random(0)
            families = tasks.task_families(self.families)
            longest = [tasks.MAKERS[f](rng, self.max_lines) if f in tasks.LINE_FAMILIES
                       else tasks.MAKERS[f](rng) for f in families]
            self._reach[self.max_lines] = max(smallest_bucket(self.buckets, q)
                                              for q in longest)
        return [i <= self._reach[self.max_lines] for i in range(len(self.buckets))]

    def batch(self, rng: np.random.Generator, attended_pad_frac: float = 0.0) -> dict:
        probs = np.array([b[3] for b in self.buckets], float) * self.feedable()
        index = int(rng.choice(len(self.buckets), p=probs / probs.sum()))
        p_len, region, rows, _ = self.buckets[index]
        return make_batch(iter(self.take(index, rows)), rows, region, p_len, rng,
                          attended_pad_frac)


# --------------------------------------------------------------------------- objective

def masked_loss(logits, targets, masked, t, response):
    """The masked-diffusion loss from the logits: sum over masked positions of CE / t,
    divided by the number of response tokens; aux: accuracy and CE on masked
    positions, and the share of response tokens masked."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    m = masked.astype(jnp.float32)
    loss = jnp.sum(ce * m / t) / jnp.sum(response)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    acc = jnp.sum(correct * m) / jnp.maximum(jnp.sum(m), 1.0)
    return loss, {"acc": acc, "ce": jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0),
                  "mask_frac": jnp.sum(m) / jnp.sum(response)}


def diffusion_loss(model: DiffusionLM, batch: dict, key, t_eps: float = 1e-3,
                   t_max: float | jax.Array = 1.0):
    """LLaDA's masked-diffusion loss (Dream's when the model's config shifts logits).

    t is drawn from U(t_eps, t_max]; t_max < 1 is the curriculum's early phase.

    Returns:
      (loss, aux) with aux["acc"] the accuracy on masked positions and aux["mask_frac"]
      the share of response tokens masked.
    """
    cfg = model.cfg
    tokens, response = batch["tokens"], batch["response"]
    b, n = tokens.shape
    k_t, k_m = jax.random.split(key)
    t = t_eps + (t_max - t_eps) * jax.random.uniform(k_t, (b, 1))
    masked = response & (jax.random.uniform(k_m, (b, n)) < t)
    noisy = jnp.where(masked, cfg.mask_token_id, tokens)
    logits = model(noisy, key_mask=batch["key_mask"])
    targets = tokens
    if cfg.logit_shift:
        # Position i is scored with the output at i - 1; the first response token is read
        # from the last prompt token.
        logits, targets, masked = logits[:, :-1], tokens[:, 1:], masked[:, 1:]
    return masked_loss(logits, targets, masked, t, response)


def causal_loss(model: DiffusionLM, batch: dict):
    """The next-token loss of a causal model: causal attention over the whole canvas
    (block ids = column indices), the output at i - 1 scoring the token at i, averaged
    over the response's answer tokens and its first end-of-text (the EOS tail after it
    is never decoded).

    Returns:
      (loss, aux) with aux["acc"] the next-token accuracy on those positions, aux["ce"]
      the loss and aux["mask_frac"] their share of the response region.
    """
    tokens, response = batch["tokens"], batch["response"]
    b, n = tokens.shape
    cols = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    logits = model(tokens, key_mask=batch["key_mask"], block_ids=cols)[:, :-1]
    targets = tokens[:, 1:]
    eos = response & jnp.isin(tokens, jnp.asarray(model.cfg.stop_token_ids))
    after_first = (jnp.cumsum(eos, axis=1) - eos) > 0
    scored = (response & ~after_first)[:, 1:].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    count = jnp.maximum(jnp.sum(scored), 1.0)
    loss = jnp.sum(ce * scored) / count
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return loss, {"acc": jnp.sum(correct * scored) / count, "ce": loss,
                  "mask_frac": jnp.sum(scored) / jnp.sum(response)}


def block_diffusion_ids(blocks):
    """Block ids of the doubled training canvas [noisy; clean] for `attention`'s
    two-order form, from the block of every column [b, T] (pad columns negative).

    A key is visible when both of its ids are <= the query's:
      noisy column of block j: (j, -j), so a noisy query of block i sees the noisy keys of
        block i only;
      clean column of block j: key (j + 1, -BIG), so a noisy query of block i sees the
        clean blocks j < i; query (j + 1, -BIG), so a clean query sees the clean blocks
        up to its own and no noisy key (-j > -BIG).

    Returns:
      [b, 2T, 2] int32.
    """
    big = blocks.shape[1] + 1
    noisy = jnp.stack([blocks, -blocks], axis=-1)
    clean = jnp.stack([blocks + 1, jnp.full_like(blocks, -big)], axis=-1)
    return jnp.concatenate([noisy, clean], axis=1)


def block_diffusion_loss(model: DiffusionLM, batch: dict, key, t_eps: float = 1e-3,
                         t_max: float | jax.Array = 1.0, block_length: int = 32):
    """The block-diffusion loss (module docstring): per (row, block) t ~ U(t_eps, t_max],
    response tokens masked with that probability, every block scored in one forward over
    [noisy; clean] with its finished prefix in view; sum of CE / t over masked positions,
    divided by the number of response tokens.

    Returns:
      (loss, aux) as `diffusion_loss`.
    """
    cfg = model.cfg
    tokens, response, key_mask = batch["tokens"], batch["response"], batch["key_mask"]
    b, n = tokens.shape
    cols = jnp.arange(n, dtype=jnp.int32)[None, :]
    blocks = jnp.floor_divide(cols - batch["start"][:, None], block_length)  # [b, n]
    k_t, k_m = jax.random.split(key)
    n_blocks = n // block_length + 2
    t_block = t_eps + (t_max - t_eps) * jax.random.uniform(k_t, (b, n_blocks))
    t = jnp.take_along_axis(t_block, jnp.clip(blocks, 0, n_blocks - 1), axis=1)  # [b, n]
    masked = response & (jax.random.uniform(k_m, (b, n)) < t)
    noisy = jnp.where(masked, cfg.mask_token_id, tokens)
    positions = jnp.broadcast_to(cols, (b, n))
    logits = model(jnp.concatenate([noisy, tokens], axis=1),
                   positions=jnp.concatenate([positions, positions], axis=1),
                   key_mask=jnp.concatenate([key_mask, key_mask], axis=1),
                   block_ids=block_diffusion_ids(blocks),
                   logits_index=jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))
    return masked_loss(logits, tokens, masked, t, response)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW without its own learning rate: the step multiplies by lr (set per step from
    the wall-clock schedule, so a time budget always ends with a finished cosine)."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.scale_by_adam(b1=tc.b1, b2=tc.b2),
        optax.add_decayed_weights(tc.weight_decay),
    )


def lr_at(tc: TrainConfig, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, tc.warmup_steps))
    progress = min(max(progress, 0.0), 1.0)
    cos = tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return tc.lr * warm * cos


def t_max_at(tc: TrainConfig, progress: float) -> float:
    """The curriculum's largest mask ratio at a point of the budget (1 when it is off)."""
    if tc.t_ramp <= 0 or progress >= tc.t_ramp:
        return 1.0
    frac = max(progress, 0.0) / tc.t_ramp
    return tc.t_max_start + (1.0 - tc.t_max_start) * frac


def max_lines_at(tc: TrainConfig, progress: float) -> int:
    """The most working lines a chain / list problem may have at a point of the budget
    (the line-count curriculum; every length when it is off)."""
    most = tasks.LONG_STEPS[1]
    if not tc.lines_curriculum:
        return most
    start, ramp_from, ramp_to = tc.lines_curriculum
    if progress <= ramp_from:
        return int(start)
    if progress >= ramp_to:
        return most
    frac = (progress - ramp_from) / (ramp_to - ramp_from)
    return int(round(start + (most - start) * frac))


def make_train_step(graphdef, tx, t_eps: float, objective: str = "diffusion",
                    block_length: int = 32) -> Callable:
    def step(params, opt_state, batch, key, lr, t_max=1.0):
        def f(p):
            if objective == "causal":
                return causal_loss(nnx.merge(graphdef, p), batch)
            if objective == "block":
                return block_diffusion_loss(nnx.merge(graphdef, p), batch, key, t_eps, t_max,
                                            block_length)
            return diffusion_loss(nnx.merge(graphdef, p), batch, key, t_eps, t_max)

        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, dict(aux, loss=loss, gnorm=optax.global_norm(grads))

    return jax.jit(step, donate_argnums=(0, 1))


# --------------------------------------------------------------------------- monitoring

def monitor(model: DiffusionLM, problems: list[tasks.Problem], *, gen_length: int,
            prompt_length: int, sampler: str = "vanilla") -> dict:
    """Exact-match and per-line accuracy of greedy decoding: vanilla (steps =
    gen_length), Fast-dLLM (its defaults: threshold 0.9), for a causal model ar, or for
    a LLaDA2-style model llada2 (its defaults: blocks of 32, threshold 0.95)."""
    from asynclane_jax.decoding import generate

    block = 32 if gen_length % 32 == 0 else gen_length
    options = {"steps": gen_length} if sampler == "vanilla" else {}
    if sampler != "ar":  # ar has no blocks
        options["block_length"] = block
    out = generate(model, [tok.prompt_ids(p.prompt) for p in problems], sampler=sampler,
                   gen_length=gen_length, bucket=prompt_length,
                   **options).tokens
    ok = [tasks.check(p, row) for p, row in zip(problems, out)]
    lines = [tasks.line_accuracy(p, row) for p, row in zip(problems, out)]
    res = {"acc": float(np.mean(ok)),
           "line_acc": sum(r for r, _ in lines) / max(1, sum(n for _, n in lines))}
    for fam in tasks.MAKERS:
        sel = [o for o, p in zip(ok, problems) if p.family == fam]
        if sel:
            res[f"acc_{fam}"] = float(np.mean(sel))
    return res


# --------------------------------------------------------------------------- driver

ARCHITECTURE_FIELDS = ("family", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                       "mlp_hidden", "qkv_bias")


def source_architecture(path_or_name) -> dict:
    """The TrainConfig architecture fields of a converted model (for a warm start)."""
    from asynclane_jax import checkpoint

    cfg, _ = checkpoint.read_config(checkpoint.resolve(path_or_name))
    arch = {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}
    if cfg.family == "llada2":
        arch["moe"] = {k: getattr(cfg, k) for k in LLADA2_V4_MOE}
    return arch


def _dotted(path) -> str:
    """A parameter's tree path as the checkpoint names it: layers.0.mlp.up_proj.kernel."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return ".".join(str(k) for k in keys if k != "value")


def warm_start_params(params: nnx.State, path_or_name) -> nnx.State:
    """`params` with every array taken from a converted model. Arrays must have the
    same shapes, except the vocabulary axis of the embedding (rows) and of the output
    head (columns), which may have grown: the source fills the leading ids and the new
    ids keep their values from `params`."""
    from asynclane_jax import checkpoint

    source = checkpoint.load_model(checkpoint.resolve(path_or_name))
    src = dict(jax.tree_util.tree_flatten_with_path(nnx.split(source)[1])[0])
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if set(src) != {path for path, _ in flat}:
        missing = sorted(_dotted(k) for k in {p for p, _ in flat} ^ set(src))
        raise ValueError(f"warm start from {path_or_name}: the parameter trees differ "
                         f"({', '.join(missing[:4])})")
    out = []
    for path, new in flat:
        old = np.asarray(src[path])
        name = _dotted(path)
        if old.shape == new.shape:
            out.append(jnp.asarray(old, new.dtype))
            continue
        axis = 0 if name == "embed" else 1 if name.startswith("lm_head.") else None
        grown = (axis is not None and old.ndim == new.ndim == 2
                 and old.shape[1 - axis] == new.shape[1 - axis]
                 and old.shape[axis] <= new.shape[axis])
        if not grown:
            raise ValueError(f"warm start from {path_or_name}: {name} has shape {old.shape}, "
                             f"the new model {tuple(new.shape)}")
        leading = tuple(slice(0, n) for n in old.shape)
        out.append(jnp.asarray(new).at[leading].set(jnp.asarray(old, new.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)


class Trainer:
    """Owns model, optimiser state, data stream, log and checkpoints of one run."""

    def __init__(self, tc: TrainConfig, run_dir: str | pathlib.Path | None = None):
        self.tc = tc
        if tc.family_weights is not None:
            tasks.check_family_weights(tc.family_weights, tc.task_set)  # refused up front
        self.cfg = tc.model_config()
        # The weights live in self.params (restored, warm-started, trained); no model
        # object is kept, so none can be read with stale weights: current_model() is one.
        self.graphdef, self.params = nnx.split(DiffusionLM(self.cfg, rngs=nnx.Rngs(tc.seed)))
        self.tx = make_optimizer(tc)
        self.opt_state = self.tx.init(self.params)
        self.step_fn = make_train_step(self.graphdef, self.tx, tc.t_eps, tc.objective,
                                       tc.block_length)
        self.step = 0
        self.elapsed = 0.0  # training seconds, across resumes
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.run_dir = pathlib.Path(run_dir) if run_dir else None
        self._manager = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._restore()
        if tc.init_from and self.step == 0:
            self.params = warm_start_params(self.params, tc.init_from)
            self.opt_state = self.tx.init(self.params)
        self._stream = tasks.problem_stream(seed=tasks.TRAIN_SEED + 7919 * self.step + tc.seed,
                                            families=tc.task_set,
                                            weights=tc.family_weights)
        self.buckets = (BucketedStream(self._stream, tc.buckets, tc.bucket_policy,
                                       families=tc.task_set, seed=tc.seed + self.step,
                                       shuffle=tc.shuffle_statements)
                        if tc.buckets else None)
        self._rng = np.random.default_rng(tc.seed + self.step)

    @classmethod
    def from_run(cls, run_dir) -> Trainer:
        """The trainer of a run folder (its log.json and checkpoints) at its last
        checkpoint, its weights as trained (no warm start is applied again)."""
        run_dir = pathlib.Path(run_dir)
        log = json.loads((run_dir / "log.json").read_text())
        tc = dataclasses.replace(TrainConfig.from_dict(log["config"]), init_from=None)
        return cls(tc, run_dir)

    # -- checkpoints
    def _ckpt_manager(self):
        import orbax.checkpoint as ocp

        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                (self.run_dir / "ckpt").absolute(),
                options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        return self._manager

    def _leaves(self):
        return {str(i): x for i, x in
                enumerate(jax.tree_util.tree_leaves((self.params, self.opt_state)))}

    def save_checkpoint(self):
        import orbax.checkpoint as ocp

        if self.run_dir is None:
            return
        mgr = self._ckpt_manager()
        if mgr.latest_step() == self.step:
            return
        mgr.save(self.step, args=ocp.args.StandardSave(self._leaves()), force=True)
        mgr.wait_until_finished()
        (self.run_dir / "log.json").write_text(json.dumps(self.log_dict(), indent=1))

    def _restore(self):
        import orbax.checkpoint as ocp

        mgr = self._ckpt_manager()
        last = mgr.latest_step()
        if last is None:
            return
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._leaves())
        leaves = mgr.restore(last, args=ocp.args.StandardRestore(target))
        treedef = jax.tree_util.tree_structure((self.params, self.opt_state))
        flat = [jnp.asarray(leaves[str(i)]) for i in range(len(leaves))]
        self.params, self.opt_state = jax.tree_util.tree_unflatten(treedef, flat)
        log = json.loads((self.run_dir / "log.json").read_text())
        self.step, self.elapsed = log["step"], log["elapsed_s"]
        self.history, self.evals = log["history"], log["evals"]

    def log_dict(self) -> dict:
        return {"config": self.tc.to_dict(), "model": self.cfg.to_dict(), "step": self.step,
                "elapsed_s": self.elapsed, "params": self.n_params,
                "history": self.history, "evals": self.evals}

    @property
    def n_params(self) -> int:
        return int(sum(x.size for x in jax.tree_util.tree_leaves(self.params)))

    # -- training
    def current_model(self) -> DiffusionLM:
        return nnx.merge(self.graphdef, self.params)

    def progress(self) -> float:
        if self.tc.steps:
            return self.step / self.tc.steps
        return self.elapsed / (60.0 * self.tc.minutes)

    def next_batch(self) -> dict:
        if self.buckets is not None:
            self.buckets.max_lines = max_lines_at(self.tc, self.progress())
            return self.buckets.batch(self._rng, self.tc.attended_pad_frac)
        return sample_batch(self._stream, self.tc.regions, self.tc.prompt_length, self._rng,
                            self.tc.attended_pad_frac)

    def train_step(self) -> dict:
        batch = self.next_batch()
        progress = self.progress()
        lr = lr_at(self.tc, self.step, progress)
        t_max = t_max_at(self.tc, progress)
        key = jax.random.fold_in(jax.random.key(self.tc.seed), self.step)
        t0 = time.perf_counter()
        self.params, self.opt_state, aux = self.step_fn(
            self.params, self.opt_state, {k: jnp.asarray(v) for k, v in batch.items()}, key,
            jnp.float32(lr), jnp.float32(t_max))
        aux = {k: float(v) for k, v in aux.items()}
        dt = time.perf_counter() - t0
        self.elapsed += dt
        self.step += 1
        rec = {"step": self.step, "t": round(self.elapsed, 2), "lr": lr,
               "t_max": round(t_max, 4),
               **({"max_lines": self.buckets.max_lines} if self.tc.lines_curriculum else {}),
               "region": int(batch["response"][0].sum()),
               **{k: round(v, 5) for k, v in aux.items()}}
        self.history.append(rec)
        return rec

    def evaluate(self) -> dict:
        problems = tasks.heldout(self.tc.eval_n, self.tc.task_set)
        t0 = time.perf_counter()
        res = monitor(self.current_model(), problems, gen_length=self.tc.eval_gen_length,
                      prompt_length=self.tc.eval_prompt_length, sampler=self.tc.eval_sampler)
        res.update(step=self.step, t=round(self.elapsed, 1),
                   eval_s=round(time.perf_counter() - t0, 1))
        self.evals.append(res)
        return res

    def fit(self, progress_bar: bool = True, log=print) -> None:
        """Trains until the step count or wall-clock budget is spent."""
        from tqdm import tqdm

        total = self.tc.steps or int(60 * self.tc.minutes)
        unit = "step" if self.tc.steps else "s"
        bar = tqdm(total=total, initial=self.step if self.tc.steps else int(self.elapsed),
                   unit=unit, disable=not progress_bar, mininterval=5.0)
        last_eval = last_ckpt = self.elapsed
        while self.progress() < 1.0:
            before = self.elapsed
            rec = self.train_step()
            bar.update(1 if self.tc.steps else int(self.elapsed) - int(before))
            bar.set_postfix(step=rec["step"], loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}",
                            lr=f"{rec['lr']:.1e}", refresh=False)
            if self.tc.eval_every_s and self.elapsed - last_eval >= self.tc.eval_every_s:
                res = self.evaluate()
                log(f"[eval] {json.dumps(res)}")
                last_eval = self.elapsed
            if self.run_dir is not None and self.elapsed - last_ckpt >= self.tc.ckpt_every_s:
                self.save_checkpoint()
                last_ckpt = self.elapsed
        bar.close()
        if self.run_dir is not None:
            self.save_checkpoint()

    def export(self, folder, *, tokenizer_dir, extra: dict | None = None):
        """Writes the trained model as a converted folder (asynclane_jax.checkpoint)."""
        from asynclane_jax import checkpoint

        summary = {"testbed": {"train_config": self.tc.to_dict(), "steps": self.step,
                               "train_seconds": round(self.elapsed, 1),
                               "params": self.n_params, **(extra or {})}}
        return checkpoint.save(folder, self.current_model(), tokenizer_dir=tokenizer_dir,
                               extra=summary, overwrite=True)


def smoothed(values, window: int = 50) -> np.ndarray:
    v = np.asarray(values, float)
    if len(v) < 2:
        return v
    w = min(window, len(v))
    c = np.cumsum(np.insert(v, 0, 0.0))
    head = c[1:w] / np.arange(1, w)
    return np.concatenate([head, (c[w:] - c[:-w]) / w])


def plot_run(log: dict, path) -> None:
    """Loss curve (and monitored accuracy) of a run, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = log["history"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in hist]
    ax[0].plot(steps, [h["loss"] for h in hist], alpha=0.25, lw=0.6, label="loss")
    ax[0].plot(steps, smoothed([h["loss"] for h in hist]), lw=1.5, label="loss (smoothed)")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_title(f"{log['config']['name']}: masked-diffusion loss")
    ax[0].legend()
    ev = log["evals"]
    if ev:
        ax[1].plot([e["step"] for e in ev], [e["acc"] for e in ev], "o-", label="answer exact")
        ax[1].plot([e["step"] for e in ev], [e["line_acc"] for e in ev], "s-", label="lines exact")
    ax[1].set_ylim(0, 1)
    ax[1].set_xlabel("step")
    cfg = log["config"]
    ax[1].set_title(f"held-out (monitor, {cfg.get('eval_sampler', 'vanilla')}, "
                    f"gen {cfg.get('eval_gen_length', 64)})")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
