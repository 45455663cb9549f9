"""The diffusion LM in Flax NNX: one module for both LLaDA and Dream.

Both families are pre-norm transformers with RMSNorm, RoPE (rotate-half convention),
bidirectional grouped-query attention and a SwiGLU MLP; they differ in tensor names
(handled by the converter), q/k/v biases, tied heads and Dream's logit shift (applied by
decoding, never here).

Shapes: b batch, T tokens in the canvas, Q queried positions, d model width, H query
heads, K key/value heads, h head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from asynclane_jax.models.config import ModelConfig

_NEG_INF = -1e30


def _param(value, axes) -> nnx.Param:
    """A parameter tagged with logical axis names (see asynclane_jax.sharding).

    Eager sharding is off: placement happens when a mesh is chosen, not at creation.
    """
    return nnx.Param(value, sharding_names=tuple(axes), eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (the transpose of a torch weight)."""

    def __init__(self, d_in: int, d_out: int, axes: tuple, *, bias: bool, cfg: ModelConfig,
                 rngs: nnx.Rngs):
        self.kernel = _param(0.02 * jax.random.normal(rngs.params(), (d_in, d_out),
                                                      cfg.jnp_param_dtype), axes)
        self.bias = (_param(jnp.zeros((d_out,), cfg.jnp_param_dtype), (axes[1],))
                     if bias else None)
        self.dtype = cfg.jnp_dtype

    def __call__(self, x):
        y = jnp.einsum("...i,io->...o", x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, cfg: ModelConfig, rngs: nnx.Rngs):
        del rngs
        self.scale = _param(jnp.ones((dim,), cfg.jnp_param_dtype), ("embed",))
        self.eps = cfg.norm_eps
        self.dtype = cfg.jnp_dtype

    def __call__(self, x):
        # Statistics in float32 as both references do, then cast back.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32.astype(self.dtype) * self.scale[...].astype(self.dtype))


