"""`generate`: the public entry point of the decode driver."""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from asynclane_jax import sharding
from asynclane_jax.decoding import driver, registry
from asynclane_jax.decoding.registry import DEFAULT_SAMPLER
from asynclane_jax.decoding.schedule import SamplerError, Schedule
from asynclane_jax.decoding.stats import DecodeStats

# Prompt lengths are rounded up to a multiple of this, so that prompts of similar length
# share one compiled loop.
DEFAULT_BUCKET = 32


def batch_bucket(n: int) -> int:
    """Rows a batch of n prompts is padded to: 1, 2, 4, 8, then multiples of 8. A
    server or an evaluation with uneven batches compiles a handful of programs, and a
    padding row costs nothing but its share of each call (it starts finished)."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


def batch_rows(n: int, *, pad_batch: bool = True,
               plan: sharding.ShardingPlan | None = None) -> int:
    """Rows a decode of n prompts runs with: `batch_bucket(n)` (or n without
    pad_batch), then up to a multiple of the plan's batch axes, so that every device
    of them gets the same number of rows."""
    rows = batch_bucket(n) if pad_batch else n
    if plan is not None:
        rows = -(-rows // plan.batch_multiple) * plan.batch_multiple
    return rows


def prompt_bucket(longest: int, gen_length: int, cfg, bucket: int = DEFAULT_BUCKET) -> int:
    """P, the prompt length a decode runs with: the longest prompt rounded up to a
    multiple of `bucket`, cut so that P + gen_length fits the model.

    Raises:
      SamplerError: the longest prompt and gen_length exceed the model's maximum
        sequence length.
    """
    if longest + gen_length > cfg.max_seq_len:
        raise SamplerError(
            f"prompt length {longest} + gen_length {gen_length} exceeds the model's maximum "
            f"sequence length {cfg.max_seq_len}")
    return min(bucket_length(longest, bucket), cfg.max_seq_len - gen_length)


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns.

    Attributes:
      tokens: [b, gen_length] int numpy array, the generated region of each row.
      text: decoded text per row (cut at the first end-of-text, special tokens dropped)
        when a tokenizer was given.
      stats: a DecodeStats (or the schedule's extension of it).
    """

    tokens: np.ndarray
    text: list[str] | None
    stats: DecodeStats


def make_schedule(sampler: str, *, gen_length: int, **options) -> Schedule:
    """Builds and validates a sampler's schedule from its name and options; options
    left out take the schedule's defaults (None counts as left out)."""
    options = {k: v for k, v in options.items() if v is not None}
    return registry.build(sampler, gen_length=gen_length, **options)


def sharding_plan(model, mesh, params=None) -> sharding.ShardingPlan | None:
    """The plan `generate` decodes with: the given plan, or mesh (a Mesh or a spec
    string) with the default rules, else the mesh the parameters are on (`params`, the
    model's parameter state when the caller has it), else None (one device, no
    constraints)."""
    if isinstance(mesh, sharding.ShardingPlan):
        return mesh
    if mesh is not None:
        mesh = sharding.make_mesh(mesh)
    else:
        mesh = sharding.mesh_of(model) if params is None else sharding.mesh_of_state(params)
    return None if mesh is None else sharding.plan_for(model.cfg, mesh)


# id(model) -> (a weak reference to the model, its pytree structure, weak references to
# its leaves, nnx.split's graphdef and state), for `split_model`.
_SPLITS: dict[int, tuple] = {}


def _weak(x):
    try:
        return weakref.ref(x)
    except TypeError:  # a Python scalar leaf: small, held as it is
        return lambda: x


