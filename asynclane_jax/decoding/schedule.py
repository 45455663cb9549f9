"""What a sampler is to the decode driver: a schedule that plans calls and reads logits.

A schedule is a frozen, hashable dataclass; its fields are static settings, part of the
compiled program. Each iteration of the driver's one `lax.while_loop`:

  1. `plan(ctx, canvas, state, live) -> Plan`: per row a fixed number Q of canvas
     columns to query (padded with T, an index that is dropped), whether the call is a
     full forward over the whole canvas, and which rows the call serves (`first_plan`
     may ask for one first call of another query count);
  2. the driver makes the model call (full, or cached against the K/V of the whole
     canvas) and keeps the cache, counters and rng;
  3. `update(ctx, canvas, state, out, key) -> (canvas, state)`: commits anywhere on
     the canvas from the logits and advances the schedule's own state;
  4. `done(ctx, canvas, state) -> [b]`: rows that are finished (never served again).

A schedule that needs arrays (learned weights) returns them from `operands()`; the
driver makes them arguments of the compiled program and the schedule reads them as
`ctx.operands` (see `Schedule.operands`). Options whose values change no shape or branch
of the program (thresholds) are declared in `traced_options`: the driver passes them as
per-row [b] float32 arguments (`ctx.traced`), so schedules that differ only in them
share one program, and one batch may hold rows at different values (a server's
requests); the schedule reads them with `row_option`.

Dream's logit shift lives in one place, `CallOutput`: the output at column q predicts
column q + shift, for full and cached calls alike. A schedule that wants logits for
column c plans the query c - shift and reads them back with `CallOutput.at`.

Registry (registry.py): a subclass that sets `name` is a sampler; options, their
defaults and their help (the CLI's included) come from its dataclass fields and the
`Attributes:` sections of its docstrings, so adding a sampler touches one file.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding.stats import DecodeStats


class SamplerError(ValueError):
    """Bad sampler name or options."""


@struct.dataclass
class Plan:
    """One model call, as a schedule asks for it."""

    positions: jax.Array  # [b, Q] int32 canvas columns queried; T marks an unused slot
    full: jax.Array  # [] bool: a full forward over the whole canvas (else a cached call)
    serve: jax.Array  # [b] bool: rows the call serves; other rows' canvas stays as it is
    # [b, n] int32 or None: the queries (indices into `positions`) whose logits the
    # schedule reads; n >= Q marks an unused slot. None: every query's. A call with many
    # queries (e.g. a first call that encodes a long prefix) computes its output head
    # only where it is read.
    logits_at: jax.Array | None = None
    # [b, m] int32 or None: the canvas columns whose outputs a full forward reads (T: none),
    # where they differ from the queries' (Early-Bird's dual cache: every generated column
    # at a refresh, whose logits choose the block; the block's own in a cached call). A
    # full forward encodes every column whatever the queries, so this changes only what it
    # reads; the call's logits are then max(m, n) wide, the narrower kind padded. None:
    # a full forward reads what a cached call would.
    full_read: jax.Array | None = None
    # [b] bool or None: with `ctx.mixed` (a schedule that `mixes_calls`), the rows due a
    # full forward over their canvas; the other served rows get the cached call of their
    # planned queries in the same model call (`DiffusionLM.forward_mixed`), so no row
    # waits for another's full forward. Each row's `positions` are then those of its own
    # kind, and `full` is not read. None: the call is of one kind, `full`.
    full_rows: jax.Array | None = None


@struct.dataclass
class CallOutput:
    """What the model call gives the schedule's update."""

    logits: jax.Array  # [b, n, V] float32; row i predicts column targets[:, i]
    targets: jax.Array  # [b, n] int32 column predicted by each row (T: none)
    serve: jax.Array  # [b] bool, the plan's rows (finished rows removed)
    # [] bool, the plan's call kind; [b] bool for a plan with full_rows: the rows whose
    # call was a full forward.
    full: jax.Array

    def at(self, cols):
        """Logits predicting the canvas columns cols [b, n].

        Returns:
          (logits [b, n, V], has [b, n] bool: whether the call predicted that column;
          where it did not, the logits row is arbitrary and must not be used).
        """
        match = self.targets[:, None, :] == cols[:, :, None]  # [b, n, Q]
        has = jnp.any(match, axis=-1)
        idx = jnp.argmax(match, axis=-1)
        return jnp.take_along_axis(self.logits, idx[:, :, None], axis=1), has


