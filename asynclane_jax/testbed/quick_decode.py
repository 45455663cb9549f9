"""A small jitted vanilla decoder used to monitor training.

LLaDA's low-confidence remasking, greedy, one token per step, semi-autoregressive blocks:
step s may only commit inside block s // block_length. It deliberately has none of the
decode loop's features (samplers, caches, lanes); evaluation of shipped models goes
through `asynclane_jax.decoding.generate`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def pad_prompts(prompts, pad_id: int, length: int | None = None):
    """Left-pads prompts to one length.

    Returns:
      tokens [b, P] int32, key_mask [b, P] bool (False on padding), positions [b, P]
      int32 (each row's first real token at 0).
    """
    length = length or max(len(p) for p in prompts)
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    key_mask = np.zeros((b, length), bool)
    for i, p in enumerate(prompts):
        if len(p) > length:
            raise ValueError(f"prompt {i} has {len(p)} tokens; longer than {length}")
        tokens[i, length - len(p):] = p
        key_mask[i, length - len(p):] = True
    positions = np.maximum(np.cumsum(key_mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, key_mask, positions


def shift_logits(logits):
    """Dream's convention: the token at position i is read from the output at i - 1."""
    return jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "gen_length", "block_length"))
def _decode(graphdef, state, canvas, key_mask, positions, *, gen_length, block_length):
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    total = canvas.shape[1]
    start = total - gen_length
    index = jnp.arange(total)

    def step(s, canvas):
        logits = model(canvas, positions=positions, key_mask=key_mask)
        if cfg.logit_shift:
            logits = shift_logits(logits)
        probs = jax.nn.softmax(logits, axis=-1)
        x0 = jnp.argmax(logits, axis=-1).astype(canvas.dtype)  # [b, T]
        p0 = jnp.max(probs, axis=-1)  # [b, T]
        block = s // block_length
        lo = start + block * block_length
        in_block = (index >= lo) & (index < lo + block_length)
        candidate = (canvas == cfg.mask_token_id) & in_block[None, :]
        conf = jnp.where(candidate, p0, -jnp.inf)
        pick = jnp.argmax(conf, axis=-1)  # [b]
        rows = jnp.arange(canvas.shape[0])
        ok = candidate[rows, pick]
        new = jnp.where(ok, x0[rows, pick], canvas[rows, pick])
        return canvas.at[rows, pick].set(new)

    canvas = jax.lax.fori_loop(0, gen_length, step, canvas)
    return canvas[:, start:]


def vanilla_decode(model, prompts, *, gen_length: int, block_length: int = 32,
                   prompt_length: int | None = None) -> np.ndarray:
    """Greedy low-confidence decoding, one token per step.

    Args:
      model: a DiffusionLM.
      prompts: list of token-id lists.
      gen_length: generated tokens (a multiple of block_length).
      block_length: semi-autoregressive block size.
      prompt_length: pad prompts to this length (fixed shapes avoid recompiles).
    Returns:
      [b, gen_length] int32 generated tokens.
    """
    cfg = model.cfg
    if gen_length % block_length:
        raise ValueError(f"gen_length={gen_length} is not a multiple of "
                         f"block_length={block_length}")
    tokens, key_mask, positions = pad_prompts(prompts, cfg.pad_token_id, prompt_length)
    b = tokens.shape[0]
    canvas = np.concatenate([tokens, np.full((b, gen_length), cfg.mask_token_id, np.int32)], 1)
    key_mask = np.concatenate([key_mask, np.ones((b, gen_length), bool)], 1)
    gen_pos = positions[:, -1:] + 1 + np.arange(gen_length, dtype=np.int32)[None]
    positions = np.concatenate([positions, gen_pos], 1)
    graphdef, state = nnx.split(model)
    out = _decode(graphdef, state, jnp.asarray(canvas), jnp.asarray(key_mask),
                  jnp.asarray(positions), gen_length=gen_length, block_length=block_length)
    return np.asarray(out)
