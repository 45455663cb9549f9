"""The one decode driver: a single jitted lax.while_loop with a fixed-shape carry.

Every sampler is a policy (policy.py). One iteration:
  1. Choose the call. Without a cache every iteration is a full forward serving every
     unfinished row. With a cache, a row entering a block needs a refresh (a full
     forward whose K/V become its cache and whose logits decode that step, as in
     Fast-dLLM, so no call is wasted). Refreshes are batched, as in the public batched
     code: once every unfinished row has entered a new block, one full forward serves
     them all; until then rows that have entered one wait, and a cached call serves the
     others: the block (dual cache) or [block start, T) (prefix cache). A waiting row's
     canvas is frozen, so each row decodes exactly as it would alone.
  2. The policy picks commits inside each served row's current block.
  3. A row whose block has no masks left moves to the next block; after the last
     block it is finished and never changes again.

Index conventions: the canvas is [b, T] with T = P + G; generated position j of every
row is canvas column P + j; block i covers generated positions [i*B, (i+1)*B).

Dream's logit shift (the logits for column c come from the output at c - 1) follows
Fast-dLLM's Dream block decoding (generation_utils_block.py): a full forward reads the
output at c - 1 for every block column; a cached call queries the same window as for
LLaDA ([s, s + B) dual, [s, T) prefix) and shifts inside it, so column s would read its
own output; that is harmless because for policies with `shift_commits_block_start` the
block-start step (always a full forward's logits) commits exactly column s, by argmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from asynclane_jax.decoding.policy import BlockPolicy
from asynclane_jax.decoding.state import DecodeState
from asynclane_jax.models.model import KVCache

# Incremented each time the loop is traced (= compiled); tests read it.
TRACE_COUNT = {"decode": 0}


def _rows(b):
    return jnp.arange(b)[:, None]


def _block_columns(state, policy, prompt_len, offset=0):
    """[b, B] canvas columns of each row's current block (clipped for finished rows)."""
    B = policy.block_length
    start = prompt_len + jnp.minimum(state.block, policy.num_blocks - 1) * B
    return start[:, None] + jnp.arange(B)[None, :] - offset


def _full_forward(model, canvas, positions, key_mask, logits_index, prompt_len, cfg_scale,
                  mask_id, want_cache):
    """Full forward over the canvas, logits only at logits_index [b, B]; with LLaDA's
    classifier-free guidance when cfg_scale > 0."""
    if cfg_scale > 0:
        # Unconditional copy: the prompt replaced by masks (LLaDA generate.py).
        cols = jnp.arange(canvas.shape[1])[None, :]
        uncond = jnp.where(cols < prompt_len, mask_id, canvas)
        both = jnp.concatenate([canvas, uncond], axis=0)
        two = lambda a: jnp.concatenate([a, a], axis=0)
        logits = model(both, positions=two(positions), key_mask=two(key_mask),
                       logits_index=two(logits_index))
        cond, unc = jnp.split(logits, 2, axis=0)
        return unc + (cfg_scale + 1.0) * (cond - unc), None
    out = model(canvas, positions=positions, key_mask=key_mask, return_kv=want_cache,
                logits_index=logits_index)
    return out if want_cache else (out, None)


