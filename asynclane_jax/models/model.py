"""The diffusion LM in Flax NNX: one module for LLaDA, Dream and LLaDA2 (mixture of
experts; its differences are listed in docs/llada2.md).

Both families are pre-norm transformers with RMSNorm, RoPE (rotate-half convention),
bidirectional grouped-query attention and a SwiGLU MLP; they differ in tensor names
(handled by the converter), q/k/v biases, tied heads and Dream's logit shift (applied by
decoding, never here).

Shapes: b batch, T tokens in the canvas, Q queried positions, d model width, H query
heads, K key/value heads, h head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
import math
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from asynclane_jax import sharding
from asynclane_jax.models import moe, quantize
from asynclane_jax.models.config import ModelConfig


def _param(value, axes) -> nnx.Param:
    """A parameter tagged with logical axis names (see asynclane_jax.sharding).

    Eager sharding is off: placement happens when a mesh is chosen, not at creation.
    """
    return nnx.Param(value, sharding_names=tuple(axes), eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (the transpose of a torch weight).

    After `quantize_int8` (asynclane_jax.models.quantize) the kernel holds int8 values
    and `scale` their per-output-channel scales [1, out] (float32): kernel ~ values *
    scale, multiplied through qwix; `scale` is None in a full-precision layer. With
    `int8_out_in` the int8 values are kept transposed, [out, in] with scale [out, 1]
    (`quantize.int8_matmul` says why). With `float_barrier` a full-precision layer's
    output passes through `lax.optimization_barrier` (an identity): for the q / k / v
    projections of a model without q/k/v biases (LLaDA) the TPU compiler otherwise
    copies each stacked [in, out] kernel into the transposed layout when a decode
    starts, 1 GiB each at LLaDA-8B in bfloat16 (experiments/results/compile/memory-8b.md).
    """

    def __init__(self, d_in: int, d_out: int, axes: tuple, *, bias: bool, cfg: ModelConfig,
                 rngs: nnx.Rngs, int8_out_in: bool = False, float_barrier: bool = False):
        self.kernel = _param(0.02 * jax.random.normal(rngs.params(), (d_in, d_out),
                                                      cfg.jnp_param_dtype), axes)
        self.bias = (_param(jnp.zeros((d_out,), cfg.jnp_param_dtype), (axes[1],))
                     if bias else None)
        self.scale = None
        self.dtype = cfg.jnp_dtype
        self.int8_out_in = int8_out_in
        self.float_barrier = float_barrier

    def quantize_int8(self) -> None:
        """Replaces the kernel [..., in, out] by int8 values and adds `scale`
        [..., 1, out] (one per output channel; a stacked kernel's leading axes keep
        theirs), named as the kernel with the contracted dimension unnamed; with
        `int8_out_in` both transposed ([..., out, in] and [..., out, 1]), names too."""
        if self.scale is not None:
            return
        values, scale = quantize.int8_weights(self.kernel[...], out_in=self.int8_out_in)
        meta = self.kernel.get_metadata()
        names = meta.get("out_sharding")
        scale_names = None
        if names is not None:
            names = tuple(names)
            if self.int8_out_in:
                names, scale_names = (names[:-2] + (names[-1], names[-2]),
                                      names[:-2] + (names[-1], None))
            else:
                scale_names = names[:-2] + (None,) + names[-1:]
        self.kernel = nnx.Param(values, **{**meta, "out_sharding": names})
        self.scale = nnx.data(nnx.Param(scale, **{**meta, "out_sharding": scale_names}))

    def __call__(self, x):
        if self.scale is not None:
            y = quantize.int8_matmul(x, self.kernel[...], self.scale[...], self.dtype,
                                     out_in=self.int8_out_in)
        else:
            y = jnp.einsum("...i,io->...o", x.astype(self.dtype),
                           self.kernel[...].astype(self.dtype))
            if self.float_barrier:
                y = jax.lax.optimization_barrier(y)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, cfg: ModelConfig, rngs: nnx.Rngs, axes=("embed",)):
        del rngs
        self.scale = _param(jnp.ones((dim,), cfg.jnp_param_dtype), axes)
        self.eps = cfg.norm_eps
        self.dtype = cfg.jnp_dtype

    def __call__(self, x):
        # Statistics in float32 as both references do, then cast back.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32.astype(self.dtype) * self.scale[...].astype(self.dtype))


