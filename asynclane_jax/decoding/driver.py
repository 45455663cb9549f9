"""The one decode driver: a single jitted lax.while_loop over a fixed-shape carry.

The driver knows nothing about blocks, lanes or thresholds. A schedule may ask for one
first call of its own shape before the loop (`Schedule.first_plan`). One iteration:
  1. the schedule plans the call (schedule.py: `Plan`);
  2. the driver makes it: a full forward over the whole canvas (its K/V become the cache
     of the rows it serves, when the schedule caches), or a cached call of the planned
     columns against the K/V of the whole canvas (their fresh K/V written in place);
     both are `DiffusionLM.forward`, one code path (a full forward serving at most half
     the rows computes only those, for schedules that allow it: `compact_buckets`);
  3. the schedule commits from the logits;
  4. the driver records the step at which each generated position was committed,
     counts calls and tokens, and marks the rows the schedule says are done.

Every call is one of a few static shapes (`CallShape`: full or cached, rows, queries,
keys, logits), numbered as they are traced (`CallSites`); the loop state counts the calls
of each shape, in total and per row, so a decode's stats say what it computed.

Rows finish independently; a finished row is never served again and its canvas never
changes. Rows that only pad a batch up to its bucket start finished.

The same iteration serves continuous batching (`serve_chunk`): a carried state whose
rows are slots, each chunk retiring and admitting rows and running up to K iterations in
one compiled program (ending early, when asked, once a row's answer is complete). Shapes
and dtypes of what a schedule returns are checked while tracing (`check_plan`,
`check_update`), so a wrong one fails with the schedule's name.
Compiled programs are kept in a bounded cache (`PROGRAMS`, `compiled_programs`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from asynclane_jax import sharding
from asynclane_jax.decoding.schedule import (
    CallOutput,
    Context,
    Plan,
    SamplerError,
    Schedule,
    attention_layout,
)
from asynclane_jax.decoding.stats import MAX_CALL_SHAPES, CallShape
from asynclane_jax.models.model import CallPart, KVCache

# Incremented each time the loop is traced; tests read it.
TRACE_COUNT = {"decode": 0}

# Whether a full forward that serves at most half the batch computes only the rows it
# serves, for schedules that allow it (`ModelCalls.compact_buckets`). Read when a decode
# is traced, and part of `compiled_decode`'s key; the decoding commands' `--no-compact-full`
# turns it off (for the memory), as a test or a measurement does to compare.
COMPACT_FULL = {"on": True}
# Whether a decode whose schedule `mixes_calls` serves the rows due a full forward in
# the same model call as the others' cached queries (`Plan.full_rows`,
# `DiffusionLM.forward_mixed`), where the driver can (`mixing`). Read when a decode is
# traced, and part of `compiled_decode`'s key; the decoding commands' `--mixed-calls`
# turns it on. Off by default: it pays only where a full forward of a few rows costs
# about a cached call (weight-bound, e.g. v6e at 8B), and costs elsewhere
# (experiments/results/decode/mixed_calls.md).
MIXED_CALLS = {"on": False}


@contextlib.contextmanager
def switched(switch: dict, on: bool):
    """A driver switch (COMPACT_FULL, MIXED_CALLS) set to `on` inside, then as it was:
    for the measurements and tests that compare a decode both ways."""
    saved = switch["on"]
    switch["on"] = bool(on)
    try:
        yield
    finally:
        switch["on"] = saved


@struct.dataclass
class DecodeState:
    """Everything that changes between iterations of the decode while_loop."""

    canvas: jax.Array  # [b, T] int32 token ids; the mask id where not yet committed
    commit_step: jax.Array  # [b, G] int32 row iteration that committed it, -1 if none
    finished: jax.Array  # [b] bool: done (or a padding row); never served again
    row_steps: jax.Array  # [b] int32 iterations in which the row was served
    row_full: jax.Array  # [b] int32 full forwards that served the row
    row_partial: jax.Array  # [b] int32 cached forwards that served the row
    step: jax.Array  # [] int32 loop iterations
    nfe_full: jax.Array  # [] int32 full forwards (one call = the whole batch)
    nfe_partial: jax.Array  # [] int32 cached forwards
    tokens_processed: jax.Array  # [] int32 query positions fed to the model, real rows
    shape_calls: jax.Array  # [S] int32 calls of each traced call shape (CallSites)
    row_shape_calls: jax.Array  # [b, S] int32 calls of each shape that served the row
    row_shape_keys: jax.Array  # [b, S] int32 key columns the row attended, summed
    rng: jax.Array  # PRNG key; folded with `step` each iteration, never reused
    cache: KVCache | None  # [L, b, T, K, h] x2 when the schedule caches
    sched: Any  # the schedule's own state


def mix_buckets(b: int) -> tuple[int, ...]:
    """The row counts s (1, 2, 4, ..., at most half of b rows) of a compacted full
    forward, or of a mixed call's full part."""
    return tuple(1 << i for i in range(b.bit_length()) if 2 * (1 << i) <= b)


def mixing(schedule: Schedule, cfg, b: int, blocks) -> bool:
    """Whether a decode of b rows mixes its calls: the schedule can
    (`Schedule.mixes_calls`) and caches, MIXED_CALLS is on, the batch has room for a
    full part (b >= 2), the model is dense (a mixture of experts routes the parts'
    tokens together), the attention is bidirectional (blocks: the decode's
    `attention_layout`, None) and the active sharding plan, if any, does not split the
    batch (a mixed call's tokens are one flat sequence, which no batch axis splits; a
    tensor axis splits its weights as any call's)."""
    plan = sharding.active()
    return bool(schedule.mixes_calls and schedule.uses_cache and MIXED_CALLS["on"]
                and b >= 2 and not cfg.is_moe and blocks is None
                and (plan is None or plan.batch_multiple == 1))