# The block length LLaDA2 models are trained and published with (their generate
# code's default): a sampler that sets no attention layout of its own decodes a LLaDA2
# model with its blocks (`model_attention_blocks`).
LLADA2_BLOCK_LENGTH = 32


def llada2_attention_blocks(ctx, block_length: int):
    """[b, T] LLaDA2's block layout: blocks of `block_length` columns from each row's
    first prompt token (left padding in block 0, never attended), so the prompt's last
    block also holds the first generated positions."""
    cols = jnp.arange(ctx.length, dtype=jnp.int32)[None, :]
    return jnp.maximum(cols - ctx.pad_len[:, None], 0) // block_length


def model_attention_blocks(cfg, ctx):
    """The attention a model was trained with, for a schedule that sets none: LLaDA2's
    block layout (blocks of LLADA2_BLOCK_LENGTH) on a LLaDA2 model, None (bidirectional)
    on the others. (A D2F student's layout belongs to the `d2f` sampler, which sets it.)"""
    if getattr(cfg, "family", None) == "llada2":
        return llada2_attention_blocks(ctx, LLADA2_BLOCK_LENGTH)
    return None


def attention_layout(schedule, cfg, ctx):
    """The attention every call of a decode uses, decided once: (block ids, own) where
    block ids is the schedule's layout (`Schedule.attention_blocks`), else the model's
    own (`model_attention_blocks`: [b, T], or None for bidirectional), and own says it is
    the model's."""
    blocks = schedule.attention_blocks(ctx)
    if blocks is not None:
        return blocks, False
    return model_attention_blocks(cfg, ctx), True