def rope_tables(positions, h: int, theta: float):
    """The rotary embedding's cos and sin for `apply_rope`, computed once per forward
    and shared by every layer (each layer's q and k rotate by the same angles).

    Args:
      positions: [b, t] integer positions.
      h: head dim.
      theta: RoPE base.
    Returns:
      (cos, sin), each [b, t, 1, h/2] float32: one column per frequency, each used by
      the two halves of a head (`apply_rope` doubles them where it uses them; whole [h]
      tables XLA on CPU would compute again inside every layer that reads them).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [h/2]
    ang = (positions.astype(jnp.float32)[..., None] * inv_freq)[:, :, None, :]  # [b, t, 1, h/2]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """x [b, t, n, h] rotated by `rope_tables`' (cos, sin), rotate-half convention; same
    shape and dtype."""
    h = x.shape[-1]
    cos, sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def apply_partial_rope(x, cos, sin):
    """x [b, t, n, h] with its leading 2 * cos.shape[-1] channels rotated by
    `apply_rope` and the rest passed through (partial rotary, LLaDA2)."""
    r = 2 * cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)


def rope(x, positions, theta: float):
    """Rotary embedding, rotate-half convention (LLaMA / Qwen2 / LLaDA).

    Args:
      x: [b, t, n, h].
      positions: [b, t] integer positions.
      theta: RoPE base.
    Returns:
      x rotated, same shape and dtype.
    """
    return apply_rope(x, *rope_tables(positions, x.shape[-1], theta))


# Attention implementations: "auto" picks the fused cuDNN kernel of
# jax.nn.dot_product_attention on a GPU in 16-bit floats and `_xla_attention` otherwise;
# "xla" and "cudnn" ask for one; "reference" is a plain einsum softmax, the check for
# the others.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "reference")
_warned_fallback: set = set()
# What a masked score becomes (jax.nn.dot_product_attention's value): exp of it less a
# row's maximum is 0, and a row with every key masked attends uniformly.
_MASKED = -0.7 * float(np.finfo(np.float32).max)


def resolve_attention(implementation: str | None, dtype) -> str:
    """The implementation `attention` runs for a requested one (None: "auto")."""
    impl = implementation or "auto"
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {impl!r}: expected one of "
                         f"{ATTENTION_IMPLEMENTATIONS}")
    if impl == "auto":
        fused = jax.default_backend() == "gpu" and jnp.dtype(dtype) in (
            jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if fused else "xla"
    return impl


def _reference_attention(q, k, v, mask):
    """Grouped-query softmax attention written out (float32 scores and softmax)."""
    b, Q, H, h = q.shape
    K = k.shape[2]
    qg = q.reshape(b, Q, K, H // K, h).astype(jnp.float32)
    s = jnp.einsum("bqkgh,btkh->bkgqt", qg, k.astype(jnp.float32)) / math.sqrt(h)
    if mask is not None:  # [b, 1, 1|Q, T] -> [b, 1, 1, 1|Q, T]
        s = jnp.where(mask[:, :, None], s, jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqt,btkh->bqkgh", w, v.astype(jnp.float32))
    return o.reshape(b, Q, H, h).astype(q.dtype)


def _xla_attention(q, k, v, mask):
    """Grouped-query softmax attention as XLA compiles it well (the "xla" path).

    The G = H / K query heads that share a K/V head are stacked along the query axis,
    so the scores of each K/V head are one [G*Q, T] matrix whose rows are a query's
    keys (no transpose of the [.., T] scores between the matmuls). The softmax is left
    unnormalized until after the value matmul: o = (exp(s - max) @ v) / sum(exp(s -
    max)), which divides the [G*Q, h] result instead of the [G*Q, T] weights, so the
    weights are written once, by the pass that computes them. Scores, softmax and the
    value matmul's accumulation are float32 whatever the input dtype.

    Args:
      q: [b, Q, H, h]; k, v: [b, T, K, h]; mask: None or bool [b, 1, 1|Q, T].
    Returns:
      [b, Q, H, h] in q's dtype.
    """
    b, Q, H, h = q.shape
    K = k.shape[2]
    G = H // K
    qs = q.reshape(b, Q, K, G, h).transpose(0, 2, 3, 1, 4).reshape(b, K, G * Q, h)
    s = jnp.einsum("bkmh,btkh->bkmt", qs, k, preferred_element_type=jnp.float32)
    s = s * jnp.float32(1 / math.sqrt(h))
    if mask is not None:
        if mask.shape[2] > 1:  # per query: [b, 1, Q, T] -> [b, 1, G*Q, T], g major
            mask = jnp.broadcast_to(mask[:, :, None], (b, 1, G) + mask.shape[2:])
            mask = mask.reshape(b, 1, G * Q, mask.shape[-1])
        s = jnp.where(mask, s, _MASKED)
    e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    o = jnp.einsum("bkmt,btkh->bkmh", e.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    o = o / jnp.sum(e, axis=-1, keepdims=True)
    return o.reshape(b, K, G, Q, h).transpose(0, 3, 1, 2, 4).reshape(b, Q, H, h).astype(q.dtype)


def attention(q, k, v, *, key_mask=None, q_block=None, k_block=None, implementation=None):
    """Grouped-query softmax attention: the one attention of the model.

    The mask is never built as [b, Q, T] by the caller: a [b, T] key mask covers padding,
    and block-causal attention (D2F: a query sees keys of its own and earlier blocks) is
    given as block ids per query and per key. On GPUs in 16-bit floats
    (`implementation` "auto" or "cudnn") both go to `jax.nn.dot_product_attention`'s
    fused cuDNN kernel; elsewhere `_xla_attention` runs, which computes the scores and
    the softmax in float32 whatever the input dtype. When cuDNN refuses a shape or mask,
    the XLA path runs instead (said once).

    Args:
      q: [b, Q, H, h]; k, v: [b, T, K, h] (H a multiple of K).
      key_mask: [b, T] bool, False for keys no query may attend (padding); None: all.
      q_block, k_block: [b, Q] and [b, T] int block ids; when given, a query attends only
        to keys whose block id is <= its own. Ids of shape [b, Q, n] and [b, T, n] are n
        orders at once: a query attends to a key whose every id is <= its own (the
        block-diffusion training canvas, `testbed.train.block_diffusion_ids`).
      implementation: one of ATTENTION_IMPLEMENTATIONS (None: "auto").
    Returns:
      [b, Q, H, h] in q's dtype.
    """
    mask = None
    if key_mask is not None:
        mask = key_mask[:, None, None, :]  # [b, 1, 1, T]
    if q_block is not None:
        causal = k_block[:, None, :] <= q_block[:, :, None]  # [b, Q, T(, n)]
        if causal.ndim == 4:
            causal = jnp.all(causal, axis=-1)
        causal = causal[:, None]  # [b, 1, Q, T]
        mask = causal if mask is None else mask & causal
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    impl = resolve_attention(implementation, q.dtype)
    if impl == "reference":
        return _reference_attention(q, k, v, mask)
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError) as e:
            if implementation == "cudnn":
                raise
            if str(e) not in _warned_fallback:
                _warned_fallback.add(str(e))
                warnings.warn(f"cuDNN attention unavailable here ({e}); using XLA's",
                              stacklevel=2)
    return _xla_attention(q, k, v, mask)


def query_block_ids(block_ids, cache, write_index):
    """(q_block, k_block) for `attention` from the block id of every canvas column
    [b, T]: the queries are the canvas itself without a cache, else the columns
    write_index [b, Q]. (None, None) when block_ids is None (bidirectional)."""
    if block_ids is None:
        return None, None
    if cache is None:
        return block_ids, block_ids
    read = jnp.minimum(write_index, block_ids.shape[1] - 1)
    return jnp.take_along_axis(block_ids, read, axis=1), block_ids


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, H, K, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # What the TPU compiler needs to read the q / k / v kernels in place (Linear):
        # int8 values kept [out, in]; float outputs behind a barrier.
        qkv = dict(bias=cfg.qkv_bias, cfg=cfg, rngs=rngs, int8_out_in=True, float_barrier=True)
        self.q_proj = Linear(d, H * h, ("embed", "heads"), **qkv)
        self.k_proj = Linear(d, K * h, ("embed", "kv_heads"), **qkv)
        self.v_proj = Linear(d, K * h, ("embed", "kv_heads"), **qkv)
        self.o_proj = Linear(H * h, d, ("heads", "embed"), bias=False, cfg=cfg, rngs=rngs)
        self.cfg = cfg

    def qkv(self, x, rot):
        """Queries, keys and values of x [b, t, d], q and k rotated by rot = (cos, sin)
        from `rope_tables`."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        return apply_rope(q, *rot), apply_rope(k, *rot), v

    def out(self, o):
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, -1))


