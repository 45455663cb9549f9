"""Array operations shared by the sampler policies (all fixed-shape, jit-friendly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asynclane_jax.decoding.schedule import SamplerError

NEG_INF = -jnp.inf


def check_threshold(name: str, value: float, field: str = "threshold"):
    """Raises SamplerError unless 0 < value <= 1 (a probability threshold)."""
    if not 0 < value <= 1:
        raise SamplerError(f"{name}: {field}={value} must be in (0, 1]")


def never_the_mask(logits, x0, mask_id):
    """The mask token is never committed: that would leave the position masked for
    ever (the public samplers would commit it). A position whose prediction is the mask
    token takes its best other token. A trained model gives the mask token no mass, so
    this only matters for untrained weights; confidences are untouched."""
    best_other = jnp.argmax(logits.at[..., mask_id].set(-jnp.inf), -1).astype(x0.dtype)
    return jnp.where(x0 == mask_id, best_other, x0)


def greedy_confidence(logits):
    """argmax token and its softmax probability; [b, n, V] -> ([b, n] int32, [b, n] f32)."""
    x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)
    conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    return x0, conf


def topk_mask(conf, k):
    """Per-row top-k as a mask, with a different k in each row.

    Args:
      conf: [b, n] scores; -inf entries are never selected.
      k: [b] how many to select per row.
    Returns:
      [b, n] bool, True for the k highest finite scores of each row (ties go to the
      lower index, as a stable sort orders them).
    """
    order = jnp.argsort(-conf, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1, stable=True)
    return (ranks < k[:, None]) & jnp.isfinite(conf)


def rank_of(conf):
    """Rank (0 = highest) of each entry of each row; ties go to the lower index."""
    order = jnp.argsort(-conf, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def near_anchor(anchor, radius: int):
    """[b, n] bool: positions within `radius` of any True position of anchor [b, n]
    (LocalLeap's neighbourhood)."""
    idx = jnp.arange(anchor.shape[-1])
    near = jnp.abs(idx[:, None] - idx[None, :]) <= radius  # [n, n]
    return jnp.any(anchor[:, None, :] & near[None, :, :], axis=-1)


def gumbel_argmax(logits, temperature, key):
    """LLaDA's Gumbel-max sampling, argmax(exp(l) / (-log u)^T), computed in log space.

    The reference evaluates exp(logits) in float64; in float32 exp overflows for logits
    above ~88. Taking logs gives the same argmax without overflow:
    argmax(l - T * log(-log u)). With T = 0 this is exactly argmax(l).
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    u = jax.random.uniform(key, logits.shape, jnp.float32, minval=1e-20, maxval=1.0)
    return jnp.argmax(logits - temperature * jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)


def gather_last(x, idx):
    """x[..., idx] for integer idx of shape x.shape[:-1]."""
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def top_p_filter(logits, top_p):
    """Keeps the smallest set of tokens whose probability mass reaches top_p."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # A token is removed when the mass before it already exceeds top_p (the first token
    # is always kept).
    remove_sorted = (cum - probs) > top_p
    cutoff = jnp.where(remove_sorted, jnp.inf, sorted_logits).min(axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def top_k_filter(logits, top_k):
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)