def make_context(cfg, schedule: Schedule, canvas_shape, pad_len, operands=None,
                 traced=None) -> Context:
    b, T = canvas_shape
    ctx = Context(batch=b, prompt_len=T - schedule.gen_length, gen_length=schedule.gen_length,
                  shift=1 if cfg.logit_shift else 0, mask_id=cfg.mask_token_id,
                  eos_id=cfg.eos_token_id, stop_ids=tuple(cfg.stop_token_ids),
                  pad_len=pad_len, operands=operands, traced=traced)
    blocks, own = attention_layout(schedule, cfg, ctx)
    if mixing(schedule, cfg, b, blocks):
        ctx = dataclasses.replace(ctx, mixed=True)
    if own and blocks is not None and schedule.gated_commits:
        P = ctx.prompt_len
        cols = jnp.arange(T, dtype=jnp.int32)[None, :]
        lead = (cols < P) & (cols >= pad_len[:, None]) & (blocks == blocks[:, P:P + 1])
        ctx = dataclasses.replace(ctx, commit_blocks=blocks[:, P:],
                                  commit_lead=jnp.sum(lead, axis=1, dtype=jnp.int32))
    return ctx


def traced_arrays(schedule: Schedule, b: int) -> dict | None:
    """The schedule's traced options as the program's per-row arguments: {name: [b]
    float32 numpy array}, every row at the schedule's value; None when it has none."""
    values = schedule.traced_values()
    if not values:
        return None
    return {n: np.full((b,), v, np.float32) for n, v in values.items()}


def check_plan(schedule: Schedule, plan: Plan, b: int, where: str = "plan") -> None:
    """Trace-time shape and dtype checks of a schedule's Plan; a wrong one fails here
    with a message naming the schedule, not deep inside the model call."""
    msg = f"{schedule.name or type(schedule).__name__}.{where}: Plan"
    chex.assert_shape(plan.positions, (b, None), custom_message=f"{msg}.positions is [b, Q]")
    chex.assert_type(plan.positions, int, custom_message=f"{msg}.positions holds columns")
    chex.assert_shape(plan.full, (), custom_message=f"{msg}.full is one bool")
    chex.assert_type(plan.full, bool, custom_message=f"{msg}.full is a bool")
    chex.assert_shape(plan.serve, (b,), custom_message=f"{msg}.serve is [b]")
    chex.assert_type(plan.serve, bool, custom_message=f"{msg}.serve is a bool mask")
    if plan.logits_at is not None:
        chex.assert_shape(plan.logits_at, (b, None),
                          custom_message=f"{msg}.logits_at is [b, n]")
        chex.assert_type(plan.logits_at, int, custom_message=f"{msg}.logits_at holds indices")
    if plan.full_rows is not None:
        chex.assert_shape(plan.full_rows, (b,), custom_message=f"{msg}.full_rows is [b]")
        chex.assert_type(plan.full_rows, bool, custom_message=f"{msg}.full_rows is a bool mask")
        if plan.full_read is not None:
            raise SamplerError(f"{msg}: full_rows and full_read do not go together")
    if plan.full_read is not None:
        chex.assert_shape(plan.full_read, (b, None),
                          custom_message=f"{msg}.full_read is [b, m]")
        chex.assert_type(plan.full_read, int, custom_message=f"{msg}.full_read holds columns")


def check_update(schedule: Schedule, canvas, new_canvas, state, new_state) -> None:
    """Trace-time checks of what a schedule's update returns: the canvas [b, T] int32 and
    a state of the same structure, shapes and dtypes (the loop carry cannot change)."""
    name = schedule.name or type(schedule).__name__
    chex.assert_trees_all_equal_shapes_and_dtypes(
        new_canvas, canvas, custom_message=f"{name}.update: the canvas stays [b, T] int32")
    chex.assert_trees_all_equal_structs(
        new_state, state, custom_message=f"{name}.update: the state keeps init's structure")
    chex.assert_trees_all_equal_shapes_and_dtypes(
        new_state, state, custom_message=f"{name}.update: the state keeps init's shapes "
        "and dtypes")


def run_if(pred, fn, state, out):
    """(out, state) = fn(state) when the traced bool `pred` holds, else (out, state) as
    given; `out` fixes the structure, shapes and dtypes of fn's first result.

    A while_loop of at most one trip, not a lax.cond branch: XLA copies the whole K/V
    cache when a loop that writes it in place (the scanned layers of a model call) runs
    inside a conditional branch (on the TPU, twice per layer iteration), while a loop
    nested in a loop updates its carry in place (experiments/results/compile/memory-8b.md,
    experiments/results/compile/cache_copies.json).
    """
    def body(carry):
        _, st, _ = carry
        o, st = fn(st)
        return jnp.zeros((), bool), st, o

    _, state, out = jax.lax.while_loop(lambda c: c[0], body,
                                       (jnp.asarray(pred, bool), state, out))
    return out, state


def branch(pred, true_fn, false_fn, state, out):
    """lax.cond(pred, true_fn, false_fn, state) for functions state -> (out, state) that
    update the K/V cache in place: two `run_if`s, exactly one of which runs."""
    out, state = run_if(pred, true_fn, state, out)
    return run_if(~jnp.asarray(pred, bool), false_fn, state, out)