def rope(x, positions, theta: float):
    """Rotary embedding, rotate-half convention (LLaMA / Qwen2 / LLaDA).

    Args:
      x: [b, t, n, h].
      positions: [b, t] integer positions.
      theta: RoPE base.
    Returns:
      x rotated, same shape and dtype.
    """
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [h/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, h/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]  # [b, t, 1, h]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q, k, v, mask, dtype):
    """Grouped-query softmax attention.

    Args:
      q: [b, Q, H, h]; k, v: [b, T, K, h]; mask: [b, Q, T] bool (True = may attend).
    Returns:
      [b, Q, H, h].
    """
    b, nq, n_heads, h = q.shape
    n_kv = k.shape[2]
    g = n_heads // n_kv
    qg = q.reshape(b, nq, n_kv, g, h)
    scores = jnp.einsum("bqkgh,btkh->bkgqt", qg, k).astype(jnp.float32) / jnp.sqrt(
        jnp.float32(h))
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgqt,btkh->bqkgh", probs, v)
    return out.reshape(b, nq, n_heads, h)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, H, K, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(d, H * h, ("embed", "heads"), bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear(d, K * h, ("embed", "kv_heads"), bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear(d, K * h, ("embed", "kv_heads"), bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(H * h, d, ("heads", "embed"), bias=False, cfg=cfg, rngs=rngs)
        self.cfg = cfg

    def qkv(self, x, positions):
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

    def out(self, o):
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, -1))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, m = cfg.d_model, cfg.mlp_hidden
        self.gate_proj = Linear(d, m, ("embed", "mlp"), bias=False, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(d, m, ("embed", "mlp"), bias=False, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(m, d, ("mlp", "embed"), bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.dtype = cfg.jnp_dtype

    def __call__(self, x, positions, mask, cache_kv=None, write_index=None):
        """One block. With cache_kv=(k, v) [b, T, K, h], fresh K/V of the queries are
        scattered at write_index [b, Q] (out-of-range indices are dropped) and the
        queries attend to the whole updated cache."""
        q, k, v = self.attn.qkv(self.attn_norm(x), positions)
        if cache_kv is not None:
            ck, cv = cache_kv
            rows = jnp.arange(x.shape[0])[:, None]
            k = ck.at[rows, write_index].set(k.astype(ck.dtype), mode="drop")
            v = cv.at[rows, write_index].set(v.astype(cv.dtype), mode="drop")
        h = x + self.attn.out(attention(q, k.astype(self.dtype), v.astype(self.dtype), mask,
                                        self.dtype))
        return h + self.mlp(self.mlp_norm(h)), (k, v)


@struct.dataclass
class KVCache:
    """Keys (after RoPE) and values of every canvas position, per layer."""

    k: jax.Array  # [L, b, T, K, h]
    v: jax.Array  # [L, b, T, K, h]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None):
        shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        dt = dtype or cfg.jnp_dtype
        return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


class DiffusionLM(nnx.Module):
    """A LLaDA- or Dream-architecture mask-diffusion language model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(0.02 * jax.random.normal(
            rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.jnp_param_dtype), ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else
                        Linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), bias=False,
                               cfg=cfg, rngs=rngs))

    def _logits(self, x):
        x = self.final_norm(x)
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", x, self.embed[...].astype(x.dtype))
        return self.lm_head(x)

    def __call__(self, tokens, *, positions=None, key_mask=None, attn_mask=None,
                 return_kv: bool = False, logits_index=None):
        """Full forward over the canvas.

        Args:
          tokens: [b, T] int token ids.
          positions: [b, T] RoPE positions; default 0..T-1 (left-padded rows pass their
            own offsets so each row's real tokens start at 0).
          key_mask: [b, T] bool, False for padding keys.
          attn_mask: [b, T, T] bool, extra (query, key) mask, e.g. block-causal for D2F.
          return_kv: also return every layer's K/V as a KVCache.
          logits_index: [b, Q] optional canvas columns; when given, only those rows of
            the output head are computed (a sampler rarely needs all T x V logits).
        Returns:
          logits [b, T, V] (or [b, Q, V]) in float32 (no Dream shift), and the KVCache
          if return_kv.
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.ones((b, t, t), dtype=bool)
        if key_mask is not None:
            mask = mask & key_mask[:, None, :]
        if attn_mask is not None:
            mask = mask & attn_mask
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.jnp_dtype)
        ks, vs = [], []
        for layer in self.layers:
            x, (k, v) = layer(x, positions, mask)
            if return_kv:
                ks.append(k)
                vs.append(v)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        logits = self._logits(x).astype(jnp.float32)
        if return_kv:
            return logits, KVCache(jnp.stack(ks), jnp.stack(vs))
        return logits

    def forward_cached(self, tokens, positions, write_index, cache: KVCache, *, key_mask=None,
                       attn_mask=None):
        """Logits for a set of query positions against a K/V cache of the whole canvas.

        The queries' fresh K/V are written into the cache first (so queries see each
        other's current values, as in Fast-dLLM's dual cache), then each query attends
        to all T cached positions.

        Args:
          tokens: [b, Q] token ids at the queried positions.
          positions: [b, Q] RoPE positions of the queries.
          write_index: [b, Q] canvas index of each query; an index >= T marks an unused
            query slot whose K/V is dropped.
          cache: KVCache with arrays [L, b, T, K, h].
          key_mask: [b, T] bool, False for keys that must not be attended (padding).
          attn_mask: [b, Q, T] bool, extra (query, key) mask.
        Returns:
          (logits [b, Q, V] float32, updated KVCache).
        """
        b, nq = tokens.shape
        t = cache.k.shape[2]
        mask = jnp.ones((b, nq, t), dtype=bool)
        if key_mask is not None:
            mask = mask & key_mask[:, None, :]
        if attn_mask is not None:
            mask = mask & attn_mask
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.jnp_dtype)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, (k, v) = layer(x, positions, mask, cache_kv=(cache.k[i], cache.v[i]),
                              write_index=write_index)
            ks.append(k)
            vs.append(v)
        logits = self._logits(x).astype(jnp.float32)
        return logits, KVCache(jnp.stack(ks), jnp.stack(vs))


def init_model(cfg: ModelConfig, seed: int = 0) -> DiffusionLM:
    """A randomly initialised model."""
    return DiffusionLM(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> DiffusionLM:
    """The model with jax.ShapeDtypeStruct leaves: no memory allocated."""
    return nnx.eval_shape(lambda: DiffusionLM(cfg, rngs=nnx.Rngs(0)))


def param_stats(cfg: ModelConfig) -> dict:
    """Parameter count, tensor count and sizes, computed abstractly."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    leaves = jax.tree_util.tree_leaves(state)
    n = sum(math.prod(x.shape) for x in leaves)
    return {"params": int(n), "tensors": len(leaves), "bytes_bf16": int(n) * 2,
            "bytes_f32": int(n) * 4}


__all__ = ["DiffusionLM", "KVCache", "init_model", "abstract_model", "param_stats", "rope",
           "attention"]