@dataclasses.dataclass(frozen=True)
class Context:
    """Facts about the canvas that every schedule needs; built inside the trace.

    Canvas layout per row: [left padding | prompt | generation]; the generation region
    starts at the same column P in every row, so generated position j is column P + j.
    """

    batch: int  # b
    prompt_len: int  # P, the bucketed prompt length
    gen_length: int  # G
    shift: int  # 1 for a logit-shifted model (Dream), else 0
    mask_id: int
    eos_id: int
    stop_ids: tuple[int, ...]  # end-of-text tokens (EOS, end-of-turn)
    pad_len: jax.Array  # [b] int32 left padding of each row
    # The schedule's arrays (`Schedule.operands()`), traced arguments of the program;
    # None when it has none.
    operands: Any = None
    # The per-row values of the schedule's `traced_options`: {name: [b] float32},
    # traced arguments of the program; None when the caller gave none (the schedule's
    # own values are then constants of the program: `Schedule.row_option`).
    traced: Any = None
    # [b, G] int32 the model's attention block of each generated position, when the
    # decode uses a block-causal model's own layout (a LLaDA2 model under a schedule that
    # sets none: `model_attention_blocks`); None otherwise. See `commit_gate`.
    commit_blocks: Any = None
    # [b] int32 with commit_blocks: the prompt positions in the model's block that holds
    # generated position 0 (0 when the generation starts a block). A block schedule
    # starts its blocks there, so that they follow the model's (block.py).
    commit_lead: Any = None
    # Whether this decode mixes calls (`Schedule.mixes_calls`, and the driver can:
    # `driver.mixing`): the schedule's plans then give `Plan.full_rows`.
    mixed: bool = False

    @property
    def length(self) -> int:  # T = P + G
        return self.prompt_len + self.gen_length

    def commit_gate(self, gen):
        """[b, G] bool: the generated positions a schedule may commit now (gen: [b, G]
        the generated region before the commit).

        A block-causal model is trained with every earlier block finished: a noisy block
        attends to a clean prefix (LLaDA2's block diffusion). Decoded with its own layout
        by a schedule whose blocks or lanes do not follow it (they start at the prompt's
        end, or run ahead), a position may commit only in the first of the model's blocks
        that still holds a mask, or an earlier one: so every commit is predicted from the
        finished prefix the model was trained on. Everywhere else every position may."""
        if self.commit_blocks is None:
            return jnp.ones(gen.shape, bool)
        last = jnp.iinfo(jnp.int32).max
        first = jnp.min(jnp.where(gen == self.mask_id, self.commit_blocks, last), axis=-1)
        return self.commit_blocks <= first[:, None]

    def is_stop(self, tokens):
        """Whether each token is an end-of-text token."""
        return jnp.isin(tokens, jnp.asarray(self.stop_ids, jnp.int32))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Base of every sampler schedule.

    Attributes:
      gen_length: G, tokens generated per row.
    """

    # Registry name (set by a concrete sampler in its own class body; None: not
    # registered).
    name: ClassVar[str | None] = None
    # The statistics this schedule returns (a DecodeStats, or an extension of it whose
    # extra fields `summary` fills).
    stats_type: ClassVar[type[DecodeStats]] = DecodeStats
    # Fields that `from_options` fills and callers do not pass as sampler options.
    structural: ClassVar[tuple[str, ...]] = ("gen_length",)
    # What the bench reads (asynclane_jax.bench.compare): the options of this sampler
    # that set its footing, each named by its role (early_stop, cascade; none:
    # the sampler is compared as published), and whether it is the sampler under
    # study, whose rows are compared with the baselines'.
    footing_options: ClassVar[tuple[str, ...]] = ()
    under_study: ClassVar[bool] = False
    # `key=value` options a bench spec of this sampler gets when it names none; `a|b`
    # runs both and reports the faster (asynclane_jax.bench.spec).
    bench_defaults: ClassVar[tuple[str, ...]] = ()
    # Whether the driver may compute a full forward over only the rows it serves (the
    # others' cache kept as it is, their logits arbitrary): right for a schedule whose
    # update reads nothing of a row it does not serve (driver.py: `compact_buckets`).
    compact_full: ClassVar[bool] = False
    # Whether the schedule can plan mixed calls (`Plan.full_rows`: rows due a full
    # forward served in the same model call as the others' cached queries). The driver
    # turns it on for a decode (`ctx.mixed`) where it can (`driver.mixing`).
    mixes_calls: ClassVar[bool] = False
    # Options whose values change no shape and no Python branch of the program (float
    # thresholds): the driver passes them per row as [b] float32 arguments
    # (`ctx.traced`), they are left out of the compiled program's key (`structure`), and
    # the schedule reads them inside the trace with `row_option`, never as
    # `self.<name>`. Validation stays on the host, in `__post_init__`.
    traced_options: ClassVar[tuple[str, ...]] = ()
    # Whether the schedule commits only where `ctx.commit_gate` allows: the driver then
    # sets `ctx.commit_blocks` when it decodes a block-causal model with the model's own
    # layout.
    gated_commits: ClassVar[bool] = False
    gen_length: int

    def __post_init__(self):
        if self.gen_length <= 0:
            raise SamplerError(f"gen_length={self.gen_length}: must be positive")

    def bind(self, tokenizer, cfg) -> Schedule:
        """The schedule with what it needs from the tokenizer and model config resolved
        (e.g. delimiter token ids, learned weights); called by `generate` before
        compiling."""
        del tokenizer, cfg
        return self

    def operands(self) -> Any:
        """Arrays the compiled program takes as arguments for this schedule (a pytree
        of numpy or jax arrays, e.g. learned weights), or None (the default).

        The driver passes them into the program and the schedule reads them inside the
        trace as `ctx.operands` (traced, never folded in as constants). Their shapes and
        dtypes are part of the compiled program's key, their values are not: schedules
        that differ only in these values share one program. The schedule itself is a
        hashable key, so it keeps such arrays in a field declared
        `dataclasses.field(default=None, compare=False, repr=False)` (out of its hash,
        its equality and the reported options), and whatever fixes their structure
        (layer counts, head counts) in ordinary fields.
        """
        return None

    # -- per-row traced options -----------------------------------------------------
    def traced_values(self) -> dict[str, float]:
        """{name: value} of this schedule's `traced_options`."""
        return {n: float(getattr(self, n)) for n in self.traced_options}

    def structure(self) -> Schedule:
        """This schedule with every traced option at its field default: what a compiled
        program is keyed by and traced with (the values come in as arguments), so two
        schedules that differ only in traced values have one structure. Built without
        `__post_init__`, whose checks the values passed in the original."""
        if not self.traced_options:
            return self
        fields = {f.name: f for f in dataclasses.fields(self)}
        out = copy.copy(self)
        for n in self.traced_options:
            object.__setattr__(out, n, fields[n].default)
        return out

    def row_option(self, ctx: Context, name: str):
        """[b] float32: each row's value of the traced option `name`: the program's
        argument (`ctx.traced`) when the driver passed one, else this schedule's own
        value, as a constant of the program."""
        if ctx.traced is not None and name in ctx.traced:
            return ctx.traced[name]
        return jnp.full((ctx.batch,), getattr(self, name), jnp.float32)

    # -- what the driver asks -------------------------------------------------------
    @property
    def uses_cache(self) -> bool:
        """Whether the driver keeps a K/V cache of the canvas (cached calls allowed)."""
        return False

    @property
    def guidance_scale(self) -> float:
        """Classifier-free guidance scale of full forwards (0: none)."""
        return 0.0

    def max_iterations(self) -> int:
        """The loop's step cap; hitting it is a bug signal, reported in the stats."""
        raise NotImplementedError

    def init(self, ctx: Context) -> Any:
        """The schedule's initial state (a pytree of [b, ...] arrays)."""
        raise NotImplementedError

    def plan(self, ctx: Context, canvas, state, live) -> Plan:
        """The next model call.

        Args:
          ctx: the canvas facts.
          canvas: [b, T] int32.
          state: the schedule's state.
          live: [b] bool, rows not finished (padding rows of a batch bucket included
            as finished).
        Returns:
          Plan.
        """
        raise NotImplementedError

    def attention_blocks(self, ctx: Context):
        """[b, T] int block id of every canvas column for block-causal attention (a
        query attends only to keys whose block id is <= its own), in every call of the
        decode; None (the default): the model's own attention (`model_attention_blocks`:
        bidirectional, or LLaDA2's block layout on a LLaDA2 model)."""
        del ctx
        return None

    def first_plan(self, ctx: Context, canvas, state, live) -> Plan | None:
        """An optional first call, made once before the loop, whose query count may
        differ from `plan`'s (e.g. a cached call over a prefix of the canvas instead of a
        full forward); its output goes through `update` as any other. None: the loop
        starts with `plan`."""
        del ctx, canvas, state, live
        return None

    def update(self, ctx: Context, canvas, state, out: CallOutput, key) -> tuple[Any, Any]:
        """Commits from the call's logits.

        Args:
          ctx, canvas, state: as `plan`.
          out: the call's output.
          key: a PRNG key for this iteration.
        Returns:
          (canvas [b, T], new state). Only rows in out.serve may change (the driver
          enforces it).
        """
        raise NotImplementedError

    def done(self, ctx: Context, canvas, state):
        """[b] bool: rows that are finished."""
        raise NotImplementedError

    def summary(self, ctx: Context, state) -> dict:
        """Schedule-specific statistics from the final state (numpy arrays); the keys
        are fields of `stats_type`."""
        del ctx, state
        return {}

    def settings(self) -> dict:
        """The schedule's fields as plain values (what `stats.options` reports);
        fields declared `repr=False` (arrays held for `operands`) are left out."""
        def plain(v):
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                return dataclasses.asdict(v)
            if isinstance(v, (tuple, list)):
                return type(v)(plain(x) for x in v)
            return v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.repr}
