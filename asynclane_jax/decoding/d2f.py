"""D2F, discrete diffusion forcing (arXiv 2508.09192): pipelined block decoding.

A row's generation is cut into blocks of `block_length` positions, added one at a time:
  1. while no end-of-text has been committed, a new, fully masked block is added once
     the last added block has decoded at least `block_add_threshold` of its positions
     (the first block is added at once: the prompt counts as decoded);
  2. a block is *fully activated* once its predecessor has decoded at least
     `decoded_token_threshold` of its positions, *semi-activated* until then;
  3. each call decodes every active block: a position commits its argmax when its
     probability exceeds `skip_threshold`; a semi-activated block may commit nothing, a
     fully activated one commits at least its most confident position;
  4. a block with no masks left is finished; once every earlier block is finished too,
     it is encoded once more with its final tokens (its K/V join the cache) and never
     queried again.
Blocks are in one of four states: absent, active, to-cache (finished, K/V written by
the next call), cached.

The model should be block-causal (a D2F student, `ModelConfig.block_causal`): the prompt
attends to itself and each block to the prompt, earlier blocks and itself. Then a
finished block's K/V never change, and every call is a cached call over the row's
in-flight span (the first block not cached through the last added), against the cache
of everything before it; blocks not yet added are invisible to all. The first call
encodes the prompt and the first block.

On a bidirectional model the rules are the same, but a finished block's K/V would change
with every later block, so nothing is cached: every call is a full forward over the
whole canvas with bidirectional attention (said once, as a warning).

Fixed shapes: a call queries `max_active_blocks * block_length` columns (plus one for a
logit-shifted model), so at most that many blocks are in flight; a block is added only
when there is room (the public code has no such cap; with a cap no smaller than the
number of blocks the two decode alike). Blocks that were never added (the row ended
with an end-of-text first) become end-of-text when the row finishes.

The three thresholds are traced options (schedule.py: `traced_options`): per-row
arguments of the compiled program, read with `row_option`.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding.ops import check_threshold, greedy_confidence
from asynclane_jax.decoding.schedule import CallOutput, Context, Plan, SamplerError, Schedule

ABSENT, ACTIVE, TO_CACHE, CACHED = 0, 1, 2, 3

_warned: set = set()


@struct.dataclass
class D2FState:
    blocks: jax.Array  # [b, nb] int32: ABSENT, ACTIVE, TO_CACHE or CACHED
    complete: jax.Array  # [b, nb] bool: fully activated
    eos: jax.Array  # [b] bool: an end-of-text was committed (no block is added after)


@dataclasses.dataclass(frozen=True)
class D2FSchedule(Schedule):
    """D2F pipelined block decoding.

    Attributes:
      block_length: positions per block; must divide gen_length.
      block_add_threshold: tau_add, decoded fraction of the last block at which the
        next block is added.
      decoded_token_threshold: tau_act, decoded fraction of a block at which its
        successor becomes fully activated.
      skip_threshold: tau_conf, probability a position's argmax must exceed to commit.
      max_active_blocks: blocks in flight at once (active, or finished and awaiting
        their cache write); fixes the size of every call.
    """

    name = "d2f"
    structural = ("gen_length", "block_causal")
    traced_options = ("block_add_threshold", "decoded_token_threshold", "skip_threshold")
    block_length: int = 32
    block_add_threshold: float = 0.1
    decoded_token_threshold: float = 0.95
    skip_threshold: float = 0.9
    max_active_blocks: int = 4
    # Resolved from the model config by `bind` (None before): block-causal attention
    # and the block cache, or bidirectional full forwards.
    block_causal: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.block_length <= 0 or self.gen_length % self.block_length:
            raise SamplerError(f"d2f: block_length={self.block_length} must be positive and "
                               f"divide gen_length={self.gen_length}")
        for field in ("block_add_threshold", "decoded_token_threshold"):
            check_threshold(self.name, getattr(self, field), field)
        if not 0 <= self.skip_threshold < 1:
            raise SamplerError(f"d2f: skip_threshold={self.skip_threshold} must be in [0, 1)")
        if self.max_active_blocks < 1:
            raise SamplerError(f"d2f: max_active_blocks={self.max_active_blocks} must be "
                               "at least 1")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def window(self) -> int:
        """Canvas columns a call decodes: the in-flight blocks' span at its widest."""
        return min(self.max_active_blocks, self.num_blocks) * self.block_length

    def bind(self, tokenizer, cfg) -> D2FSchedule:
        del tokenizer
        causal = bool(cfg.block_causal)
        if not causal and cfg not in _warned:
            _warned.add(cfg)
            warnings.warn("d2f: this model was not trained block-causal (its config has "
                          "block_causal false): decoding with full bidirectional attention "
                          "and no block cache, every call a full forward", stacklevel=3)
        return dataclasses.replace(self, block_causal=causal)

    # -- what the driver asks -------------------------------------------------------
    def _causal(self) -> bool:
        if self.block_causal is None:
            raise SamplerError("d2f: the schedule is not bound to a model (generate binds "
                               "it: schedule.bind(tokenizer, cfg))")
        return self.block_causal

    @property
    def uses_cache(self) -> bool:
        return self._causal()

    def attention_blocks(self, ctx: Context):
        if not self._causal():
            return None
        cols = jnp.arange(ctx.length, dtype=jnp.int32)
        ids = jnp.where(cols < ctx.prompt_len, 0,
                        (cols - ctx.prompt_len) // self.block_length + 1)
        return jnp.broadcast_to(ids, (ctx.batch, ctx.length))

    def max_iterations(self) -> int:
        # Each iteration with an active block commits at least one position of the first
        # one (it is fully activated); cache-write calls add at most one per block.
        return 2 * self.gen_length + 2 * self.num_blocks + 2

    def init(self, ctx: Context) -> D2FState:
        b, nb = ctx.batch, self.num_blocks
        first = jnp.broadcast_to(jnp.arange(nb)[None, :] == 0, (b, nb))
        return D2FState(blocks=jnp.where(first, ACTIVE, ABSENT).astype(jnp.int32),
                        complete=first, eos=jnp.zeros((b,), bool))

    def _first_in_flight(self, blocks):
        """(first in-flight block [b], whether the row has one [b]) of block states."""
        inflight = (blocks == ACTIVE) | (blocks == TO_CACHE)
        return jnp.argmax(inflight, axis=-1).astype(jnp.int32), jnp.any(inflight, axis=-1)

    def _window_columns(self, ctx: Context, first):
        """[b, W] canvas columns of the in-flight span starting at block `first`."""
        return (ctx.prompt_len + first[:, None] * self.block_length
                + jnp.arange(self.window, dtype=jnp.int32)[None, :])

    def first_plan(self, ctx: Context, canvas, state, live) -> Plan | None:
        if not self._causal():
            return None
        # The prompt and the first block, one cached call: the prompt's K/V join the
        # cache; logits are read only where the first block is predicted.
        P, B, s = ctx.prompt_len, self.block_length, ctx.shift
        cols = jnp.broadcast_to(jnp.arange(P + B, dtype=jnp.int32), (ctx.batch, P + B))
        read = jnp.broadcast_to(jnp.arange(P - s, P + B - s, dtype=jnp.int32), (ctx.batch, B))
        return Plan(positions=cols, full=jnp.asarray(False), serve=live, logits_at=read)

    def plan(self, ctx: Context, canvas, state, live) -> Plan:
        first, any_inflight = self._first_in_flight(state.blocks)
        added = jnp.sum(state.blocks != ABSENT, axis=-1).astype(jnp.int32)
        end = ctx.prompt_len + added * self.block_length  # end of the last added block
        # A logit-shifted model predicts column c from c - 1: query one column earlier.
        n = self.window + ctx.shift
        cols = (ctx.prompt_len + first[:, None] * self.block_length - ctx.shift
                + jnp.arange(n, dtype=jnp.int32)[None, :])
        positions = jnp.where(cols < end[:, None], cols, ctx.length)
        return Plan(positions=positions, full=jnp.asarray(not self._causal()),
                    serve=live & any_inflight)

    def update(self, ctx: Context, canvas, state: D2FState, out: CallOutput, key):
        del key
        P, B, nb, T = ctx.prompt_len, self.block_length, self.num_blocks, ctx.length
        serve = out.serve
        first, _ = self._first_in_flight(state.blocks)
        wcols = self._window_columns(ctx, first)  # [b, W]
        logits, has = out.at(wcols)
        x0, conf = greedy_confidence(logits)
        rel = wcols - P
        wblock = jnp.minimum(rel // B, nb - 1)  # [b, W] block of each window column
        in_range = rel < self.gen_length
        bstate = jnp.take_along_axis(state.blocks, wblock, axis=1)
        full_act = jnp.take_along_axis(state.complete, wblock, axis=1)
        safe_cols = jnp.minimum(wcols, T - 1)
        masked = (in_range & has & (bstate == ACTIVE)
                  & (jnp.take_along_axis(canvas, safe_cols, axis=1) == ctx.mask_id))

        # Commit: above the threshold; a fully activated block with none above commits
        # its most confident masked position.
        above = masked & (conf > self.row_option(ctx, "skip_threshold")[:, None])
        A = self.window // B
        conf_b = jnp.where(masked, conf, -jnp.inf).reshape(-1, A, B)
        top1 = jax.nn.one_hot(jnp.argmax(conf_b, axis=-1), B, dtype=bool).reshape(masked.shape)
        none_above = ~jnp.any(above.reshape(-1, A, B), axis=-1, keepdims=True)
        forced = jnp.broadcast_to(none_above, (masked.shape[0], A, B)).reshape(masked.shape)
        commit = above | (masked & full_act & forced & top1)
        commit = commit & serve[:, None]
        rows = jnp.arange(canvas.shape[0])[:, None]
        canvas = canvas.at[rows, jnp.where(commit, wcols, T)].set(x0, mode="drop")
        eos = state.eos | jnp.any(commit & (x0 == ctx.eos_id), axis=-1)

        # Block bookkeeping: this call wrote the to-cache blocks' K/V.
        blocks = jnp.where(serve[:, None] & (state.blocks == TO_CACHE), CACHED, state.blocks)
        gen = canvas[:, P:].reshape(-1, nb, B)
        decoded = jnp.sum(gen != ctx.mask_id, axis=-1)  # [b, nb]
        has_mask = decoded < B
        active = blocks == ACTIVE
        # A finished block joins the cache once no earlier block is still decoding.
        still = active & has_mask
        earlier_still = jnp.cumsum(still, axis=-1) - still > 0
        to_cache = active & ~has_mask & ~earlier_still
        blocks = jnp.where(serve[:, None] & to_cache, TO_CACHE, blocks)

        # Add a block: no end-of-text yet, room in the window, the last block far enough.
        added = jnp.sum(blocks != ABSENT, axis=-1)  # [b]
        first_after, any_after = self._first_in_flight(blocks)
        first_after = jnp.where(any_after, first_after, added)
        last_frac = jnp.take_along_axis(decoded, jnp.maximum(added - 1, 0)[:, None],
                                        axis=1)[:, 0] / B
        add = (serve & ~eos & (added < nb) & (added + 1 - first_after <= A)
               & (last_frac >= self.row_option(ctx, "block_add_threshold")))
        new = jnp.arange(nb)[None, :] == added[:, None]
        blocks = jnp.where(add[:, None] & new, ACTIVE, blocks)

        # Full activation: the predecessor has decoded enough (the prompt counts as done).
        prev_frac = jnp.concatenate([jnp.ones_like(decoded[:, :1]), decoded[:, :-1]],
                                    axis=-1) / B
        act = self.row_option(ctx, "decoded_token_threshold")[:, None]
        complete = state.complete | ((blocks != ABSENT) & (prev_frac >= act))

        # A row with nothing left to decode ends; blocks never added become end-of-text.
        # A row whose window filled with blocks that all finished in this call, with no
        # end-of-text, goes on: the next call writes their K/V and adds the next block.
        finished = serve & self._ended(blocks, eos)
        absent_cols = jnp.concatenate(
            [jnp.zeros((canvas.shape[0], P), bool),
             jnp.repeat(blocks == ABSENT, B, axis=-1)], axis=-1)
        canvas = jnp.where(finished[:, None] & absent_cols, ctx.eos_id, canvas)
        return canvas, D2FState(blocks=blocks, complete=complete, eos=eos)

    def _ended(self, blocks, eos):
        """[b] bool: no block is decoding and none will be added (an end-of-text was
        committed, or every block was added)."""
        all_added = jnp.all(blocks != ABSENT, axis=-1)
        return ~jnp.any(blocks == ACTIVE, axis=-1) & (eos | all_added)

    def done(self, ctx: Context, canvas, state: D2FState):
        return self._ended(state.blocks, state.eos)