class CallSites:
    """The call shapes of one traced decode, numbered in the order they are first
    traced: a shape's number is its slot in the loop state's counters (at most
    MAX_CALL_SHAPES). Tracing the same shape again gives the same number."""

    def __init__(self):
        self.shapes: list[CallShape] = []

    def index(self, shape: CallShape) -> int:
        if shape in self.shapes:
            return self.shapes.index(shape)
        if len(self.shapes) >= MAX_CALL_SHAPES:
            raise SamplerError(f"a decode makes more than {MAX_CALL_SHAPES} call shapes: "
                               f"{self.shapes + [shape]}")
        self.shapes.append(shape)
        return len(self.shapes) - 1


def zero_shape_counters(b: int) -> dict:
    """The call-shape counters of a fresh decode of b rows (DecodeState fields)."""
    return dict(shape_calls=jnp.zeros((MAX_CALL_SHAPES,), jnp.int32),
                row_shape_calls=jnp.zeros((b, MAX_CALL_SHAPES), jnp.int32),
                row_shape_keys=jnp.zeros((b, MAX_CALL_SHAPES), jnp.int32))


class ModelCalls:
    """The model calls of one decode: a full forward over the canvas (its K/V the cache
    of the rows it serves, when the schedule caches) or a cached call of the planned
    columns against the K/V of the whole canvas (their fresh K/V written in place),
    both `DiffusionLM.forward`. Each returns (logits, state with the cache and counters
    updated).

    Each call counts itself under its shape (`sites`), with the key columns each
    served row attended.
    """

    def __init__(self, model, schedule: Schedule, ctx: Context, pad_len, n_live,
                 sites: CallSites | None = None):
        self.model, self.schedule, self.ctx = model, schedule, ctx
        self.sites = CallSites() if sites is None else sites
        self.T = T = ctx.length
        self.cols = jnp.arange(T, dtype=jnp.int32)[None, :]
        self.key_mask = self.cols >= pad_len[:, None]  # [b, T]
        self.positions = jnp.maximum(self.cols - pad_len[:, None], 0)  # each row from 0
        self.use_cache = schedule.uses_cache
        self.cfg_scale = float(schedule.guidance_scale)
        if self.cfg_scale > 0 and self.use_cache:
            raise SamplerError(f"{schedule.name}: classifier-free guidance needs cache='none'")
        self.n_live = n_live  # [] rows counted in tokens_processed
        # [b, T] or None (bidirectional): the schedule's layout, else the model's own.
        self.block_ids, _ = attention_layout(schedule, model.cfg, ctx)
        self.vocab = model.cfg.vocab_size

    def no_logits(self, plan: Plan):
        """Zero logits of a call's shape [b, n, V] float32 (n: the columns read), the
        initial value `branch` needs."""
        return jnp.zeros((plan.positions.shape[0], self.read_width(plan), self.vocab),
                         jnp.float32)

    def count(self, st: DecodeState, shape: CallShape, serve, attended):
        """The state with one call of `shape` counted; attended [b]: key columns each
        row attended."""
        i = self.sites.index(shape)
        return st.replace(
            shape_calls=st.shape_calls.at[i].add(1),
            row_shape_calls=st.row_shape_calls.at[:, i].add(serve.astype(jnp.int32)),
            row_shape_keys=st.row_shape_keys.at[:, i].add(
                jnp.where(serve, attended, 0).astype(jnp.int32)))

    def query_reads(self, plan: Plan):
        """[b, n] canvas columns whose outputs a call of the plan's queries reads (T:
        none)."""
        if plan.logits_at is None:
            return plan.positions
        Q = plan.positions.shape[1]
        cols_at = jnp.take_along_axis(plan.positions, jnp.minimum(plan.logits_at, Q - 1), 1)
        return jnp.where(plan.logits_at < Q, cols_at, self.T)

    def read_width(self, plan: Plan) -> int:
        """The width of the call's logits: the queries' reads, or with `full_read` the
        wider of the two kinds."""
        n = self.query_reads(plan).shape[1]
        return n if plan.full_read is None else max(n, plan.full_read.shape[1])

    def pad_reads(self, a, plan: Plan, value):
        """a [b, k, ...] padded along axis 1 to `read_width` with value."""
        k = self.read_width(plan) - a.shape[1]
        if not k:
            return a
        return jnp.pad(a, [(0, 0), (0, k)] + [(0, 0)] * (a.ndim - 2), constant_values=value)

    def read_columns(self, plan: Plan):
        """[b, n] canvas columns whose outputs the schedule reads (T: none): the
        queries', or with `full_read` the full forward's where the plan is full."""
        cols = self.query_reads(plan)
        if plan.full_read is None:
            return cols
        return jnp.where(plan.full, self.pad_reads(plan.full_read, plan, self.T),
                         self.pad_reads(cols, plan, self.T))

    def full_over(self, st: DecodeState, plan: Plan, serve):
        """A full forward over the canvas: every column (re-)encoded, logits read at
        the planned columns."""
        T, ctx, block_ids = self.T, self.ctx, self.block_ids
        read = jnp.minimum(self.read_columns(plan), T - 1)
        keys = self.key_mask
        b, n_read = read.shape
        attended = jnp.sum(keys, axis=1)
        if self.cfg_scale > 0:
            # Unconditional copy: the prompt replaced by masks (LLaDA generate.py).
            uncond = jnp.where(self.cols < ctx.prompt_len, ctx.mask_id, st.canvas)
            two = lambda a: jnp.concatenate([a, a], axis=0)
            both, _ = self.model.forward(
                jnp.concatenate([st.canvas, uncond], axis=0), two(self.positions),
                key_mask=two(keys), logits_index=two(read),
                block_ids=None if block_ids is None else two(block_ids))
            cond, unc = jnp.split(both, 2, axis=0)
            # One model call (of twice the rows): counted once, its positions twice.
            shape = CallShape("full", 2 * b, T, T, n_read, False, T)
            return unc + (self.cfg_scale + 1.0) * (cond - unc), self.count(st.replace(
                nfe_full=st.nfe_full + 1,
                tokens_processed=st.tokens_processed + 2 * self.n_live * T,
                row_full=st.row_full + serve), shape, serve, attended)
        buckets = self.compact_buckets()
        if not buckets:
            return self.full_rows(st, read, serve, attended)
        # The smallest bucket that holds the served rows, else all rows: exactly one
        # of these at-most-one-trip loops runs.
        n = jnp.sum(serve)
        out, lo = jnp.zeros((b, n_read, self.vocab), jnp.float32), 0
        for s in buckets:
            out, st = run_if((n > lo) & (n <= s) if lo else n <= s,
                             functools.partial(self.full_compact, read=read, serve=serve,
                                               attended=attended, s=s), st, out)
            lo = s
        return run_if(n > lo, lambda x: self.full_rows(x, read, serve, attended), st, out)

    def compact_buckets(self) -> tuple[int, ...]:
        """The row counts s (1, 2, 4, ..., at most half the batch) of the compacted full
        forwards this decode traces: none unless the schedule caches, opts in
        (`Schedule.compact_full`) and `COMPACT_FULL` is on, and none when the active
        sharding plan splits the batch axis (a gather of rows would cross its shards)."""
        b = self.key_mask.shape[0]
        plan = sharding.active()
        if not (self.use_cache and self.schedule.compact_full and COMPACT_FULL["on"]) or (
                plan is not None and plan.batch_multiple > 1):
            return ()
        return mix_buckets(b)

    def full_rows(self, st: DecodeState, read, serve, attended):
        """The full forward over all b rows (only the served rows' cache written)."""
        T = self.T
        b, n_read = read.shape
        write = jnp.where(serve[:, None], self.cols, T)  # only served rows' cache
        logits, cache = self.model.forward(
            st.canvas, self.positions, key_mask=self.key_mask, cache=st.cache,
            write_index=write if self.use_cache else None, logits_index=read,
            block_ids=self.block_ids)
        shape = CallShape("full", b, T, T, n_read, self.use_cache, T)
        return logits, self.count(st.replace(
            cache=cache, nfe_full=st.nfe_full + 1,
            tokens_processed=st.tokens_processed + self.n_live * T,
            row_full=st.row_full + serve), shape, serve, attended)

    def full_compact(self, st: DecodeState, *, read, serve, attended, s: int):
        """The full forward over the served rows alone (at most s of them), gathered
        into s rows with a fresh cache of s rows written in full; their K/V rows are
        scattered into the decode's cache and their logits into [b, n, V] (zeros in the
        rows not served). Counted as a call of s rows."""
        T = self.T
        b, n_read = read.shape
        idx = jnp.nonzero(serve, size=s, fill_value=b)[0]  # [s]; b: an empty slot
        rows = jnp.minimum(idx, b - 1)  # an empty slot computes a copy, then dropped
        small = KVCache.zeros(self.model.cfg, s, T)
        logits, small = self.model.forward(
            st.canvas[rows], self.positions[rows], key_mask=self.key_mask[rows],
            cache=small, write_index=jnp.broadcast_to(self.cols, (s, T)),
            logits_index=read[rows],
            block_ids=None if self.block_ids is None else self.block_ids[rows])
        cache = KVCache(k=st.cache.k.at[:, idx].set(small.k, mode="drop"),
                        v=st.cache.v.at[:, idx].set(small.v, mode="drop"))
        logits = jnp.zeros((b, n_read, self.vocab), jnp.float32).at[idx].set(
            logits, mode="drop")
        shape = CallShape("full", s, T, T, n_read, True, T)
        return logits, self.count(st.replace(
            cache=cache, nfe_full=st.nfe_full + 1,
            tokens_processed=st.tokens_processed + jnp.minimum(self.n_live, s) * T,
            row_full=st.row_full + serve), shape, serve, attended)

    def by_kind(self, st: DecodeState, plan: Plan, serve):
        """The call of a plan with `full_rows` (a decode that mixes): a cached call when
        no served row is due a full forward; a full forward when every served row is;
        otherwise one mixed call (`mixed`) with a full part of the smallest bucket that
        holds the rows due one. When more rows are due a full forward than the largest
        bucket holds, they get a full forward and the others wait this iteration, as
        without mixing. Returns (logits, state, the rows served, the rows whose call was
        a full forward)."""
        due = plan.full_rows & serve
        n_full, n_cached = jnp.sum(due), jnp.sum(serve & ~due)
        buckets = mix_buckets(due.shape[0])
        wait = (n_full > buckets[-1]) & (n_cached > 0)
        serve = jnp.where(wait, due, serve)
        as_full = plan.replace(full=jnp.asarray(True))
        out = self.no_logits(plan)
        out, st = run_if(n_full == 0, lambda s: self.cached(s, plan, serve), st, out)
        out, st = run_if((n_full > 0) & ((n_cached == 0) | wait),
                         lambda s: self.full_over(s, as_full, serve), st, out)
        lo = 0
        for s in buckets:
            out, st = run_if((n_full > lo) & (n_full <= s) & (n_cached > 0),
                             functools.partial(self.mixed, plan=plan, serve=serve, due=due,
                                               s=s), st, out)
            lo = s
        return out, st, serve, due

    def mixed(self, st: DecodeState, *, plan: Plan, serve, due, s: int):
        """One model call (`DiffusionLM.forward_mixed`): a full forward over the canvases
        of the rows `due` one (at most s, gathered into s rows, their cache rows written
        whole) and the planned cached call of the other served rows. Counted as one call
        of the "mixed" shape."""
        T = self.T
        read = jnp.minimum(self.query_reads(plan), T - 1)
        b, Q = plan.positions.shape
        idx = jnp.nonzero(due, size=s, fill_value=b)[0]  # [s]; b: an empty slot
        rows = jnp.minimum(idx, b - 1)  # an empty slot computes a copy, then dropped
        full = CallPart(tokens=st.canvas[rows], positions=self.positions[rows],
                        key_mask=self.key_mask[rows],
                        write_index=jnp.broadcast_to(self.cols, (s, T)), rows=idx,
                        logits_index=read[rows])
        cached_rows = serve & ~due
        part, n_logits, n = self.cached_part(st, plan, cached_rows)
        (logits_full, logits), cache = self.model.forward_mixed((full, part), st.cache)
        logits = self.pad_reads(logits, plan, 0.0)
        placed = jnp.zeros_like(logits).at[idx].set(logits_full, mode="drop")
        logits = jnp.where(due[:, None, None], placed, logits)
        shape = CallShape("mixed", b, Q, T, n_logits, True, T, full_rows=s)
        attended = jnp.sum(self.key_mask, axis=1)
        return logits, self.count(st.replace(
            cache=cache, nfe_full=st.nfe_full + 1,
            tokens_processed=st.tokens_processed + jnp.minimum(self.n_live, s) * T + n,
            row_full=st.row_full + due, row_partial=st.row_partial + cached_rows),
            shape, serve, attended)

    def cached_part(self, st: DecodeState, plan: Plan, serve):
        """The cached call of the planned columns as a CallPart of every row (only the
        served rows' fresh K/V written), the logits columns it computes per row, and the
        query positions it feeds for the served rows."""
        T = self.T
        valid = plan.positions < T
        read = jnp.minimum(plan.positions, T - 1)
        part = CallPart(
            tokens=jnp.take_along_axis(st.canvas, read, axis=1),
            positions=jnp.take_along_axis(self.positions, read, axis=1),
            key_mask=self.key_mask,
            write_index=jnp.where(valid & serve[:, None], plan.positions, T),  # T: dropped
            logits_index=None if plan.logits_at is None else
            jnp.minimum(plan.logits_at, plan.positions.shape[1] - 1))
        n_read = (plan.positions.shape[1] if plan.logits_at is None
                  else plan.logits_at.shape[1])
        return part, n_read, jnp.sum(valid & serve[:, None]).astype(jnp.int32)

    def cached(self, st: DecodeState, plan: Plan, serve):
        """The planned columns against the K/V of the whole canvas."""
        T = self.T
        part, n_read, n = self.cached_part(st, plan, serve)
        logits, cache = self.model.forward(
            part.tokens, part.positions, key_mask=part.key_mask, cache=st.cache,
            write_index=part.write_index, logits_index=part.logits_index,
            block_ids=self.block_ids)
        logits = self.pad_reads(logits, plan, 0.0)  # as wide as a full forward's reads
        b, Q = plan.positions.shape
        shape = CallShape("cached", b, Q, T, n_read, True, T)
        attended = jnp.sum(self.key_mask, axis=1)
        return logits, self.count(st.replace(
            cache=cache, nfe_partial=st.nfe_partial + 1,
            tokens_processed=st.tokens_processed + n,
            row_partial=st.row_partial + serve), shape, serve, attended)