class FusedQKVAttention(nnx.Module):
    """LLaDA2's attention: one q/k/v projection whose output is H query heads, then K
    key heads, then K value heads (the published `query_key_value`), a per-head RMSNorm
    of queries and keys (QK-norm, before RoPE), and RoPE on each head's leading
    `cfg.rope_dim` channels only (partial rotary)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, H, K, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(d, (H + 2 * K) * h, ("embed", "heads"), bias=False, cfg=cfg,
                               rngs=rngs, int8_out_in=True, float_barrier=True)
        self.q_norm = RMSNorm(h, cfg=cfg, rngs=rngs, axes=("head_dim",))
        self.k_norm = RMSNorm(h, cfg=cfg, rngs=rngs, axes=("head_dim",))
        self.o_proj = Linear(H * h, d, ("heads", "embed"), bias=False, cfg=cfg, rngs=rngs)
        self.cfg = cfg

    def qkv(self, x, rot):
        """As `Attention.qkv`; rot = `rope_tables` of width cfg.rope_dim."""
        H, K, h = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).reshape(b, t, H + 2 * K, h)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + K], qkv[:, :, H + K:]
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_partial_rope(q, *rot), apply_partial_rope(k, *rot), v

    def out(self, o):
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, -1))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), of width `hidden` (default cfg.mlp_hidden)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, hidden: int | None = None):
        d, m = cfg.d_model, hidden or cfg.mlp_hidden
        self.gate_proj = Linear(d, m, ("embed", "mlp"), bias=False, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(d, m, ("embed", "mlp"), bias=False, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(m, d, ("mlp", "embed"), bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
    """The gate of a mixture-of-experts layer: kernel [d, E] and the stored selection
    bias expert_bias [E] (`moe.route`). Never quantized: `quantize_model` leaves it in
    its dtype and the routing is computed in float32, so a given input picks the same
    experts in an int8 model as in the float one."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        E = cfg.n_experts
        self.kernel = _param(0.02 * jax.random.normal(rngs.params(), (cfg.d_model, E),
                                                      cfg.jnp_param_dtype), ("embed", None))
        self.expert_bias = _param(jnp.zeros((E,), cfg.jnp_param_dtype), (None,))


class Experts(nnx.Module):
    """The routed experts' SwiGLU kernels, stacked: gate_proj, up_proj [E, d, m] and
    down_proj [E, m, d] (each expert's [in, out] kernel at its index).

    After `quantize_int8` each holds int8 values of the same shape and
    `<name>_scale` [E, 1, out] (float32) their scales, one per (expert, output
    channel) (asynclane_jax.models.quantize); the scales are None in a float model."""

    KERNELS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        E, d, m = cfg.n_experts, cfg.d_model, cfg.moe_hidden
        dt = cfg.jnp_param_dtype
        init = lambda shape: 0.02 * jax.random.normal(rngs.params(), shape, dt)
        self.gate_proj = _param(init((E, d, m)), (None, "embed", "mlp"))
        self.up_proj = _param(init((E, d, m)), (None, "embed", "mlp"))
        self.down_proj = _param(init((E, m, d)), (None, "mlp", "embed"))
        self.gate_proj_scale = self.up_proj_scale = self.down_proj_scale = None

    def quantize_int8(self) -> None:
        """Replaces each stacked kernel [E, in, out] by int8 values and adds its scale
        [E, 1, out] (`quantize.int8_weights`, the linear layers' grid), named as the
        kernel with the contracted dimension unnamed."""
        if self.gate_proj_scale is not None:
            return
        for name in self.KERNELS:
            param = getattr(self, name)
            values, scale = quantize.int8_weights(param[...])
            meta = param.get_metadata()
            names = meta.get("out_sharding")
            scale_names = (None if names is None else
                           tuple(names)[:-2] + (None,) + tuple(names)[-1:])
            setattr(self, name, nnx.Param(values, **meta))
            setattr(self, quantize.scale_name(name),
                    nnx.data(nnx.Param(scale, **{**meta, "out_sharding": scale_names})))

    def scales(self):
        """(gate, up, down) scales of int8 kernels, or None for float ones."""
        if self.gate_proj_scale is None:
            return None
        return tuple(getattr(self, quantize.scale_name(n))[...] for n in self.KERNELS)