def build_loop(graphdef, params, canvas, pad_len, rng, *, policy: BlockPolicy,
               cfg_scale: float = 0.0):
    """The loop's pieces: (initial DecodeState, body(state) -> state, cond(state) -> bool).

    `decode_loop` runs them in lax.while_loop; experiments drive `body` from a Python
    loop to measure what the while_loop saves.

    Args:
      graphdef, params: the split NNX model.
      canvas: [b, T] int32, prompts left-padded to P = T - G, then G mask ids.
      pad_len: [b] int32 left padding of each row.
      rng: PRNG key.
      policy: the sampler policy (static).
      cfg_scale: classifier-free guidance scale (static; full forwards only).
    Returns:
      (state, body, cond).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, T = canvas.shape
    G, B = policy.gen_length, policy.block_length
    P = T - G
    shift = 1 if cfg.logit_shift else 0
    cols = jnp.arange(T, dtype=jnp.int32)[None, :]
    key_mask = cols >= pad_len[:, None]  # [b, T]
    positions = jnp.maximum(cols - pad_len[:, None], 0)  # [b, T] each row starts at 0
    use_cache = policy.cache != "none"
    mask_id = cfg.mask_token_id

    # Cached-call query window, per row: Q columns starting at the block start.
    Q = B if policy.cache == "dual" else G  # prefix: the block start to the canvas end
    block_start_rule = bool(shift) and policy.shift_commits_block_start

    state = DecodeState(
        canvas=canvas,
        commit_step=jnp.full((b, G), -1, jnp.int32),
        block=jnp.zeros((b,), jnp.int32),
        step_in_block=jnp.zeros((b,), jnp.int32),
        row_steps=jnp.zeros((b,), jnp.int32),
        row_full=jnp.zeros((b,), jnp.int32),
        row_partial=jnp.zeros((b,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        nfe_full=jnp.zeros((), jnp.int32),
        nfe_partial=jnp.zeros((), jnp.int32),
        tokens_processed=jnp.zeros((), jnp.int32),
        rng=rng,
        cache=KVCache.zeros(cfg, b, T) if use_cache else None,
        policy_state=policy.init_state(b),
    )
    max_iter = policy.max_iterations()

    def full_call(st, serve):
        # The output at column c - shift predicts column c of the current block.
        logits_index = _block_columns(st, policy, P, offset=shift)  # [b, B]
        logits, kv = _full_forward(model, st.canvas, positions, key_mask, logits_index, P,
                                   cfg_scale, mask_id, use_cache)
        cache = st.cache
        if use_cache:
            keep = serve[None, :, None, None, None]
            cache = KVCache(jnp.where(keep, kv.k.astype(cache.k.dtype), cache.k),
                            jnp.where(keep, kv.v.astype(cache.v.dtype), cache.v))
        st = st.replace(cache=cache, nfe_full=st.nfe_full + 1,
                        tokens_processed=st.tokens_processed + b * T,
                        row_full=st.row_full + serve)
        return logits, st

    def partial_call(st, serve):
        start = P + jnp.minimum(st.block, policy.num_blocks - 1) * B  # [b]
        write_index = start[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :]  # [b, Q]
        valid = write_index < T
        write_index = jnp.where(valid, write_index, T)  # T: dropped by the scatter
        gather = jnp.minimum(write_index, T - 1)
        tokens_q = jnp.take_along_axis(st.canvas, gather, axis=1)
        pos_q = jnp.maximum(gather - pad_len[:, None], 0)
        logits, cache = model.forward_cached(tokens_q, pos_q, write_index, st.cache,
                                             key_mask=key_mask)
        n_valid = jnp.sum(valid & serve[:, None])
        st = st.replace(cache=cache, nfe_partial=st.nfe_partial + 1,
                        tokens_processed=st.tokens_processed + n_valid.astype(jnp.int32),
                        row_partial=st.row_partial + serve)
        if shift:  # shift inside the window; column s reads its own output (unused)
            logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
        return logits[:, :B], st

    def body(st: DecodeState) -> DecodeState:
        active = st.block < policy.num_blocks  # [b]
        if use_cache:
            # Refreshes are batched: a row entering a new block waits until every
            # unfinished row has entered one, then a single full forward refreshes them
            # all. Waiting changes nothing for the row (its canvas is frozen meanwhile),
            # so each row still decodes exactly as it would alone.
            need = active & (st.step_in_block == 0)
            refresh = jnp.all(need | ~active)
            logits, st = jax.lax.cond(
                refresh,
                lambda s: full_call(s, need),
                lambda s: partial_call(s, active & ~need),
                st)
            serve = jnp.where(refresh, need, active & ~need)
        else:
            serve = active
            logits, st = full_call(st, serve)

        cols_blk = _block_columns(st, policy, P)  # [b, B]
        blk_tokens = jnp.take_along_axis(st.canvas, cols_blk, axis=1)
        masked = (blk_tokens == mask_id) & serve[:, None]
        key = jax.random.fold_in(st.rng, st.step)
        commit, x0, pstate = policy.select(logits, masked, st.step_in_block, key,
                                           st.policy_state)
        if block_start_rule:
            at_start = (st.step_in_block == 0)[:, None]
            first_col = jnp.arange(B)[None, :] == 0
            x0 = jnp.where(at_start & first_col, jnp.argmax(logits, -1).astype(x0.dtype), x0)
            commit = jnp.where(at_start, first_col, commit)
        # The mask token is never committed: that would leave the position masked for
        # ever (the public samplers would commit it). A position whose prediction is the
        # mask token takes its best other token. A trained model gives the mask token no
        # mass, so this only matters for untrained weights; confidences are untouched.
        best_other = jnp.argmax(logits.at[..., mask_id].set(-jnp.inf), -1).astype(x0.dtype)
        x0 = jnp.where(x0 == mask_id, best_other, x0)
        commit = commit & masked
        new_blk = jnp.where(commit, x0, blk_tokens)
        canvas = st.canvas.at[_rows(b), cols_blk].set(new_blk)
        gen_idx = cols_blk - P
        old_cs = jnp.take_along_axis(st.commit_step, gen_idx, axis=1)
        cs = jnp.where(commit, st.row_steps[:, None], old_cs)
        commit_step = st.commit_step.at[_rows(b), gen_idx].set(cs)

        block_done = serve & ~jnp.any(new_blk == mask_id, axis=1)
        block = st.block + block_done
        step_in_block = jnp.where(block_done, 0, st.step_in_block + serve)
        return st.replace(
            canvas=canvas, commit_step=commit_step, block=block.astype(jnp.int32),
            step_in_block=step_in_block.astype(jnp.int32),
            row_steps=st.row_steps + serve, step=st.step + 1, policy_state=pstate)

    def cond(st: DecodeState):
        return jnp.any(st.block < policy.num_blocks) & (st.step < max_iter)

    return state, body, cond


def decode_loop(graphdef, params, canvas, pad_len, rng, *, policy: BlockPolicy,
                cfg_scale: float = 0.0) -> DecodeState:
    """Runs a policy to completion in one lax.while_loop (arguments as build_loop).

    Returns:
      The final DecodeState.
    """
    TRACE_COUNT["decode"] += 1
    state, body, cond = build_loop(graphdef, params, canvas, pad_len, rng, policy=policy,
                                   cfg_scale=cfg_scale)
    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "cfg_scale"))
def decode_jit(graphdef, params, canvas, pad_len, rng, *, policy, cfg_scale=0.0):
    state = decode_loop(graphdef, params, canvas, pad_len, rng, policy=policy,
                        cfg_scale=cfg_scale)
    # The cache is large and not needed by the caller.
    return state.replace(cache=None)