@dataclasses.dataclass(frozen=True)
class Loop:
    """What `build_loop(..., pieces=True)` gives: the initial state (no call made yet),
    the iteration, the loop condition, the schedule's first call for chosen rows, the
    canvas facts and the step cap."""

    state: DecodeState
    body: Any
    cond: Any
    first_call: Any  # (state, rows [b] bool) -> state
    ctx: Context
    max_iter: int


def build_loop(graphdef, params, canvas, pad_len, live, rng, operands=None, traced=None, *,
               schedule: Schedule, tap=None, pieces: bool = False,
               sites: CallSites | None = None):
    """The loop's pieces: (initial DecodeState, body(state) -> state, cond(state) -> bool).

    `decode_loop` runs them in lax.while_loop; tests and experiments drive `body` from a
    Python loop.

    Args:
      graphdef, params: the split NNX model.
      canvas: [b, T] int32, prompts left-padded to P = T - G, then G mask ids.
      pad_len: [b] int32 left padding of each row.
      live: [b] bool, False for rows that only pad the batch (they start finished).
      rng: PRNG key.
      operands: the schedule's arrays (`Schedule.operands()`), seen as `ctx.operands`.
      traced: {name: [b] float32} per-row values of the schedule's `traced_options`,
        seen as `ctx.traced` (None: the schedule's own values, constants of the trace).
      schedule: the sampler (static).
      tap: optional stand-in for `schedule.update` with its arguments, returning
        (canvas, state, extra) where extra is any pytree of arrays; `body` then
        returns (state, extra). Decode traces record what a schedule saw this way,
        through this one step (not supported with a schedule's `first_plan`).
      pieces: return a `Loop` whose state has made no call yet (for callers that
        decide which rows get the first call, as continuous batching does).
      sites: where the traced call shapes are numbered (a fresh CallSites if None); a
        caller that reports the counters passes its own and reads its shapes.
    Returns:
      (state after the schedule's first call, body, cond), or a Loop.
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, T = canvas.shape
    ctx = make_context(cfg, schedule, canvas.shape, pad_len, operands, traced)
    P, G = ctx.prompt_len, ctx.gen_length
    use_cache = schedule.uses_cache
    calls = ModelCalls(model, schedule, ctx, pad_len, n_live=jnp.sum(live).astype(jnp.int32),
                       sites=sites)
    sched0 = schedule.init(ctx)
    state = DecodeState(
        canvas=canvas,
        commit_step=jnp.full((b, G), -1, jnp.int32),
        finished=~live | schedule.done(ctx, canvas, sched0),
        row_steps=jnp.zeros((b,), jnp.int32),
        row_full=jnp.zeros((b,), jnp.int32),
        row_partial=jnp.zeros((b,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        nfe_full=jnp.zeros((), jnp.int32),
        nfe_partial=jnp.zeros((), jnp.int32),
        tokens_processed=jnp.zeros((), jnp.int32),
        **zero_shape_counters(b),
        rng=rng,
        cache=KVCache.zeros(cfg, b, T) if use_cache else None,
        sched=sched0,
    )
    max_iter = schedule.max_iterations()

    def step(st: DecodeState, plan: Plan, where: str = "plan"):
        """One call and its update: (state, the tap's extra or None)."""
        check_plan(schedule, plan, b, where)
        if ctx.mixed != (plan.full_rows is not None):
            raise SamplerError(f"{schedule.name}.{where}: a plan gives full_rows exactly "
                               f"when the decode mixes its calls (ctx.mixed={ctx.mixed})")
        serve = plan.serve & ~st.finished
        full = jnp.asarray(plan.full)
        if ctx.mixed:
            logits, st, serve, full = calls.by_kind(st, plan, serve)
        elif use_cache:
            logits, st = branch(plan.full, lambda s: calls.full_over(s, plan, serve),
                                lambda s: calls.cached(s, plan, serve), st,
                                calls.no_logits(plan))
        else:
            logits, st = calls.full_over(st, plan, serve)
        # The output at column q predicts column q + shift (Dream), in every call.
        cols = calls.read_columns(plan)
        targets = jnp.where(cols < T, cols + ctx.shift, T)
        out = CallOutput(logits=logits, targets=targets, serve=serve, full=full)
        key = jax.random.fold_in(st.rng, st.step)
        if tap is None:
            (canvas, sched), extra = schedule.update(ctx, st.canvas, st.sched, out, key), None
        else:
            canvas, sched, extra = tap(ctx, st.canvas, st.sched, out, key)
        check_update(schedule, st.canvas, canvas, st.sched, sched)
        canvas = jnp.where(serve[:, None], canvas, st.canvas)
        newly = (st.canvas[:, P:] == ctx.mask_id) & (canvas[:, P:] != ctx.mask_id)
        commit_step = jnp.where(newly, st.row_steps[:, None], st.commit_step)
        return st.replace(
            canvas=canvas, commit_step=commit_step, sched=sched,
            finished=st.finished | schedule.done(ctx, canvas, sched),
            row_steps=st.row_steps + serve, step=st.step + 1), extra

    def body(st: DecodeState):
        st, extra = step(st, schedule.plan(ctx, st.canvas, st.sched, ~st.finished))
        return st if tap is None else (st, extra)

    def cond(st: DecodeState):
        return jnp.any(~st.finished) & (st.step < max_iter)

    def first_call(st: DecodeState, rows):
        """The schedule's first_plan call for `rows` [b] bool (skipped when none is
        live, or the schedule has none)."""
        first = schedule.first_plan(ctx, st.canvas, st.sched, rows & ~st.finished)
        if first is None:
            return st
        if tap is not None:
            raise SamplerError(f"{schedule.name}: a tap does not see the first_plan call")
        return run_if(jnp.any(rows & ~st.finished),
                      lambda s: (None, step(s, first, "first_plan")[0]), st, None)[1]

    if not pieces:
        return first_call(state, ~state.finished), body, cond
    return Loop(state=state, body=body, cond=cond, first_call=first_call, ctx=ctx,
                max_iter=max_iter)


def decode_loop(graphdef, params, canvas, pad_len, live, rng, operands=None, traced=None, *,
                schedule: Schedule, sites: CallSites | None = None) -> DecodeState:
    """Runs a schedule to completion in one lax.while_loop (arguments as build_loop).

    Returns:
      The final DecodeState (with the cache).
    """
    TRACE_COUNT["decode"] += 1
    state, body, cond = build_loop(graphdef, params, canvas, pad_len, live, rng, operands,
                                   traced, schedule=schedule, sites=sites)
    return jax.lax.while_loop(cond, body, state)


def decode_for_caller(graphdef, params, canvas, pad_len, live, rng, operands=None,
                      traced=None, *, schedule, sites: CallSites | None = None):
    """`decode_loop` without the K/V cache in the result: what `generate` compiles."""
    state = decode_loop(graphdef, params, canvas, pad_len, live, rng, operands, traced,
                        schedule=schedule, sites=sites)
    return state.replace(cache=None)  # large, and not needed by the caller


def answered(ctx: Context, state: DecodeState, limit=None):
    """[b] bool: rows whose answer a server can send in full, as the serving engine
    reads the canvas: the row is finished, or its contiguous committed prefix (the
    generated columns before the first mask) holds a stop token before `limit`, or
    reaches `limit` ([b] int32 tokens a row's request wants; None: G)."""
    gen = state.canvas[:, ctx.prompt_len:]
    G = gen.shape[1]
    cols = jnp.arange(G, dtype=jnp.int32)[None, :]
    ready = jnp.min(jnp.where(gen == ctx.mask_id, cols, G), axis=1)  # first mask, or G
    stop = jnp.min(jnp.where(ctx.is_stop(gen), cols, G), axis=1)  # first stop, or G
    limit = jnp.full_like(ready, G) if limit is None else jnp.minimum(limit, G)
    return state.finished | (stop < jnp.minimum(ready, limit)) | (ready >= limit)


def serve_chunk(graphdef, params, state: DecodeState, pad_len, admit, canvas_in, retire,
                chunk, operands=None, traced=None, until_answer=None, limit=None, *,
                schedule: Schedule, sites: CallSites | None = None) -> DecodeState:
    """One chunk of continuous batching over the rows of a carried DecodeState: every
    chunk size, admission and retirement runs in this one compiled program.

      1. Rows in `retire` finish (a cancelled request's slot is freed).
      2. Rows in `admit` start over with their row of `canvas_in`: commit steps,
         counters and the schedule's state are those of a fresh decode, their cache row
         is zeroed, and the schedule's first call (if it has one) is made for them.
      3. Up to `chunk` iterations of the decode loop (fewer once every row is
         finished); a row that reaches the schedule's step cap is finished. With
         `until_answer`, the chunk also ends after the iteration in which a row's answer
         became complete (`answered`: the row finished, or its committed prefix reached
         a stop token or its `limit`), so that the caller sends it and fills the slot
         at once instead of after the rest of the chunk.

    A row decodes as it would in `generate` (rows never see each other), whatever the
    other rows do and whenever it was admitted.

    Args:
      graphdef, params: the split NNX model.
      state: the slots' DecodeState (with its cache), e.g. from `serve_init`.
      pad_len: [b] int32 left padding of each row (admitted rows' new padding).
      admit, retire: [b] bool.
      canvas_in: [b, T] int32; read only in admitted rows.
      chunk: [] int32, the most iterations to run (traced: any value, one program).
      operands: the schedule's arrays.
      traced: {name: [b] float32} each slot's values of the schedule's traced options
        (a server's requests each at their own threshold, in one program); a slot's
        value must stay the same while its row decodes.
      until_answer: [] bool (traced: one program either way), whether a row's answer
        completing ends the chunk; None: False (the chunk runs its `chunk` iterations).
      limit: [b] int32 tokens each row's request wants (its max_tokens), what
        `answered` reads; None: G for every row.
      schedule: the sampler (static).
      sites: where the program's call shapes are numbered (`state.shape_calls` counts
        the calls of each across chunks); a caller that reports them passes its own.
    Returns:
      The new DecodeState.
    """
    b = state.canvas.shape[0]
    st = state.replace(finished=state.finished | retire)
    canvas = jnp.where(admit[:, None], canvas_in, st.canvas)
    loop = build_loop(graphdef, params, canvas, pad_len, admit | ~st.finished, st.rng,
                      operands, traced, schedule=schedule, pieces=True, sites=sites)
    fresh = loop.state  # a fresh decode's state (its zero cache is never used)

    def pick(new, old):
        return jnp.where(admit.reshape(admit.shape + (1,) * (old.ndim - 1)), new, old)

    cache = st.cache
    if cache is not None:  # zero the admitted rows' cache in place
        # A scatter of the admitted rows only: a select over the whole cache was cheaper
        # on the tiny CPU model, but reads and writes every slot's K/V each chunk, which
        # on a chip is the size of a model call's cache reads.
        rows = jnp.where(admit, jnp.arange(b), b)
        cache = KVCache(k=cache.k.at[:, rows].set(0, mode="drop"),
                        v=cache.v.at[:, rows].set(0, mode="drop"))
    st = st.replace(canvas=canvas, commit_step=pick(fresh.commit_step, st.commit_step),
                    finished=pick(fresh.finished, st.finished),
                    row_steps=pick(fresh.row_steps, st.row_steps),
                    row_full=pick(fresh.row_full, st.row_full),
                    row_partial=pick(fresh.row_partial, st.row_partial),
                    row_shape_calls=pick(fresh.row_shape_calls, st.row_shape_calls),
                    row_shape_keys=pick(fresh.row_shape_keys, st.row_shape_keys),
                    sched=jax.tree.map(pick, fresh.sched, st.sched), cache=cache)
    # Rows whose answer is complete before this chunk's calls (free, retired, or
    # answered and not yet retired by the caller) never end it.
    before = answered(loop.ctx, st, limit)
    until = jnp.zeros((), bool) if until_answer is None else jnp.asarray(until_answer, bool)
    st = loop.first_call(st, admit)

    def cond(carry):
        st, i = carry
        new = jnp.any(answered(loop.ctx, st, limit) & ~before)
        return jnp.any(~st.finished) & (i < chunk) & ~(until & new)

    def body(carry):
        st, i = carry
        st = loop.body(st)
        return st.replace(finished=st.finished | (st.row_steps >= loop.max_iter)), i + 1

    st, _ = jax.lax.while_loop(cond, body, (st, jnp.zeros((), jnp.int32)))
    return st


def serve_init(graphdef, params, canvas, rng, operands=None, traced=None, *,
               schedule: Schedule) -> DecodeState:
    """The carried state of `serve_chunk` before any row is admitted: every row
    finished (a free slot), a zero cache. canvas: [b, T] int32, for the shapes."""
    b = canvas.shape[0]
    loop = build_loop(graphdef, params, canvas, jnp.zeros((b,), jnp.int32),
                      jnp.zeros((b,), bool), rng, operands, traced, schedule=schedule,
                      pieces=True)
    return loop.state


@dataclasses.dataclass
class Executable:
    """One compiled decode program and what it cost to build."""

    fn: Any
    compile_time: float  # seconds spent tracing, lowering and compiling
    schedule: Schedule | None = None  # what it decodes (for `compiled_programs`)
    shapes: tuple = ()  # (canvas [b, T], operand shapes) it was compiled for
    uses: int = 0  # calls served from the cache after the first
    call_shapes: tuple[CallShape, ...] = ()  # its model calls' shapes, by counter slot
    # The compiled program itself, which takes the traced options' per-row arrays
    # ({name: [b] float32}, `traced_arrays`) as a seventh argument; `fn` binds them to
    # the schedule it was asked for (`compiled_decode`).
    program: Any = None


class ProgramCache:
    """Compiled decode programs keyed by (model structure, schedule, sharding plan,
    argument shapes), least recently used first out once more than `maxsize` are held.
    A server or an evaluation over many shape buckets keeps its working set; a long
    session that tries many settings does not hold every program it ever built."""

    def __init__(self, maxsize: int):
        self._items: collections.OrderedDict[Any, Executable] = collections.OrderedDict()
        self.maxsize = maxsize

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, n: int) -> None:
        if int(n) < 1:
            raise SamplerError(f"program cache size {n}: must be at least 1")
        self._maxsize = int(n)
        self._trim()

    def get(self, key) -> Executable | None:
        exe = self._items.get(key)
        if exe is not None:
            self._items.move_to_end(key)
            exe.uses += 1
        return exe

    def put(self, key, exe: Executable) -> None:
        self._items[key] = exe
        self._items.move_to_end(key)
        self._trim()

    def _trim(self) -> None:
        while len(self._items) > self._maxsize:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def entries(self) -> list[Executable]:
        """The programs held, least recently used first."""
        return list(self._items.values())