class SparseMoE(nnx.Module):
    """A mixture-of-experts feed-forward layer (LLaDA2): every token goes through its
    top-k routed experts (`moe.route`, `sharding.routed_experts`) and the shared expert.
    int8 (`quantize_model`): the routed experts' kernels and the shared expert's are
    int8, the router is not."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.shared_experts = (MLP(cfg, rngs=rngs, hidden=cfg.moe_hidden * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.cfg = cfg

    def __call__(self, x):
        cfg = self.cfg
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = moe.route(
            flat, self.gate.kernel[...], self.gate.expert_bias[...],
            top_k=cfg.n_experts_per_tok, n_groups=cfg.n_expert_groups,
            topk_groups=cfg.n_topk_groups, scaling=cfg.routed_scaling)
        # Expert-parallel when a sharding plan splits the experts (each chip its own
        # experts, one all-reduce); else moe.routed_experts itself.
        y = sharding.routed_experts(flat, experts, weights, self.experts.gate_proj[...],
                                    self.experts.up_proj[...], self.experts.down_proj[...],
                                    cfg.jnp_dtype, scales=self.experts.scales()
                                    ).reshape(x.shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe_layer: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
        self.attn = (FusedQKVAttention if cfg.is_moe else Attention)(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
        self.mlp = SparseMoE(cfg, rngs=rngs) if moe_layer else MLP(cfg, rngs=rngs)

    def qkv(self, x, rot):
        """Queries, keys and values of x [b, Q, d] (after RoPE by rot = `rope_tables`'
        (cos, sin)): [b, Q, H|K, h]."""
        return self.attn.qkv(self.attn_norm(x), rot)

    def __call__(self, x, q, keys, values, *, key_mask, q_block=None, k_block=None,
                 implementation=None):
        """The rest of the block once the keys are placed (fresh, or in the cache).

        Args:
          x: [b, Q, d] the block's input; q: [b, Q, H, h] from `qkv`.
          keys, values: [b, T, K, h] everything the queries attend to.
          key_mask, q_block, k_block, implementation: as `attention`.
        Returns:
          [b, Q, d].
        """
        h = x + self.attn.out(attention(q, keys, values, key_mask=key_mask, q_block=q_block,
                                        k_block=k_block, implementation=implementation))
        return h + self.mlp(self.mlp_norm(h))

    def step(self, index, x, rot, cache, rows, write_index, key_len=None, out_rows=None,
             **attention_kw):
        """One layer of `DiffusionLM.forward`: with a cache, the queries' fresh K/V are
        written into layer `index` of it and the queries attend to the whole layer (or
        to its first key_len columns).

        Args:
          index: the layer's index in the cache (a Python int, or traced in a scan).
          x: [b, Q, d]; rot: (cos, sin) [b, Q, 1, h/2] from `rope_tables`.
          cache: KVCache or None; rows: arange(b)[:, None]; write_index: [b, Q].
          key_len: a static column count: attend only to the cache's first key_len
            columns (None: all).
          out_rows: [b, n] indices into the Q queries, or None: the layer's output is
            computed only at those rows (its K/V still come from all Q): the last
            layer when only some rows are read.
          **attention_kw: key_mask, q_block, k_block, implementation (see `attention`).
        Returns:
          (x [b, Q or n, d], the updated cache or None).
        """
        q, k, v = self.qkv(x, rot)
        if cache is not None:
            cache = cache.write(index, rows, write_index, k, v)
            k, v = cache.k[index], cache.v[index]
            if key_len is not None:
                k, v = k[:, :key_len], v[:, :key_len]
        if out_rows is not None:
            x = jnp.take_along_axis(x, out_rows[:, :, None], axis=1)
            q = jnp.take_along_axis(q, out_rows[:, :, None, None], axis=1)
            if attention_kw.get("q_block") is not None:
                q_block = attention_kw["q_block"]
                index = out_rows if q_block.ndim == 2 else out_rows[:, :, None]
                attention_kw = dict(attention_kw, q_block=jnp.take_along_axis(
                    q_block, index, axis=1))
        return self(x, q, k, v, **attention_kw), cache


# ------------------------------------------------------------------ layer layouts
# "unrolled": one Block per layer, parameters layers.<i>.<name> [...];
# "stacked": one Block, parameters layers.<name> [L, ...] (`ModelConfig.scan_layers`);
# a model whose layers differ has one Block per stack (`ModelConfig.layer_stacks`),
# parameters layers.<stack>.<name> [stop - first, ...].
LAYER_AXIS = "layers"  # the logical name of the stacked axis (never sharded)
Stacks = tuple  # of (name or None, first layer, stop): `ModelConfig.layer_stacks()`


class LayerStacks(nnx.Module):
    """The scanned layout of a model whose layers differ: one stacked Block per stack,
    each an attribute named as its stack (`ModelConfig.layer_stacks`)."""

    def __init__(self, blocks: dict):
        for name, block in blocks.items():
            setattr(self, name, block)


def stack_blocks(blocks) -> Block:
    """One Block whose every variable is the given blocks' stacked along a new leading
    axis, its logical axis names led by LAYER_AXIS."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.state(b) for b in blocks]
    block = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    for _, v in nnx.iter_graph(block):
        if isinstance(v, nnx.Variable) and v.has_metadata("out_sharding"):
            names = v.get_metadata("out_sharding")
            if names is not None:
                v.set_metadata("out_sharding", (LAYER_AXIS, *tuple(names)))
    return block


