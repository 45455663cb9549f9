"""LLaDA2.0's block-diffusion sampler (inclusionAI LLaDA2.0, `generate` of the published
modelling code), on the K/V cache its block-causal attention makes exact.

The published loop, restated (greedy):

  * Blocks are laid out from the row's first prompt token: block k holds the row's
    positions [k*B, (k+1)*B), so the prompt's last block also holds the first generated
    positions. Attention is block-causal: a position sees its own block and every
    earlier one, never a later one.
  * Decoding starts at the block holding the first generated position (k = P_row // B)
    and goes block by block. A block gets at most `steps_eff` = min(steps,
    gen_length // minimal_topk) steps and ends early once it has no masks.
  * Step i of a block: every masked position of the block predicts its argmax token,
    with the softmax probability of that token as its confidence. With
    n_i = B // steps_eff, plus one for the first B % steps_eff steps: when at least
    n_i masked positions are above `threshold` (strictly), all of those commit; else the
    min(n_i, masks left) most confident do (ties to the lower position).
  * After a block, a row whose generated part so far holds an end-of-text stops;
    its answer ends at its first end-of-text. With `eos_early_stop`, a step that commits
    an end-of-text stops the row at once when no mask is left before the first
    end-of-text of its generated part.

LLaDA2.1's token editing (`editing_threshold` set; None is LLaDA2.0), as the public
ports of its generate code describe it (the authors' own 2.1 code was not read here): in
every call on a block, a decoded, non-prompt position of the block whose argmax differs
from its token, with probability above `editing_threshold` (strictly), takes the argmax,
alongside the mask commits above. Once the block has no masks, up to `max_post_steps`
more calls are made on it; the block ends after the first of them that edits nothing.
The step counter of the top-k counts advances only on calls that found masks. The
end-of-text stop after a block is LLaDA2.0's (one public port applies it only with
eos_early_stop). The model card's modes, as its public copies give them: quality
threshold=0.7 editing_threshold=0.5 max_post_steps=16; speed threshold=0.5
editing_threshold=0.0 max_post_steps=16 (block_length=32, steps=32 in both).

Here: the row's answer keeps its tokens up to its first end-of-text; every later
position becomes end-of-text (the published code returns the answer cut there).

Calls. The first call for a row is a full forward (its prompt's K/V join the cache);
its logits decode the row's first step. Every later call is a cached call of 2B queries:
the current block, and, at a block's first step, the block before it, re-encoded once
with its final tokens. With block-causal attention a finished block's K/V then never
change: the cache is exact, and the queries attend to it, never to a later block. (The
K/V of later blocks in the cache, from the first full forward, are invisible to every
query until their block is queried.)

Block-causal attention is imposed whatever the model config says (LLaDA2 is trained
block-causal; on another model this is a different sampler, not the model's own).

The canvas ends at P + gen_length. When the row's last block runs past it (P_row +
gen_length not a multiple of B), its positions past the canvas do not exist here: the
published loop decodes the whole block (masks past gen_length that the block's other
positions attend to) and cuts the answer afterwards. The two then differ in that last
block; they decode alike when P_row + gen_length is a multiple of B.

`threshold` is a traced option (schedule.py: `traced_options`).
"""

from __future__ import annotations

import dataclasses

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
    llada2_attention_blocks,
)


@struct.dataclass
class LLaDA2State:
    block: jax.Array  # [b] int32 the row's current block (row positions from 0)
    step: jax.Array  # [b] int32 steps spent on that block
    post: jax.Array  # [b] int32 calls made on the block after its last mask went (2.1)
    fresh: jax.Array  # [b] bool: not encoded yet (its first call is a full forward)
    ended: jax.Array  # [b] bool


