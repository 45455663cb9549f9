"""Block-wise semi-autoregressive decoding: the schedule the four block samplers share.

A row works on one block of B generated positions at a time and moves to the next once
the block has no masks left; a sampler only says what to commit inside the block
(`select`). Block i covers generated positions [i*B, (i+1)*B), canvas columns
P + i*B onwards.

Calls. Without a cache every iteration is a full forward serving every unfinished row.
With a cache, a row entering a block needs a refresh: a full forward whose K/V become
its cache and whose logits decode that step (Fast-dLLM: no call is wasted). Refreshes
are batched, as in the public batched code: once every unfinished row has entered a new
block, one full forward serves them all; until then the rows that have entered one wait
(their canvas frozen, so each row decodes exactly as it would alone) and a cached call
serves the others, querying the block (dual cache) or [block start, T) (prefix cache).

Dream's logit shift: the logits for column c are the output at c - 1 (schedule.py). A
full forward queries the block's columns minus the shift, so every block column is
predicted. A cached call queries the block itself (Fast-dLLM re-encodes exactly those
columns), which predicts columns s + 1 .. s + B for a block starting at s: column s gets
no prediction in cached calls. Fast-dLLM's Dream block decoding therefore commits column
s, by argmax, at the block-start step (`shift_commits_block_start`), which is always a
full forward.

Per-row refresh (`row_refresh`, off by default, as published): a row entering a block
gets its refresh at once. A full forward serves only the rows entering one (the others
wait that iteration, their canvas frozen), and the driver computes it over those rows
alone (`Schedule.compact_full`: the update commits nothing in a row it does not serve).
This is how AsyncLane refreshes its rows, so at batch > 1 it is the baseline's equal
footing; each row decodes the same tokens either way, and at batch 1 the calls are the
same too.

A block-causal model decoded with its own layout (LLaDA2: blocks of 32 from each row's
first prompt token, not from the prompt's end): the threshold samplers (`gated_commits`)
follow the model's blocks. Their blocks are laid out from the model's: the first one
starts `lead` positions before the generation, in the prompt's tail (those columns are
queried, never committed), the last one is cut at the canvas's end, one block more than
gen_length / B where the lead is not 0 (`_lead`). With B a multiple of the model's
block (the default 32), a block is whole model blocks: its queries see every column
their attention reaches that can change (the later blocks are invisible to it), so a
cache refreshed when the block starts stays exact. They also commit only in the first
of the model's blocks that holds a mask (`Context.commit_gate`), so a block of any
other B that straddles two of the model's decodes them in order, each from a finished
prefix, as the model was trained.

The cascade (`cascade`, off by default, as published) puts a block sampler on
AsyncLane's footing (asynclane.py): an end-of-text committed at p ends the row there:
every later position becomes end-of-text at once (mid-block, unlike `early_stop`, which
waits for the block to finish), and the row is done when no generated position is
masked, so no call is spent on the tail.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.schedule import (
    CallOutput,
    Context,
    Plan,
    SamplerError,
    Schedule,
)

CACHE_MODES = ("none", "prefix", "dual")
# The most rows a decode with `row_refresh` may have: each row's block entries may cost
# the others an iteration, so the loop's step cap grows with the batch.
ROW_REFRESH_MAX_ROWS = 256


@struct.dataclass
class BlockState:
    block: jax.Array  # [b] int32 current block index; == the row's block count once done
    step_in_block: jax.Array  # [b] int32 iterations the row has spent in its block
    policy: Any  # the sampler's own state (pytree)


@dataclasses.dataclass(frozen=True)
class BlockSchedule(Schedule):
    """Semi-autoregressive block decoding.

    Attributes:
      block_length: B, positions per block; must divide gen_length (default: the
        sampler's usual block, or one block when that does not divide gen_length).
      cache: none (every call a full forward) | prefix (refresh at block start, then
        query [block start, T) against the cached prefix) | dual (refresh at block start,
        then query only the block against the cache of everything else).
      early_stop: once a finished block holds an end-of-text token, everything after it
        becomes end-of-text and the row stops (the public LocalLeap code's option; off
        as published).
      cascade: an end-of-text committed at p ends the row there at once: every later
        position becomes end-of-text and no call is spent on the tail, as asynclane's
        cascade (off as published).
      row_refresh: with a cache, refresh each row as soon as it enters a block (a full
        forward over the entering rows alone; the others wait one iteration), as
        asynclane refreshes its rows; off: the published batched refresh, once every
        unfinished row has entered its block. Same tokens and calls per row; at
        batch > 1 no row waits for the slowest to finish its block.
    """

    # The sampler's usual block length (None: one block of gen_length).
    default_block_length: ClassVar[int | None] = 32
    # With a logit-shifted model (Dream), the block-start step commits exactly the
    # block's first column by argmax (Fast-dLLM's Dream block decoding); see above.
    shift_commits_block_start: ClassVar[bool] = False
    # The bench (Schedule): both footing options; the faster cache by default.
    footing_options: ClassVar[tuple[str, ...]] = ("early_stop", "cascade")
    bench_defaults: ClassVar[tuple[str, ...]] = ("cache=prefix|dual",)
    # The update commits only in served rows and `select` keeps no per-row state that
    # an unserved row's (arbitrary) logits could change, so a full forward may be
    # computed over the served rows alone. A sampler whose `select` keeps such state
    # sets this False.
    compact_full: ClassVar[bool] = True
    # A block-causal model decoded with its own layout: only the first of its blocks
    # with masks commits (Context.commit_gate), so a block of B that straddles two of
    # the model's decodes their positions in order. The first masked position of the
    # block is always allowed, so every served iteration still commits.
    gated_commits: ClassVar[bool] = True
    block_length: int | None = None
    cache: str = "none"
    early_stop: bool = False
    cascade: bool = False
    row_refresh: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.block_length is None:
            default = self.default_block_length or self.gen_length
            object.__setattr__(self, "block_length",
                               default if self.gen_length % default == 0 else self.gen_length)
        if self.block_length <= 0:
            raise SamplerError(f"block_length={self.block_length}: must be positive")
        if self.gen_length % self.block_length:
            raise SamplerError(
                f"gen_length={self.gen_length} is not a multiple of "
                f"block_length={self.block_length}")
        if self.cache not in CACHE_MODES:
            raise SamplerError(f"cache={self.cache!r}: expected one of {CACHE_MODES}")
        n = self.name or type(self).__name__
        if self.cascade not in (True, False):
            raise SamplerError(f"{n}: cascade={self.cascade!r} must be true or false")
        object.__setattr__(self, "cascade", bool(self.cascade))
        if self.row_refresh not in (True, False):
            raise SamplerError(f"{n}: row_refresh={self.row_refresh!r} must be true or false")
        object.__setattr__(self, "row_refresh", bool(self.row_refresh))
        if self.row_refresh and self.cache == "none":
            raise SamplerError(f"{n}: row_refresh needs a cache (cache=prefix or dual)")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def uses_cache(self) -> bool:
        return self.cache != "none"

    @property
    def mixes_calls(self) -> bool:  # Schedule.mixes_calls, per instance
        # With row_refresh a row entering a block is refreshed in the same call as the
        # others' cached queries, rather than making them wait (driver: `mixing`).
        return self.row_refresh

    def max_iterations(self) -> int:
        # Every served iteration commits at least one token; with a cache a row may also
        # wait while its batch mates finish their blocks (at most G iterations in all).
        # With row_refresh a cached iteration serves every live row (so there are at
        # most G of them) and a full one at least one row entering a block. Blocks that
        # follow a block-causal model's may number one more (`_lead`).
        blocks = self.num_blocks + 1
        extra = blocks * ROW_REFRESH_MAX_ROWS if self.row_refresh else 0
        return 2 * self.gen_length + blocks + 2 + extra

    # -- the sampler's part ---------------------------------------------------------
    def init_policy(self, ctx: Context) -> Any:
        """The sampler's state, `select`'s pstate: by default each row's values of the
        sampler's traced options, {name: [b] float32} (schedule.py: `row_option`), which
        `select` reads as `pstate[name][:, None]`."""
        return {n: self.row_option(ctx, n) for n in self.traced_options}

    def select(self, logits, masked, step_in_block, key, pstate):
        """Chooses what to commit in each row's current block.

        Args:
          logits: [b, B, V] float32, the logits predicting each block position.
          masked: [b, B] bool, still-masked positions that this call predicted.
          step_in_block: [b] int32 iterations already spent on this block.
          key: PRNG key for this iteration.
          pstate: the sampler's state.
        Returns:
          (commit [b, B] bool (a subset of masked), tokens [b, B] int32, new pstate).
        """
        raise NotImplementedError

    # -- the schedule -----------------------------------------------------------------
    def init(self, ctx: Context) -> BlockState:
        b = ctx.batch
        if self.row_refresh and b > ROW_REFRESH_MAX_ROWS:
            raise SamplerError(f"{self.name or type(self).__name__}: row_refresh decodes "
                               f"at most {ROW_REFRESH_MAX_ROWS} rows at once, not {b}")
        return BlockState(block=jnp.zeros((b,), jnp.int32),
                          step_in_block=jnp.zeros((b,), jnp.int32),
                          policy=self.init_policy(ctx))

    def _lead(self, ctx: Context):
        """[b] int32: how far before the generation each row's first block starts. 0
        (blocks from the prompt's end) unless the decode follows a block-causal model's
        own blocks (ctx.commit_lead: LLaDA2's blocks run from each row's first prompt
        token, so the one holding the first generated positions starts
        ctx.commit_lead prompt positions earlier); then the first block starts that lead
        mod B positions early, so a block of B that is a multiple of the model's is
        whole model blocks and a cache refreshed when it starts stays exact while it
        decodes (the prompt's tail in the first block is queried with it; the last
        block is cut at the canvas's end)."""
        if ctx.commit_lead is None:
            return jnp.zeros((ctx.batch,), jnp.int32)
        return ctx.commit_lead % self.block_length

    def _block_count(self, ctx: Context):
        """[b] int32 blocks of each row: one more where the blocks start before the
        generation (`_lead`), the last one cut at the canvas's end."""
        return self.num_blocks + (self._lead(ctx) > 0).astype(jnp.int32)

    def _columns(self, ctx: Context, block):
        """[b, B] canvas columns of each row's current block (the last for finished
        rows); columns at or past T (a last block cut at the canvas's end) are no
        column."""
        B = self.block_length
        last = self._block_count(ctx) - 1
        start = ctx.prompt_len - self._lead(ctx) + jnp.minimum(block, last) * B
        return start[:, None] + jnp.arange(B, dtype=jnp.int32)[None, :]

    def query_size(self, ctx: Context) -> int:
        if self.cache != "prefix":
            return self.block_length
        # The block's start to the canvas's end; a block may start before the generation.
        return self.gen_length + (0 if ctx.commit_lead is None else self.block_length - 1)

    def plan(self, ctx: Context, canvas, state: BlockState, live) -> Plan:
        T, Q, B = ctx.length, self.query_size(ctx), self.block_length
        cols = self._columns(ctx, state.block)
        cols = jnp.where(cols < T, cols, T)  # T: no query
        pad = jnp.full((ctx.batch, Q - B), T, jnp.int32)
        full_q = jnp.concatenate([jnp.where(cols < T, cols - ctx.shift, T), pad], axis=1)
        if not self.uses_cache:
            return Plan(positions=full_q, full=jnp.asarray(True), serve=live)
        need = live & (state.step_in_block == 0)
        if ctx.mixed:  # row refresh, each row's call of its own kind in one model call
            cached_q = cols if self.cache == "dual" else self._prefix_queries(cols, Q, T)
            return Plan(positions=jnp.where(need[:, None], full_q, cached_q),
                        full=jnp.any(need), serve=live, full_rows=need)
        refresh = jnp.any(need) if self.row_refresh else jnp.all(need | ~live)
        if self.cache == "dual":
            cached_q = cols
        else:  # prefix: the block start to the canvas end
            cached_q = self._prefix_queries(cols, Q, T)
        return Plan(positions=jnp.where(refresh, full_q, cached_q), full=refresh,
                    serve=jnp.where(refresh, need, live & ~need))

    @staticmethod
    def _prefix_queries(cols, Q: int, T: int):
        """[b, Q] the prefix cache's queries: the block's start to the canvas end."""
        q = cols[:, :1] + jnp.arange(Q, dtype=jnp.int32)[None, :]
        return jnp.where(q < T, q, T)

    def update(self, ctx: Context, canvas, state: BlockState, out: CallOutput, key):
        b, B, T, P = ctx.batch, self.block_length, ctx.length, ctx.prompt_len
        rows = jnp.arange(b)[:, None]
        cols = self._columns(ctx, state.block)
        valid = cols < T  # a last block cut at the canvas's end
        cols = jnp.minimum(cols, T - 1)  # read; written through `put` (invalid: dropped)
        put = jnp.where(valid, cols, T)
        logits, has = out.at(cols)
        blk = jnp.take_along_axis(canvas, cols, axis=1)
        gate = jnp.take_along_axis(ctx.commit_gate(canvas[:, P:]),
                                   jnp.clip(cols - P, 0, ctx.gen_length - 1), axis=1)
        masked = (blk == ctx.mask_id) & out.serve[:, None] & has & gate & valid
        commit, x0, pstate = self.select(logits, masked, state.step_in_block, key,
                                         state.policy)
        if ctx.shift and self.shift_commits_block_start:
            at_start = (state.step_in_block == 0)[:, None]
            first_col = jnp.arange(B)[None, :] == 0
            x0 = jnp.where(at_start & first_col, jnp.argmax(logits, -1).astype(x0.dtype), x0)
            commit = jnp.where(at_start, first_col, commit)
        x0 = ops.never_the_mask(logits, x0, ctx.mask_id)
        commit = commit & masked
        new_blk = jnp.where(commit, x0, blk)
        canvas = canvas.at[rows, put].set(new_blk, mode="drop")
        if self.cascade:  # an end-of-text at p: every later position is end-of-text
            canvas = self._cascade(ctx, canvas, out.serve)
            new_blk = jnp.take_along_axis(canvas, cols, axis=1)
        block_done = out.serve & ~jnp.any((new_blk == ctx.mask_id) & valid, axis=1)
        block = state.block + block_done
        count = self._block_count(ctx)
        if self.early_stop:
            stop = block_done & jnp.any(ctx.is_stop(new_blk) & valid & (cols >= P), axis=1)
            after = jnp.arange(T)[None, :] > cols[:, -1:]
            canvas = jnp.where(stop[:, None] & after, ctx.eos_id, canvas)
            block = jnp.where(stop, count, block)
        if self.cascade:  # nothing left to decode: the row is done
            ended = out.serve & ~jnp.any(canvas[:, P:] == ctx.mask_id, axis=1)
            block = jnp.where(ended, count, block)
        step_in_block = jnp.where(block_done, 0, state.step_in_block + out.serve)
        return canvas, BlockState(block=block.astype(jnp.int32),
                                  step_in_block=step_in_block.astype(jnp.int32),
                                  policy=pstate)

    @staticmethod
    def _cascade(ctx: Context, canvas, serve):
        """The canvas with every generated position after the first committed
        end-of-text set to end-of-text, in the served rows."""
        P, G = ctx.prompt_len, ctx.gen_length
        gen = canvas[:, P:]
        j = jnp.arange(G)[None, :]
        stop = (gen != ctx.mask_id) & ctx.is_stop(gen)
        first = jnp.min(jnp.where(stop, j, G), axis=-1)  # [b], G: none
        tail = serve[:, None] & (j > first[:, None])
        return canvas.at[:, P:].set(jnp.where(tail, ctx.eos_id, gen))

    def done(self, ctx: Context, canvas, state: BlockState):
        return state.block >= self._block_count(ctx)


@dataclasses.dataclass(frozen=True)
class FixedStepsSchedule(BlockSchedule):
    """A block schedule with a fixed step budget (LLaDA's and Dream's reference
    samplers): `steps` spread evenly over the blocks, every call a full forward.

    Attributes:
      steps: total steps over all blocks (default gen_length); a positive multiple of
        the number of blocks.
    """

    footing_options: ClassVar[tuple[str, ...]] = ("early_stop", "cascade")
    bench_defaults: ClassVar[tuple[str, ...]] = ()
    # A fixed count of commits per step finishes each block in its steps; a gate could
    # leave fewer positions to commit than the count, so these decode ungated.
    gated_commits: ClassVar[bool] = False
    steps: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.steps is None:
            object.__setattr__(self, "steps", self.gen_length)
        if self.cache != "none":
            raise SamplerError(
                f"{self.name}: cache must be 'none' (use fast-dllm for caching)")
        if self.steps <= 0 or self.steps % self.num_blocks:
            raise SamplerError(
                f"{self.name}: steps={self.steps} must be a positive multiple of the number "
                f"of blocks gen_length/block_length={self.num_blocks}")

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def max_iterations(self) -> int:
        return self.steps + 2