def _default_cache_size() -> int:
    raw = os.environ.get("ASYNCLANE_PROGRAM_CACHE", "32")
    try:
        return int(raw)
    except ValueError:
        raise SamplerError(f"ASYNCLANE_PROGRAM_CACHE={raw!r}: expected a whole number "
                           "of compiled programs to keep") from None


# The compiled decode programs of this process.
PROGRAMS = ProgramCache(_default_cache_size())


def _abstract_key(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, *((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
                       for x in leaves))


def lower_decode(graphdef, params, canvas, pad_len, live, rng, operands=None, traced=None,
                 *, schedule: Schedule, plan: sharding.ShardingPlan | None = None,
                 sites: CallSites | None = None):
    """The decode lowered for these arguments (arrays or ShapeDtypeStructs, placed on
    the plan's mesh when there is one), with the plan's constraints on the activations
    and the cache. `.compile()` it for the arguments' backend. `sites` receives the
    call shapes the trace numbered. Without `traced`, the schedule's traced options are
    constants of the program; `compiled_decode` passes them as arguments."""
    jitted = jax.jit(functools.partial(decode_for_caller, graphdef, schedule=schedule,
                                       sites=sites))
    with sharding.use(plan):
        return jitted.lower(params, canvas, pad_len, live, rng, operands, traced)


def _place_traced(traced: dict | None, plan: sharding.ShardingPlan | None):
    """The traced options' [b] arrays where the program takes them: the default device,
    or replicated over the plan's mesh (each process filling its own devices)."""
    if traced is None or plan is None:
        return None if traced is None else {n: jnp.asarray(v) for n, v in traced.items()}
    where = plan.replicated()
    return {n: jax.make_array_from_callback(v.shape, where, lambda i, v=v: v[i])
            for n, v in traced.items()}


def compiled_decode(graphdef, params, canvas, pad_len, live, rng, operands=None, *,
                    schedule: Schedule, plan: sharding.ShardingPlan | None = None
                    ) -> tuple[Executable, bool]:
    """The compiled program for these shapes (and sharding plan), compiling it on first
    use. Operands enter the key by shape and dtype only, and the schedule by its
    `structure()` (its traced options left out): schedules that differ only in their
    operands' values or their traced options' values share one program.

    The program takes the traced options as [b] float32 arguments (`traced_arrays`);
    the Executable returned has them bound to this schedule's values, so its `fn` takes
    the six arguments given here (its `program` takes per-row values as a seventh).

    Returns:
      (Executable, whether this call compiled it).
    """
    structure = schedule.structure()
    traced = _place_traced(traced_arrays(schedule, canvas.shape[0]), plan)
    key = (graphdef, structure, plan, COMPACT_FULL["on"], MIXED_CALLS["on"],
           _abstract_key((params, canvas, pad_len, live, rng, operands, traced)))
    exe = PROGRAMS.get(key)
    compiled = exe is None
    if compiled:
        t0 = time.perf_counter()
        sites = CallSites()
        fn = lower_decode(graphdef, params, canvas, pad_len, live, rng, operands, traced,
                          schedule=structure, plan=plan, sites=sites).compile()
        shapes = (tuple(canvas.shape),
                  tuple(tuple(x.shape) for x in jax.tree.leaves(operands)))
        exe = Executable(fn=fn, compile_time=time.perf_counter() - t0, schedule=schedule,
                         shapes=shapes, call_shapes=tuple(sites.shapes), program=fn)
        PROGRAMS.put(key, exe)
    program = exe.program
    return dataclasses.replace(exe, fn=lambda *args: program(*args, traced)), compiled


def compiled_programs() -> list[dict]:
    """What the program cache holds, least recently used first: per program the
    sampler and its settings, the canvas shape [b, T], compile seconds and reuses."""
    return [{"sampler": e.schedule.name or type(e.schedule).__name__,
             "schedule": e.schedule, "canvas": e.shapes[0] if e.shapes else None,
             "compile_time": e.compile_time, "uses": e.uses} for e in PROGRAMS.entries()]


def set_program_cache_size(n: int) -> None:
    """Keeps at most n compiled decode programs (default 32, or the environment's
    ASYNCLANE_PROGRAM_CACHE); the least recently used go first."""
    PROGRAMS.maxsize = n


def clear_compiled() -> None:
    """Forgets every compiled decode program (they are rebuilt on next use)."""
    PROGRAMS.clear()
