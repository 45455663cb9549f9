"""Autoregressive decoding: the causal baseline, greedy, one position per call.

A causal LM (`ModelConfig.causal`: trained with a next-token loss and causal attention
over the whole canvas) is decoded left to right with a K/V cache, by the same driver,
model, converter format, bench and serving path as the diffusion samplers:

  1. the first call (`first_plan`) is a cached call over the prompt's P columns: their
     K/V fill the cache, and the output at column P - 1 predicts generated position 0;
  2. each later call queries one column, the token committed last (column P + j - 1),
     writes its K/V and predicts position j from the output there;
  3. each call commits the argmax (never the mask token); an end-of-text token ends the
     row at once and every later position becomes end-of-text, as the cascade of the
     diffusion samplers does.

Causal attention is the block-causal path with blocks of one column: every column's
block id is its own index, so a query sees the keys at and before its column, the
prompt's included (left padding is outside the key mask). A causal model's output at
column c predicts c + 1: the config says so with `logit_shift` (the driver's one logit
shift; `causal` requires it), and the schedule queries c - 1 to read column c.

A row of G generated positions costs at most G calls: the prompt's, then G - 1 of one
query; fewer when it ends with an end-of-text. A bidirectional (diffusion) model is
refused in `bind`: its weights were not trained to read a causal canvas.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding.ops import never_the_mask
from asynclane_jax.decoding.schedule import CallOutput, Context, Plan, SamplerError, Schedule


@struct.dataclass
class ArState:
    pos: jax.Array  # [b] int32 generated positions committed (the next one to decode)
    ended: jax.Array  # [b] bool: an end-of-text was committed


@dataclasses.dataclass(frozen=True)
class ArSchedule(Schedule):
    """Greedy autoregressive decoding of a causal model, one position per call with a
    K/V cache (no options beyond gen_length)."""

    name = "ar"

    def bind(self, tokenizer, cfg) -> ArSchedule:
        del tokenizer
        if not getattr(cfg, "causal", False):
            raise SamplerError("ar: this model is not causal (its config has causal false): "
                               "ar decodes an autoregressive model left to right; a "
                               "diffusion model needs a diffusion sampler")
        if not cfg.logit_shift:  # the config refuses this too (ModelConfig.causal)
            raise SamplerError("ar: a causal model needs logit_shift true (the output at "
                               "column c predicts c + 1)")
        return self

    @property
    def uses_cache(self) -> bool:
        return True

    def attention_blocks(self, ctx: Context):
        # Blocks of one: column c sees keys at columns <= c (the prompt causal too).
        cols = jnp.arange(ctx.length, dtype=jnp.int32)
        return jnp.broadcast_to(cols, (ctx.batch, ctx.length))

    def max_iterations(self) -> int:
        return self.gen_length  # the prompt's call and G - 1 of one query

    def init(self, ctx: Context) -> ArState:
        if ctx.shift != 1:
            raise SamplerError("ar: the model's config has no logit shift; a causal "
                               "model's output at column c predicts c + 1")
        return ArState(pos=jnp.zeros((ctx.batch,), jnp.int32),
                       ended=jnp.zeros((ctx.batch,), bool))

    def first_plan(self, ctx: Context, canvas, state, live) -> Plan:
        # The prompt's columns (left padding included, outside the key mask), one cached
        # call; logits are read only at its last column, which predicts column P.
        P, b = ctx.prompt_len, ctx.batch
        cols = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (b, P))
        read = jnp.full((b, 1), P - 1, jnp.int32)
        return Plan(positions=cols, full=jnp.asarray(False), serve=live, logits_at=read)

    def plan(self, ctx: Context, canvas, state: ArState, live) -> Plan:
        # The column committed last; its output predicts the next position.
        col = ctx.prompt_len + state.pos - ctx.shift
        return Plan(positions=col[:, None], full=jnp.asarray(False), serve=live)

    def update(self, ctx: Context, canvas, state: ArState, out: CallOutput, key):
        del key
        P, G, T = ctx.prompt_len, ctx.gen_length, ctx.length
        target = P + state.pos  # [b] the column decoded now
        logits, has = out.at(target[:, None])
        x0 = never_the_mask(logits, jnp.argmax(logits, axis=-1).astype(jnp.int32),
                            ctx.mask_id)[:, 0]
        commit = out.serve & has[:, 0] & (state.pos < G) & ~state.ended
        rows = jnp.arange(canvas.shape[0])
        canvas = canvas.at[rows, jnp.where(commit, target, T)].set(x0, mode="drop")
        stop = commit & ctx.is_stop(x0)
        # An end-of-text ends the row: every later position is end-of-text.
        later = jnp.arange(T, dtype=jnp.int32)[None, :] > target[:, None]
        canvas = jnp.where(stop[:, None] & later, ctx.eos_id, canvas)
        return canvas, ArState(pos=state.pos + commit.astype(jnp.int32),
                               ended=state.ended | stop)

    def done(self, ctx: Context, canvas, state: ArState):
        return state.ended | (state.pos >= self.gen_length)
