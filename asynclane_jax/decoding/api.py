"""`generate`: the public entry point of the decode loop."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asynclane_jax.decoding import loop
from asynclane_jax.decoding.dream import DreamPolicy
from asynclane_jax.decoding.fast_dllm import FastDllmPolicy
from asynclane_jax.decoding.localleap import LocalLeapPolicy
from asynclane_jax.decoding.policy import BlockPolicy, FixedStepsPolicy, SamplerError
from asynclane_jax.decoding.vanilla import VanillaPolicy

SAMPLERS: dict[str, type[BlockPolicy]] = {
    "vanilla": VanillaPolicy,
    "dream": DreamPolicy,
    "fast-dllm": FastDllmPolicy,
    "localleap": LocalLeapPolicy,
}

# Default block length per sampler when the caller gives none.
_DEFAULT_BLOCK = {"vanilla": 32, "fast-dllm": 32, "localleap": 32}

# Prompt lengths are rounded up to a multiple of this, so that prompts of similar length
# share one compiled loop.
DEFAULT_BUCKET = 32


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns.

    Attributes:
      tokens: [b, gen_length] int numpy array, the generated region of each row.
      text: decoded text per row (cut at the first end-of-text) when a tokenizer was given.
      stats: steps, model calls (nfe_full / nfe_partial), tokens processed, per-position
        commit step, wall time, and more.
    """

    tokens: np.ndarray
    text: list[str] | None
    stats: dict[str, Any]


def make_policy(sampler: str, *, gen_length: int, block_length: int | None,
                **options) -> BlockPolicy:
    """Builds and validates a sampler policy from its name and options."""
    if sampler not in SAMPLERS:
        raise SamplerError(f"unknown sampler {sampler!r}; available: {sorted(SAMPLERS)}")
    cls = SAMPLERS[sampler]
    if block_length is None:
        block_length = _DEFAULT_BLOCK.get(sampler, gen_length)
        if gen_length % block_length:
            block_length = gen_length
    fields = {f.name for f in dataclasses.fields(cls)} - {"gen_length", "block_length"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise SamplerError(
            f"{sampler}: unknown option(s) {unknown}; accepted: {sorted(fields)}")
    if issubclass(cls, FixedStepsPolicy) and "steps" not in options:
        options["steps"] = gen_length
    try:
        return cls(gen_length=gen_length, block_length=block_length, **options)
    except TypeError as e:
        raise SamplerError(f"{sampler}: {e}") from None


def bucket_length(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


def build_canvas(prompts: Sequence[Sequence[int]], gen_length: int, cfg, bucket: int):
    """Left-pads prompts to a bucketed length P and appends G masks.

    Returns:
      (canvas [b, P + G] int32, pad_len [b] int32, P).
    """
    if len(prompts) == 0:
        raise SamplerError("no prompts given")
    lengths = []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise SamplerError(f"prompt {i} is empty")
        arr = np.asarray(p)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise SamplerError(f"prompt {i} is not a list of token ids")
        if arr.min() < 0 or arr.max() >= cfg.vocab_size:
            raise SamplerError(f"prompt {i} has token ids outside [0, {cfg.vocab_size})")
        lengths.append(len(p))
    longest = max(lengths)
    if longest + gen_length > cfg.max_seq_len:
        raise SamplerError(
            f"prompt length {longest} + gen_length {gen_length} exceeds the model's maximum "
            f"sequence length {cfg.max_seq_len}")
    P = min(bucket_length(longest, bucket), cfg.max_seq_len - gen_length)
    b = len(prompts)
    canvas = np.full((b, P + gen_length), cfg.mask_token_id, np.int32)
    pad_len = np.zeros((b,), np.int32)
    for i, p in enumerate(prompts):
        pad_len[i] = P - len(p)
        canvas[i, : pad_len[i]] = cfg.pad_token_id
        canvas[i, pad_len[i]: P] = np.asarray(p, np.int32)
    return canvas, pad_len, P


def _cut_at_stop(ids: np.ndarray, stop_ids) -> list[int]:
    out = []
    for t in ids.tolist():
        if t in stop_ids:
            break
        out.append(t)
    return out


def generate(model, prompts, *, sampler: str = "fast-dllm", gen_length: int = 128,
             block_length: int | None = None, tokenizer=None, rng=None, seed: int = 0,
             bucket: int = DEFAULT_BUCKET, **sampler_options) -> GenerationResult:
    """Generates continuations of a batch of prompts with one jitted decode loop.

    Args:
      model: a DiffusionLM (e.g. from asynclane_jax.load).
      prompts: list of token-id lists (lengths may differ), or of strings when a
        tokenizer is given.
      sampler: "vanilla", "dream", "fast-dllm" or "localleap".
      gen_length: tokens generated per prompt.
      block_length: block size of block-wise samplers (default 32 where it divides
        gen_length; Dream's default is one block).
      tokenizer: optional; decodes `text` and encodes string prompts.
      rng: a jax PRNG key; default jax.random.key(seed).
      seed: used when rng is None.
      bucket: prompt lengths are padded up to a multiple of this (one compilation per
        bucket).
      **sampler_options: the sampler's options, e.g. steps, threshold, cache.
    Returns:
      GenerationResult.
    """
    if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], int)):
        raise SamplerError("prompts must be a list of prompts (a list of token-id lists)")
    if len(prompts) and isinstance(prompts[0], str):
        if tokenizer is None:
            raise SamplerError("string prompts need a tokenizer")
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    cfg = model.cfg
    policy = make_policy(sampler, gen_length=gen_length, block_length=block_length,
                         **sampler_options)
    canvas, pad_len, P = build_canvas(prompts, gen_length, cfg, bucket)
    cfg_scale = float(getattr(policy, "cfg_scale", 0.0))
    if rng is None:
        rng = jax.random.key(seed)
    graphdef, params = nnx.split(model)
    traces_before = loop.TRACE_COUNT["decode"]
    t0 = time.perf_counter()
    state = loop.decode_jit(graphdef, params, jnp.asarray(canvas), jnp.asarray(pad_len), rng,
                            policy=policy, cfg_scale=cfg_scale)
    state = jax.block_until_ready(state)
    wall = time.perf_counter() - t0
    canvas_out = np.asarray(state.canvas)
    tokens = canvas_out[:, P:]
    commit_step = np.asarray(state.commit_step)
    row_steps = np.asarray(state.row_steps)
    hit_cap = bool(np.any(np.asarray(state.block) < policy.num_blocks))
    stats = {
        "sampler": sampler,
        "policy": dataclasses.asdict(policy),
        "steps": int(row_steps.max()),
        "row_steps": row_steps,
        "iterations": int(state.step),
        "nfe": int(state.nfe_full + state.nfe_partial),
        "nfe_full": int(state.nfe_full),
        "nfe_partial": int(state.nfe_partial),
        "row_nfe_full": np.asarray(state.row_full),
        "row_nfe_partial": np.asarray(state.row_partial),
        "tokens_processed": int(state.tokens_processed),
        "commit_step": commit_step,
        "prompt_bucket": P,
        "compiled": loop.TRACE_COUNT["decode"] > traces_before,
        "wall_time": wall,
        "hit_step_cap": hit_cap,
    }
    stop = set(cfg.stop_token_ids)
    gen_counts = [len(_cut_at_stop(row, stop)) for row in tokens]
    stats["generated_tokens"] = gen_counts
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(_cut_at_stop(row, stop), skip_special_tokens=False)
                for row in tokens]
    return GenerationResult(tokens=tokens, text=text, stats=stats)