def layer_layout(params: dict) -> str:
    """"unrolled" or "stacked": the layout of a nested parameter dict (int or string
    layer keys), read from its `layers` entry."""
    layers = params.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError("the parameters have no layers")
    keys = [str(k) for k in layers]
    if all(k.isdigit() for k in keys):
        return "unrolled"
    if any(k.isdigit() for k in keys):
        raise ValueError(f"the layers mix numbered and named entries: {sorted(keys)[:6]}")
    return "stacked"


def _stack(xs):
    return np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)


def _checked_stacks(n_layers: int, stacks: Stacks | None) -> Stacks:
    """The stacks (default: one of every layer), checked to cover 0..n_layers - 1 in
    order, and to be named unless there is one."""
    stacks = tuple(stacks) if stacks else ((None, 0, n_layers),)
    bounds = [b for _, a, b in stacks]
    if [a for _, a, _ in stacks] != [0] + bounds[:-1] or bounds[-1] != n_layers or \
            any(b <= a for _, a, b in stacks) or \
            (len(stacks) > 1 and any(name is None for name, _, _ in stacks)):
        raise ValueError(f"layer stacks {stacks} do not split layers 0..{n_layers - 1}")
    return stacks


def _stack_of(stacked: dict, name: str | None, stacks: Stacks) -> dict:
    if name is None:
        return stacked
    if set(stacked) != {n for n, _, _ in stacks}:
        raise ValueError(f"the stacked layers hold {sorted(map(str, stacked))}, expected "
                         f"the stacks {[n for n, _, _ in stacks]}")
    return stacked[name]


def stack_layer_params(params: dict, n_layers: int, stacks: Stacks | None = None) -> dict:
    """An unrolled parameter dict (pure dict: `layers` -> {0: {...}, 1: ...}, int or
    string keys) in the stacked layout (`layers` -> {...} with [L, ...] arrays, or
    `layers` -> {stack: {...}} with each stack's layers, `ModelConfig.layer_stacks()`);
    exact. Consumes the input's `layers` entry (emptied as it goes): each layer array
    is dropped as soon as it is stacked, so the two layouts' copies of the layers never
    coexist beyond one stacked array."""
    if layer_layout(params) == "stacked":
        return params
    stacks = _checked_stacks(n_layers, stacks)
    layers = params["layers"]
    keys = sorted(layers, key=lambda k: int(k))
    if [int(k) for k in keys] != list(range(n_layers)):
        raise ValueError(f"the parameters have layers {[int(k) for k in keys][:8]}, "
                         f"expected 0..{n_layers - 1}")
    flat = [_flatten(layers.pop(k)) for k in keys]
    out: dict = {}
    for stack, first, stop in stacks:
        names = list(flat[first])
        for i in range(first, stop):
            if set(flat[i]) != set(names):  # the order a converter wrote them may differ
                raise ValueError(f"layer {keys[i]} has other parameters than layer "
                                 f"{keys[first]}")
        target = out if stack is None else out.setdefault(stack, {})
        for name in names:
            _put(target, name, _stack([f.pop(name) for f in flat[first:stop]]))
    del flat
    layers.clear()
    params = dict(params)
    params["layers"] = out
    return params


def unstack_layer_params(params: dict, n_layers: int, stacks: Stacks | None = None, *,
                         str_keys: bool = False) -> dict:
    """A stacked parameter dict (`stack_layer_params`' layout for these stacks) in the
    unrolled layout (layer keys ints, or strings with str_keys); exact. Consumes the
    input's `layers` entry: each stacked array is dropped as soon as it is split."""
    if layer_layout(params) == "unrolled":
        return params
    stacks = _checked_stacks(n_layers, stacks)
    flats = [(_flatten(_stack_of(params["layers"], stack, stacks)), stack, first, stop)
             for stack, first, stop in stacks]
    for flat, stack, first, stop in flats:
        for name, a in flat.items():
            if a.shape[:1] != (stop - first,):
                where = ".".join(map(str, ((stack,) if stack else ()) + name))
                raise ValueError(f"layers.{where}: shape {tuple(a.shape)}, expected a "
                                 f"leading axis of {stop - first} layers")
    params["layers"].clear()
    out: dict = {(str(i) if str_keys else i): {} for i in range(n_layers)}
    for flat, _, first, stop in flats:
        for name in list(flat):
            a = flat.pop(name)
            for i in range(first, stop):
                _put(out[str(i) if str_keys else i], name, a[i - first])
            del a
    params = dict(params)
    params["layers"] = out
    return params