def split_model(model) -> tuple:
    """`nnx.split(model)`, remembered per model: a later call returns the same graphdef
    and state while the model's pytree structure and every leaf (array) are the same
    objects, which a flatten of the model tells in a fraction of a split's time (a
    split walks the module graph in Python: several milliseconds per `generate` call at
    any model size). Any change of the model's arrays or structure (`nnx.update`,
    `variable[...] = x`, a replaced variable or module) makes the next call split
    again. The state holds the model's own Variables, as a split's does, so values set
    in them are its own; the leaves are held weakly. A variable or module replaced
    outright stays held here until the model's next call, or until the model is freed
    (its entry goes with it)."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    held = _SPLITS.get(id(model))
    if held is not None:
        ref, tdef, refs, graphdef, params = held
        if (ref() is model and tdef == treedef and len(refs) == len(leaves)
                and all(r() is x for r, x in zip(refs, leaves))):
            return graphdef, params
    graphdef, params = nnx.split(model)
    key = id(model)
    ref = weakref.ref(model, lambda _, key=key: _SPLITS.pop(key, None))
    _SPLITS[key] = (ref, treedef, [_weak(x) for x in leaves], graphdef, params)
    return graphdef, params


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
    P = prompt_bucket(max(lengths), gen_length, cfg, bucket)
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


def generate(model, prompts, *, sampler: str | Schedule = DEFAULT_SAMPLER, gen_length: int = 128,
             tokenizer=None, rng=None, seed: int = 0, bucket: int = DEFAULT_BUCKET,
             pad_batch: bool = True, mesh=None, **sampler_options) -> GenerationResult:
    """Generates continuations of a batch of prompts with one compiled decode loop.

    The compiled program is kept, keyed by (model structure, sampler settings, shapes):
    a later call with the same shapes reuses it (`stats.compiled` is False).

    Args:
      model: a DiffusionLM (e.g. from asynclane_jax.load).
      prompts: list of token-id lists (lengths may differ), or of strings when a
        tokenizer is given.
      sampler: a registered sampler name (`asynclane_jax.decoding.samplers()`), or a
        Schedule object (which then carries gen_length and every option).
      gen_length: tokens generated per prompt.
      tokenizer: optional; decodes `text` and encodes string prompts.
      rng: a jax PRNG key; default jax.random.key(seed).
      seed: used when rng is None.
      bucket: prompt lengths are padded up to a multiple of this.
      pad_batch: pad the number of rows up to `batch_bucket(n)`.
      mesh: decode sharded over a mesh: a jax.sharding.Mesh, a spec such as
        "data=2,tensor=4", a preset name, or a ShardingPlan with rules of one's own
        (see asynclane_jax.sharding). Default: the mesh the model's parameters were
        loaded onto (`load(..., mesh=...)`), if any. Parameters not yet on the mesh
        are placed on it (a copy); rows are padded to a multiple of the mesh's batch
        axes.
      **sampler_options: the sampler's options, e.g. block_length, steps, threshold,
        cache, cfg_scale.
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
    graphdef, params = split_model(model)
    if isinstance(sampler, Schedule):
        if sampler_options:
            raise SamplerError("options go into the Schedule object itself, not generate()")
        schedule, gen_length = sampler, sampler.gen_length
        sampler = schedule.name or type(schedule).__name__
    else:
        schedule = make_schedule(sampler, gen_length=gen_length, **sampler_options)
    schedule = schedule.bind(tokenizer, cfg)
    canvas, pad_len, P = build_canvas(prompts, gen_length, cfg, bucket)
    n = len(prompts)
    plan = sharding_plan(model, mesh, params)
    rows = batch_rows(n, pad_batch=pad_batch, plan=plan)
    live = np.arange(rows) < n
    if rows > n:  # padding rows copy row 0 and start finished
        canvas = np.concatenate([canvas, np.repeat(canvas[:1], rows - n, axis=0)])
        pad_len = np.concatenate([pad_len, np.repeat(pad_len[:1], rows - n)])
    if rng is None:
        rng = jax.random.key(seed)
    args = sharding.place_decode_arguments(plan, params, canvas, pad_len, live, rng,
                                           schedule.operands())
    exe, compiled = driver.compiled_decode(graphdef, *args, schedule=schedule, plan=plan)
    t0 = time.perf_counter()
    state = jax.block_until_ready(exe.fn(*args))
    decode_time = time.perf_counter() - t0
    state = sharding.to_host(state)

    real = slice(0, n)
    tokens = np.asarray(state.canvas)[real, P:]
    row_steps = np.asarray(state.row_steps)[real]
    stop = set(cfg.stop_token_ids)
    ctx = driver.make_context(cfg, schedule, canvas.shape, pad_len)
    extra = {k: (np.asarray(v)[real] if np.ndim(v) else v)
             for k, v in schedule.summary(ctx, jax.device_get(state.sched)).items()}
    stats = schedule.stats_type(
        sampler=sampler,
        options=schedule.settings(),
        steps=int(row_steps.max()),
        row_steps=row_steps,
        iterations=int(state.step),
        nfe=int(state.nfe_full + state.nfe_partial),
        nfe_full=int(state.nfe_full),
        nfe_partial=int(state.nfe_partial),
        row_nfe_full=np.asarray(state.row_full)[real],
        row_nfe_partial=np.asarray(state.row_partial)[real],
        tokens_processed=int(state.tokens_processed),
        commit_step=np.asarray(state.commit_step)[real],
        generated_tokens=[len(_cut_at_stop(row, stop)) for row in tokens],
        prompt_bucket=P,
        batch_bucket=rows,
        compiled=compiled,
        compile_time=exe.compile_time if compiled else 0.0,
        decode_time=decode_time,
        hit_step_cap=bool(np.any(~np.asarray(state.finished)[real])),
        call_shapes=exe.call_shapes,
        shape_calls=np.asarray(state.shape_calls)[:len(exe.call_shapes)],
        row_shape_calls=np.asarray(state.row_shape_calls)[real, :len(exe.call_shapes)],
        row_shape_keys=np.asarray(state.row_shape_keys)[real, :len(exe.call_shapes)],
        **extra,
    )
    text = None
    if tokenizer is not None:
        # As LLaDA's chat.py: special tokens (end-of-turn, chat markers) are not text.
        text = [tokenizer.decode(_cut_at_stop(row, stop), skip_special_tokens=True)
                for row in tokens]
    return GenerationResult(tokens=tokens, text=text, stats=stats)