@dataclasses.dataclass(frozen=True)
class LLaDA2Schedule(Schedule):
    """LLaDA2.0 block diffusion: threshold within the block, else the step's top-k.

    Attributes:
      block_length: B, positions per block; blocks are laid out from the row's first
        prompt token, so the prompt's last block holds the first generated positions.
      steps: steps per block at most; the per-step top-k counts split B over them.
      threshold: masked positions above this confidence (strictly) commit when at least
        the step's top-k count of them are; else the top-k most confident commit.
      minimal_topk: caps the steps at gen_length // minimal_topk, as published.
      eos_early_stop: a step that commits an end-of-text ends the row when no mask is
        left before its first end-of-text (as published; off by default).
      editing_threshold: LLaDA2.1's token editing (None: off, LLaDA2.0): a decoded,
        non-prompt position of the current block whose new argmax differs from its token
        and has probability above this is replaced, in every call on the block.
      max_post_steps: with editing, calls on a block after its last mask went, at most
        (the block ends sooner after a call that edits nothing).
    """

    name = "llada2"
    traced_options = ("threshold",)
    compact_full = True
    block_length: int = 32
    steps: int = 32
    threshold: float = 0.95
    minimal_topk: int = 1
    eos_early_stop: bool = False
    editing_threshold: float | None = None
    max_post_steps: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.block_length <= 0:
            raise SamplerError(f"{self.name}: block_length={self.block_length} must be "
                               "positive")
        if self.steps <= 0:
            raise SamplerError(f"{self.name}: steps={self.steps} must be positive")
        if not 1 <= self.minimal_topk <= self.gen_length:
            raise SamplerError(f"{self.name}: minimal_topk={self.minimal_topk} must be in "
                               f"[1, gen_length={self.gen_length}]")
        ops.check_threshold(self.name, self.threshold)
        if self.eos_early_stop not in (True, False):
            raise SamplerError(f"{self.name}: eos_early_stop={self.eos_early_stop!r} must "
                               "be true or false")
        object.__setattr__(self, "eos_early_stop", bool(self.eos_early_stop))
        if self.editing_threshold is not None and not 0 <= self.editing_threshold <= 1:
            raise SamplerError(f"{self.name}: editing_threshold={self.editing_threshold} "
                               "must be in [0, 1] (or None: no editing)")
        if self.max_post_steps < 0:
            raise SamplerError(f"{self.name}: max_post_steps={self.max_post_steps} must be "
                               ">= 0")

    @property
    def steps_per_block(self) -> int:
        """The published steps_eff: min(steps, gen_length // minimal_topk)."""
        return min(self.steps, self.gen_length // self.minimal_topk)

    def transfer_counts(self):
        """[steps_per_block] int32: the top-k count of each step of a block."""
        s = self.steps_per_block
        base, rem = divmod(self.block_length, s)
        return jnp.asarray([base + (i < rem) for i in range(s)], jnp.int32)

    @property
    def uses_cache(self) -> bool:
        return True

    def attention_blocks(self, ctx: Context):
        return llada2_attention_blocks(ctx, self.block_length)

    def max_iterations(self) -> int:
        # A row has at most G // B + 2 blocks of at most steps_per_block steps; it waits
        # at most one iteration for another row's first full forward each time rows are
        # admitted (twice the bound covers it).
        blocks = self.gen_length // self.block_length + 2
        post = self.max_post_steps if self.editing_threshold is not None else 0
        return 2 * blocks * (self.steps_per_block + post) + 2

    def init(self, ctx: Context) -> LLaDA2State:
        b = ctx.batch
        prompt_row = ctx.prompt_len - ctx.pad_len
        return LLaDA2State(block=(prompt_row // self.block_length).astype(jnp.int32),
                           step=jnp.zeros((b,), jnp.int32), post=jnp.zeros((b,), jnp.int32),
                           fresh=jnp.ones((b,), bool),
                           ended=jnp.zeros((b,), bool))

    def _columns(self, ctx: Context, block):
        """[b, B] canvas columns of each row's block `block` (may reach T or beyond)."""
        B = self.block_length
        start = ctx.pad_len + block * B
        return start[:, None] + jnp.arange(B, dtype=jnp.int32)[None, :]

    def plan(self, ctx: Context, canvas, state: LLaDA2State, live) -> Plan:
        T, B = ctx.length, self.block_length
        cur = self._columns(ctx, state.block)
        prev = cur - B
        keep_prev = ((state.step == 0)[:, None] & (prev >= ctx.pad_len[:, None]))
        cols = jnp.concatenate([jnp.where(keep_prev, prev, T), cur], axis=1)
        cols = jnp.where((cols >= 0) & (cols < T), cols, T)
        refresh = jnp.any(live & state.fresh)
        read = jnp.broadcast_to(jnp.arange(B, 2 * B, dtype=jnp.int32), (ctx.batch, B))
        return Plan(positions=cols, full=refresh,
                    serve=jnp.where(refresh, live & state.fresh, live & ~state.fresh),
                    logits_at=read)

    def update(self, ctx: Context, canvas, state: LLaDA2State, out: CallOutput, key):
        del key
        b, T, P, B = ctx.batch, ctx.length, ctx.prompt_len, self.block_length
        serve = out.serve
        rows = jnp.arange(b)[:, None]
        cols = self._columns(ctx, state.block)
        valid = cols < T
        safe = jnp.minimum(cols, T - 1)
        logits, has = out.at(jnp.where(valid, cols, T))
        blk = jnp.take_along_axis(canvas, safe, axis=1)
        was_masked = valid & (blk == ctx.mask_id)
        masks_before = jnp.any(was_masked, axis=-1)
        masked = was_masked & has & serve[:, None]
        x0, conf = ops.greedy_confidence(logits)
        x0 = ops.never_the_mask(logits, x0, ctx.mask_id)

        counts = self.transfer_counts()
        k = counts[jnp.minimum(state.step, counts.shape[0] - 1)]
        n_masked = jnp.sum(masked, axis=-1)
        high = masked & (conf > self.row_option(ctx, "threshold")[:, None])
        topk = ops.topk_mask(jnp.where(masked, conf, ops.NEG_INF), jnp.minimum(k, n_masked))
        commit = jnp.where((jnp.sum(high, axis=-1) >= k)[:, None], high, topk) & masked
        if self.editing_threshold is None:
            edit = jnp.zeros_like(commit)
        else:  # 2.1: decoded, non-prompt positions whose confident prediction differs
            edit = (valid & has & serve[:, None] & ~was_masked & (cols >= P)
                    & (conf > self.editing_threshold) & (x0 != blk))
        commit = commit | edit
        canvas = canvas.at[rows, jnp.where(commit, cols, T)].set(x0, mode="drop")

        # The block's end: no mask left (after max_post_steps more calls with editing,
        # or the first that edits nothing), or its steps spent.
        step = state.step + masks_before
        new_blk = jnp.take_along_axis(canvas, safe, axis=1)
        left = jnp.any(valid & (new_blk == ctx.mask_id), axis=-1)
        post = state.post + ~masks_before
        if self.editing_threshold is None:
            block_end = serve & (~left | (step >= self.steps_per_block))
        else:
            no_edit = ~masks_before & ~jnp.any(edit, axis=-1)
            # The next call would be post-step post + 1 (when no mask is left).
            block_end = serve & (no_edit | (~left & (post + 1 > self.max_post_steps))
                                 | (left & (step >= self.steps_per_block)))
        gen = canvas[:, P:]
        j = jnp.arange(ctx.gen_length)[None, :]
        is_eos = (gen == ctx.eos_id)
        first_eos = jnp.min(jnp.where(is_eos, j, ctx.gen_length), axis=-1)  # G: none
        end_col = ctx.pad_len + (state.block + 1) * B  # one past the block
        eos_so_far = jnp.any(is_eos & (j + P < end_col[:, None]), axis=-1)
        ended = block_end & (eos_so_far | (end_col >= T))
        if self.eos_early_stop:
            committed_eos = jnp.any(commit & (x0 == ctx.eos_id), axis=-1)
            mask_before = jnp.any((gen == ctx.mask_id) & (j < first_eos[:, None]), axis=-1)
            ended = ended | (serve & committed_eos & (first_eos < ctx.gen_length)
                             & ~mask_before)
        tail = ended[:, None] & (j > first_eos[:, None])
        canvas = canvas.at[:, P:].set(jnp.where(tail, ctx.eos_id, gen))

        block = jnp.where(block_end & ~ended, state.block + 1, state.block)
        step = jnp.where(block_end, 0, jnp.where(serve, step, state.step))
        post = jnp.where(block_end, 0, jnp.where(serve, post, state.post))
        return canvas, LLaDA2State(block=block.astype(jnp.int32), step=step.astype(jnp.int32),
                                   post=post.astype(jnp.int32), fresh=state.fresh & ~serve,
                                   ended=state.ended | ended)

    def done(self, ctx: Context, canvas, state: LLaDA2State):
        return state.ended