def _flatten(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _put(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


@struct.dataclass
class KVCache:
    """Keys (after RoPE) and values of every canvas position, per layer."""

    k: jax.Array  # [L, b, T, K, h]
    v: jax.Array  # [L, b, T, K, h]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None):
        shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        dt = dtype or cfg.jnp_dtype
        # Placed by the active sharding plan (rows on the batch axes, K/V heads on the
        # tensor axis when they divide by it); the in-place writes keep that placement.
        zeros = lambda: sharding.constrain(jnp.zeros(shape, dt), sharding.CACHE)
        return cls(zeros(), zeros())

    def write(self, layer: int, rows, index, k, v) -> KVCache:
        """Scatters fresh K/V [b, Q, K, h] of one layer at canvas columns index [b, Q]
        (rows = arange(b)[:, None]); an index >= T is dropped. Under jit, with the cache
        carried by a loop, XLA updates the buffer in place: nothing else is copied."""
        return KVCache(self.k.at[layer, rows, index].set(k.astype(self.k.dtype), mode="drop"),
                       self.v.at[layer, rows, index].set(v.astype(self.v.dtype), mode="drop"))


@struct.dataclass
class CallPart:
    """One part of a mixed call (`DiffusionLM.forward_mixed`): some rows' queries, each
    row a row of the cache.

    tokens, positions: [r, Q] the queries' token ids and RoPE positions.
    key_mask: [r, T] bool, False for keys the row must not attend (padding).
    write_index: [r, Q] int32 the canvas column of each query (>= T: dropped).
    rows: [r] int32 the cache row of each row (>= the cache's rows: a row whose K/V are
      dropped and whose output is not used); None: the cache's rows, in order (r = b).
    logits_index: [r, n] int32 the queries whose logits are computed; None: all.
    """

    tokens: jax.Array
    positions: jax.Array
    key_mask: jax.Array
    write_index: jax.Array
    rows: jax.Array | None = None
    logits_index: jax.Array | None = None


def check_call(tokens, positions, key_mask, cache, write_index, logits_index) -> None:
    """Trace-time shape and dtype checks of a model call's arguments (see `forward`)."""
    chex.assert_rank(tokens, 2, custom_message="forward: tokens are [b, Q]")
    chex.assert_type(tokens, int, custom_message="forward: tokens are token ids")
    chex.assert_equal_shape([tokens, positions],
                            custom_message="forward: positions are [b, Q], as the tokens")
    b = tokens.shape[0]
    if key_mask is not None:
        chex.assert_shape(key_mask, (b, None), custom_message="forward: key_mask is [b, T]")
    if cache is not None:
        chex.assert_shape(cache.k, (None, b, None, None, None),
                          custom_message="forward: the cache is [L, b, T, K, h]")
        if write_index is not None:
            chex.assert_equal_shape([tokens, write_index],
                                    custom_message="forward: write_index is [b, Q]")
    if logits_index is not None:
        chex.assert_shape(logits_index, (b, None),
                          custom_message="forward: logits_index is [b, n]")


class DiffusionLM(nnx.Module):
    """A LLaDA-, Dream- or LLaDA2-architecture mask-diffusion language model (LLaDA2:
    fused q/k/v with QK-norm and partial rotary, and mixture-of-experts layers after
    the first `first_dense_layers`; docs/llada2.md)."""

    # One of ATTENTION_IMPLEMENTATIONS; set it on a model to choose (e.g. "xla" to keep
    # a GPU off cuDNN's kernel). "auto": cuDNN's fused kernel on GPUs in 16-bit floats.
    attention_implementation: str = "auto"

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(0.02 * jax.random.normal(
            rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.jnp_param_dtype), ("vocab", "embed"))
        blocks = [Block(cfg, rngs=rngs, moe_layer=cfg.moe_layer(i)) for i in range(cfg.n_layers)]
        # The same random blocks in either layout: a stacked model is the unrolled one's
        # parameters stacked, for one seed.
        if not cfg.scan_layers:
            self.layers = nnx.List(blocks)
        elif len(cfg.layer_stacks()) == 1:
            self.layers = stack_blocks(blocks)
        else:
            self.layers = LayerStacks({name: stack_blocks(blocks[first:stop])
                                       for name, first, stop in cfg.layer_stacks()})
        self.final_norm = RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else
                        Linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), bias=False,
                               cfg=cfg, rngs=rngs))

    def _scan(self, x, rot, cache, rows, write_index, key_len, out_rows, kw):
        """The stacked layers as one `jax.lax.scan` per stack (`cfg.layer_stacks()`,
        one unless the layers differ): carry (x, cache), over the layer index, each
        iteration reading its layer's parameters from the stack's Block's [n, ...]
        arrays (and writing and reading that layer of the carried cache in place). With
        out_rows the last layer, whose output is read only at those rows, runs after
        the scans on them alone.

        lax.scan over the split Block, not `nnx.scan`: the decode merges the model
        inside its jit and calls it inside lax.cond / while_loop branches, and
        nnx.scan refuses a module whose variables belong to an outer trace ("Cannot
        extract graph node from different trace level"). The split state is plain
        arrays, which any trace may scan.
        """

        def step(block, index, carry):
            x, cache = block.step(index, carry[0], rot, carry[1], rows, write_index,
                                  key_len, **kw)
            return sharding.constrain(x, sharding.ACTIVATION), cache

        def last(block, index, carry):  # on the rows read alone
            return block.step(index, carry[0], rot, carry[1], rows, write_index, key_len,
                              out_rows=out_rows, **kw)

        return self._over_layers(step, (x, cache), last=None if out_rows is None else last)

    def _logits(self, x):
        x = self.final_norm(x)
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", x, self.embed[...].astype(x.dtype))
        return self.lm_head(x)

    def forward(self, tokens, positions, *, key_mask=None, cache: KVCache | None = None,
                write_index=None, logits_index=None, block_ids=None, key_len=None):
        """The one forward pass; full and cached calls are this function.

        Without a cache the Q = T tokens are the whole canvas and attend to each other.
        With a cache (arrays [L, b, T, K, h]) each layer first writes the queries' fresh
        K/V into the cache at `write_index`, in place (a scatter into the carried
        buffer; an index >= T is dropped), and the queries attend to all T cached
        positions. A full refresh is the cached call with every column queried.

        The layer stack (`cfg.scan_layers`): False, a Python loop, unrolled in the
        compiled program (one copy of every layer per call); True, one `jax.lax.scan`
        over the stacked Block carrying (x, cache), with the layer index traced (one
        layer body per call; see `_scan`). Same arithmetic in both; measured in
        experiments/results/compile/layer_stack.md and experiments/results/compile/memory-8b.md.

        Args:
          tokens: [b, Q] token ids.
          positions: [b, Q] RoPE positions.
          key_mask: [b, T] bool, False for keys that must not be attended (padding).
          cache: KVCache to read and update, or None.
          write_index: [b, Q] canvas column of each query (with a cache).
          logits_index: [b, n] optional indices into the Q queries; only those rows of
            the output head are computed.
          block_ids: [b, T] int block id of every canvas column for block-causal
            attention (a query sees keys of its own and earlier blocks); None for
            bidirectional attention.
          key_len: with a cache, a static number of leading canvas columns the queries
            attend to (the rest is neither read nor attended: a schedule that keeps a
            canvas suffix out of attention saves its cost); None: all T.
        Returns:
          (logits [b, Q or n, V] float32, the updated cache or None).
        """
        check_call(tokens, positions, key_mask, cache, write_index, logits_index)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.jnp_dtype)
        x = sharding.constrain(x, sharding.ACTIVATION)
        q_block, k_block = query_block_ids(block_ids, cache, write_index)
        if key_len is not None and cache is not None:
            key_mask = None if key_mask is None else key_mask[:, :key_len]
            k_block = None if k_block is None else k_block[:, :key_len]
        else:
            key_len = None
        rows = jnp.arange(tokens.shape[0])[:, None]
        kw = dict(key_mask=key_mask, q_block=q_block, k_block=k_block,
                  implementation=self.attention_implementation)
        rot = rope_tables(positions, self.cfg.rope_dim, self.cfg.rope_theta)
        # The last layer's output is read only at logits_index: past its K/V (written
        # from its input), it runs on those rows alone.
        # (A model without layers, costs.loop's measuring copy, gathers them below.)
        out_rows = (logits_index if logits_index is not None and self.cfg.n_layers > 0
                    and logits_index.shape[1] < tokens.shape[1] else None)
        if self.cfg.scan_layers:
            x, cache = self._scan(x, rot, cache, rows, write_index, key_len, out_rows, kw)
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x, cache = layer.step(i, x, rot, cache, rows, write_index, key_len,
                                      out_rows=out_rows if i == last else None, **kw)
                x = sharding.constrain(x, sharding.ACTIVATION)
        if logits_index is not None and out_rows is None:
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        return self._logits(x).astype(jnp.float32), cache

    def __call__(self, tokens, *, positions=None, key_mask=None, block_ids=None,
                 return_kv: bool = False, logits_index=None):
        """Full forward over the canvas (`forward` without a cache).

        Args:
          tokens: [b, T] int token ids.
          positions: [b, T] RoPE positions; default 0..T-1 (left-padded rows pass their
            own offsets so each row's real tokens start at 0).
          key_mask: [b, T] bool, False for padding keys.
          block_ids: [b, T] block ids for block-causal attention (see `forward`).
          return_kv: also return every layer's K/V as a KVCache.
          logits_index: [b, n] optional canvas columns; when given, only those rows of
            the output head are computed (a sampler rarely needs all T x V logits).
        Returns:
          logits [b, T, V] (or [b, n, V]) in float32 (no Dream shift), and the KVCache
          if return_kv.
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if not return_kv:
            return self.forward(tokens, positions, key_mask=key_mask,
                                logits_index=logits_index, block_ids=block_ids)[0]
        cols = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return self.forward(tokens, positions, key_mask=key_mask,
                            cache=KVCache.zeros(self.cfg, b, t), write_index=cols,
                            logits_index=logits_index, block_ids=block_ids)

    def forward_cached(self, tokens, positions, write_index, cache: KVCache, *, key_mask=None,
                       block_ids=None):
        """Logits for a set of query positions against a K/V cache of the whole canvas
        (`forward` with a cache).

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
          block_ids: [b, T] block ids for block-causal attention (see `forward`).
        Returns:
          (logits [b, Q, V] float32, updated KVCache).
        """
        return self.forward(tokens, positions, key_mask=key_mask, cache=cache,
                            write_index=write_index, block_ids=block_ids)

    def _over_layers(self, fn, carry, last=None):
        """carry = fn(block, index, carry) for every layer in order, in either layer
        layout (stacked: one `jax.lax.scan` per stack, each step merging its layer's
        parameters, as `_scan` does); with `last`, the last layer runs
        last(block, index, carry) instead (after the scans: its carry may change shape)."""
        n_layers = self.cfg.n_layers
        if not self.cfg.scan_layers:
            for i, layer in enumerate(self.layers):
                carry = (last if last is not None and i == n_layers - 1 else fn)(layer, i,
                                                                                  carry)
            return carry
        for stack, first, stop in self.cfg.layer_stacks():
            block = self.layers if stack is None else getattr(self.layers, stack)
            block_def, stacked = nnx.split(block)

            def layer(index, block_def=block_def, stacked=stacked, first=first):
                # The layer's parameters at its place in the stack; `index` (the
                # model's layer) addresses the cache.
                return nnx.merge(block_def, jax.tree.map(
                    lambda a: jax.lax.dynamic_index_in_dim(a, index - first, keepdims=False),
                    stacked))

            def body(c, index, layer=layer):
                return fn(layer(index), index, c), None

            end = stop - 1 if last is not None and stop == n_layers else stop
            carry = jax.lax.scan(body, carry, jnp.arange(first, end, dtype=jnp.int32))[0]
            if end < stop:
                index = jnp.asarray(end, jnp.int32)
                carry = last(layer(index), index, carry)
        return carry

    def forward_mixed(self, parts: tuple[CallPart, ...], cache: KVCache):
        """One call over parts of different shapes against one K/V cache: e.g. a full
        forward over some rows' whole canvases (Q = T) with a cached call of the other
        rows' queries. Every layer runs its projections and MLP over all the parts'
        tokens together (one pass over the weights: on a weight-bound chip the call
        costs about what its larger part alone would), then each part writes its
        queries' K/V into its rows of the cache and attends to those rows. A row's
        output is what `forward` with the cache gives it alone: rows never see each
        other, and parts must not share a cache row.

        Bidirectional attention only (no block ids, no key bound), rows not split across
        devices: the parts' tokens are one flat sequence, which no batch sharding splits
        (a tensor axis splits the weights as in any call).

        Args:
          parts: the CallParts, each [r_i, Q_i].
          cache: KVCache [L, b, T, K, h].
        Returns:
          (per part, logits [r_i, n_i or Q_i, V] float32; the updated cache).
        """
        for p in parts:
            check_call(p.tokens, p.positions, p.key_mask, None, None, p.logits_index)
            chex.assert_equal_shape([p.tokens, p.write_index],
                                    custom_message="forward_mixed: write_index is [r, Q]")
        sizes = [p.tokens.size for p in parts]
        shapes = [p.tokens.shape for p in parts]

        def flat(arrays):  # [r_i, Q_i, ...] -> [1, sum r_i Q_i, ...]
            return jnp.concatenate([a.reshape(1, -1, *a.shape[2:]) for a in arrays], axis=1)

        def split(a):  # the inverse of flat
            out, at = [], 0
            for n, shape in zip(sizes, shapes):
                out.append(a[:, at:at + n].reshape(*shape, *a.shape[2:]))
                at += n
            return out

        embed = self.embed[...]
        x = flat([jnp.take(embed, p.tokens, axis=0) for p in parts]).astype(self.cfg.jnp_dtype)
        rots = [rope_tables(p.positions, self.cfg.rope_dim, self.cfg.rope_theta) for p in parts]
        rot = (flat([c for c, _ in rots]), flat([s for _, s in rots]))
        impl = self.attention_implementation
        b = cache.k.shape[1]

        def read(p, a):  # a part's queries whose logits are computed
            if p.logits_index is None:
                return a
            index = p.logits_index.reshape(p.logits_index.shape + (1,) * (a.ndim - 2))
            return jnp.take_along_axis(a, index, axis=1)

        def layer(block, index, carry, last=False):
            x, cache = carry
            q, k, v = block.qkv(x, rot)
            qs, ks, vs = split(q), split(k), split(v)
            for p, kp, vp in zip(parts, ks, vs):
                rows = jnp.arange(b)[:, None] if p.rows is None else p.rows[:, None]
                cache = cache.write(index, rows, p.write_index, kp, vp)
            if last:  # past its K/V, the last layer runs on the queries read alone
                qs = [read(p, qp) for p, qp in zip(parts, qs)]
                x = flat([read(p, xp) for p, xp in zip(parts, split(x))])
            outs = []
            for p, qp in zip(parts, qs):
                keys, values = cache.k[index], cache.v[index]
                if p.rows is not None:  # a gather of the part's rows
                    rows = jnp.minimum(p.rows, b - 1)
                    keys, values = keys[rows], values[rows]
                outs.append(attention(qp, keys, values, key_mask=p.key_mask,
                                      implementation=impl))
            h = x + block.attn.out(flat(outs))
            return h + block.mlp(block.mlp_norm(h)), cache

        x, cache = self._over_layers(layer, (x, cache),
                                     last=functools.partial(layer, last=True))
        if not self.cfg.n_layers:  # no last layer gathered the reads (costs.loop's model)
            x = flat([read(p, xp) for p, xp in zip(parts, split(x))])
        reads = [read(p, p.tokens) for p in parts]  # their shapes
        logits = self._logits(x).astype(jnp.float32)
        out, at = [], 0
        for r in reads:
            n = r.shape[0] * r.shape[1]
            out.append(logits[:, at:at + n].reshape(r.shape[0], r.shape[1], -1))
            at += n
        return out, cache


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


__all__ = ["CallPart", "DiffusionLM", "KVCache", "LayerStacks", "init_model", "abstract_model",
           "param_stats", "rope", "attention", "stack_blocks", "layer_layout", "stack_layer_params",
           "unstack_layer_params"]
