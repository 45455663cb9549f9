"""What one model call computes and moves: FLOPs and HBM bytes of a `CallShape`.

The formula follows `DiffusionLM.forward` (asynclane_jax/models/model.py) as the decode's
calls use it (`ModelCalls` in asynclane_jax/decoding/driver.py):

* every one of the `rows x queries` query tokens passes through all L layers: the q / k
  / v / o projections, the attention, the SwiGLU MLP (gate, up, down);
* the attention of each query covers `keys` columns: the fresh K/V of the call itself
  without a cache, else the cache after the call's own K/V were written into it (the
  whole canvas, or its first `keys` columns with `key_len`);
* the output head runs only at the `logits` columns of each row (`logits_index`).

The last layer's attention, o projection and MLP feed nothing but the logits columns.
As the model is written they run at every query (`last_layer="all"`, the default),
and so the compiled call runs them when XLA cannot move the gather of the logits
columns above them. Where it can (it depends on the attention's implementation), it
computes them at those columns only: `last_layer="logits"` prices that program. The
difference is at most one layer's attention, o and MLP.

FLOPs count the matmuls, two per multiply-add: the projections and the MLP
(2 x tokens x in x out each), the attention scores and values (2 x rows x queries x
keys x H x h each) and the head (2 x rows x logits x d x V). Left out as elementwise:
the RMSNorms, RoPE, the softmax's exponentials and sums, SiLU and the residual adds
(XLA's own count includes them; docs/costs.md compares the two).

Bytes are what one call reads from and writes to HBM, each array once:
* weights, read once per call however many rows: every linear kernel in the weight
  format (int8: one byte per value plus a float32 scale per output channel; the
  biases, norms and embedding stay in the parameter dtype), the output head only when
  logits > 0, and of the embedding only the rows gathered, not the table;
* the K/V cache (in the compute dtype) when the call has one: `keys` columns per layer
  and row read, `queries` columns written;
* activations between the matmuls, each written once and read once: the inputs of
  the projections and of the MLP (the [tokens, d] stream, read by each of q / k / v,
  gate and up), q, the fresh K/V, the attention's output, the MLP's two hidden
  outputs (read by down), the outputs of o and down; norms, RoPE, SiLU and residual
  adds are taken as fused into their neighbours, and the attention as one fused
  kernel whose scores stay on chip (XLA's own attention writes them: docs/costs.md
  compares the two);
* the call's own inputs (token ids, positions, write and logits indices, key mask) and
  its float32 logits.

A LLaDA2 (mixture-of-experts) config (`LLaDA2Config`) is priced layer by layer: its
first `first_dense_layers` layers as the dense SwiGLU above (width `mlp_hidden`), every
later one as a mixture-of-experts layer (`SparseMoE`):
* FLOPs per token: the router (2 x d x E), the shared expert (a SwiGLU of width
  moe_hidden x n_shared_experts) and top-k routed experts (k x one expert's SwiGLU of
  width moe_hidden): the routed FLOPs grow with k, not with E;
* weight bytes: the router's kernel and expert_bias, the shared expert's kernels, and
  the routed experts' kernels of the experts the call reads. A call of N tokens through
  the layer reads each expert at least one of its tokens chose. Under UNIFORM routing
  (each token's k experts a uniform draw of k of the E, tokens independent) the
  expected number of distinct experts is E x (1 - (1 - k/E)^N) (`expected_experts`):
  exact for N = 1 (k experts), an estimate otherwise. Real routing is skewed toward
  some experts, so a real call reads fewer distinct experts than this;
* activations: the router's input and its float32 scores and the chosen experts and
  weights, the shared expert's as the dense SwiGLU's, the k rows per token gathered
  for the routed experts (written once, read by gate and up), their hidden states
  (k per token: gate's and up's outputs, read by down), down's k rows (read by the
  weighted sum) and the sum itself.
The fused q/k/v projection has the matmul sizes of separate q, k and v (no biases);
the QK-norm is elementwise (left out as the other norms, its scales counted in
`bytes_other`), and partial rotary changes nothing counted. int8 weights price the
expert kernels at one byte a value plus a float32 scale per output channel, as the
dense kernels; the router stays in the parameter dtype. int8 is not built for a
mixture-of-experts model yet (`aot` refuses it): its price is what it would move.
The whole feed-forward of a layer (router, shared and routed experts) is in the MLP
fields (`flops_mlp`, `bytes_mlp`, what a slice divides: the experts are split
expert-parallel on the tensor axis); `flops_experts`, `bytes_experts` and
`experts_read` say how much of it the routed experts are.

Each part is a field of `CallCost`, so a slice can divide what it shards
(`asynclane_jax.costs.roofline`).
"""

from __future__ import annotations

import dataclasses
import math

from asynclane_jax.costs.chips import CostError
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models.config import ModelConfig

# Weight formats of the linear kernels: bytes per value. "int8" is our weight-only
# quantization (asynclane_jax.models.quantize); "f32" prices the tiny float32 models.
WEIGHT_BYTES = {"bf16": 2, "int8": 1, "f32": 4}
SCALE_BYTES = 4  # an int8 kernel's per-output-channel scale is stored in float32
INDEX_BYTES = 4  # int32 token ids, positions and indices


@dataclasses.dataclass(frozen=True)
class CallCost:
    """FLOPs and HBM bytes of one model call of one shape, every chip together.

    The parts are kept apart so that a slice can divide each as it is sharded:
    attention heads (`*_qo`: the q and o projections; `*_kv`: k and v, whose heads are
    the K/V heads), the MLP, the head (vocabulary), and what no chip divides (`other`).

    Attributes:
      shape: the call's shape; weights: the weight format ("bf16", "int8", "f32").
      layers: L; kv_heads, heads: K and H (what a slice divides the heads by).
      mlp_hidden, vocab: the MLP and vocabulary widths (a slice divides them too).
      flops_qo, flops_kv, flops_mlp: the projections' and the MLP's matmul FLOPs.
      flops_attention: attention scores and values over `keys`.
      flops_head: the output head over `logits` columns.
      bytes_qo, bytes_kv, bytes_mlp, bytes_head: weight bytes (kernels, int8 scales,
        biases) of those layers.
      bytes_other: the norms and the gathered embedding rows.
      bytes_kv_read, bytes_kv_write: K/V cache read and written.
      bytes_act_sharded: activations split across a slice's chips (q / k / v, the
        attention's input and output, the MLP's hidden width).
      bytes_act_full: activations every chip of a slice holds whole (the [tokens, d]
        inputs and outputs of the projections and the MLP).
      bytes_inputs: the call's index arrays and key mask.
      bytes_logits: the float32 logits written.
      allreduces: the all-reduces a tensor-parallel slice makes (two per layer: the
        attention's and the MLP's outputs summed across the chips).
      allreduce_bytes: their payload, every all-reduce together (the [tokens, d]
        outputs in the compute dtype).
      moe_layers, experts: a mixture-of-experts config's expert layers and routed
        experts per layer, E (0 for a dense config).
      experts_read: the expected distinct routed experts the call reads, every expert
        layer together (uniform routing: `expected_experts`).
      flops_experts, bytes_experts: of flops_mlp and bytes_mlp, the routed experts'
        matmuls and kernels (their int8 scales included).
    """

    shape: CallShape
    weights: str
    layers: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    vocab: int
    flops_qo: float
    flops_kv: float
    flops_mlp: float
    flops_attention: float
    flops_head: float
    bytes_qo: float
    bytes_kv: float
    bytes_mlp: float
    bytes_head: float
    bytes_other: float
    bytes_kv_read: float
    bytes_kv_write: float
    bytes_act_sharded: float
    bytes_act_full: float
    bytes_inputs: float
    bytes_logits: float
    allreduces: int
    allreduce_bytes: float
    moe_layers: int = 0
    experts: int = 0
    experts_read: float = 0.0
    flops_experts: float = 0.0
    bytes_experts: float = 0.0

    @property
    def flops(self) -> float:
        """Every matmul FLOP of the call."""
        return (self.flops_qo + self.flops_kv + self.flops_mlp + self.flops_attention
                + self.flops_head)

    @property
    def weight_bytes(self) -> float:
        """Parameter bytes the call reads."""
        return (self.bytes_qo + self.bytes_kv + self.bytes_mlp + self.bytes_head
                + self.bytes_other)

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes of the layers' linear kernels, their int8 scales and biases (the head
        and `other` left out)."""
        return self.bytes_qo + self.bytes_kv + self.bytes_mlp

    @property
    def bytes(self) -> float:
        """Every byte the call moves."""
        return (self.weight_bytes + self.bytes_kv_read + self.bytes_kv_write
                + self.bytes_act_sharded + self.bytes_act_full + self.bytes_inputs
                + self.bytes_logits)

    @property
    def expert_share(self) -> float:
        """The expected share of the routed experts' weights the call reads (0 for a
        dense config)."""
        return self.experts_read / (self.moe_layers * self.experts) if self.moe_layers \
            else 0.0

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["shape"] = self.shape.to_dict()
        out.update(flops=self.flops, bytes=self.bytes, weight_bytes=self.weight_bytes)
        return out


def check_weights(weights: str) -> str:
    """The weight format named, lower-cased; CostError naming the known ones."""
    key = weights.strip().lower() if isinstance(weights, str) else weights
    if key not in WEIGHT_BYTES:
        raise CostError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_BYTES)}")
    return key


def check_shape(shape: CallShape) -> CallShape:
    """The shape, checked for sizes the model can run; CostError otherwise."""
    if not isinstance(shape, CallShape):
        raise CostError(f"expected a CallShape, got {type(shape).__name__}")
    for name in ("rows", "queries", "keys", "canvas"):
        if getattr(shape, name) < 1:
            raise CostError(f"{shape}: {name} must be positive")
    if shape.logits < 0:
        raise CostError(f"{shape}: logits must be zero or more")
    if shape.keys > shape.canvas or shape.queries > shape.canvas:
        raise CostError(f"{shape}: queries and keys are at most the canvas")
    if shape.kind in ("cached", "mixed") and not shape.cache:
        raise CostError(f"{shape}: a {shape.kind} call has a cache")
    if not shape.cache and shape.keys != shape.queries:
        raise CostError(f"{shape}: without a cache the queries attend to themselves "
                        "(keys == queries)")
    return shape


def _linear(d_in: int, d_out: int, weights: str, param_bytes: int, bias: bool) -> int:
    """Bytes of one linear layer's parameters in a weight format."""
    n = d_in * d_out * WEIGHT_BYTES[weights]
    if weights == "int8":
        n += d_out * SCALE_BYTES
    return n + (d_out * param_bytes if bias else 0)


LAST_LAYER = ("all", "logits")


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts `tokens` tokens choose, each its `top_k`
    of `n_experts`, under uniform routing: each token's experts a uniform draw of top_k
    of the n_experts, tokens independent. An expert is missed by one token with
    probability 1 - top_k / n_experts, so E x (1 - (1 - k/E)^N). Exact for one token
    (k experts); for more, an estimate that real (skewed) routing lies below.
    """
    if tokens <= 0:
        return 0.0
    if tokens == 1 or top_k >= n_experts:
        return float(min(top_k, n_experts))
    return n_experts * -math.expm1(tokens * math.log1p(-top_k / n_experts))


@dataclasses.dataclass(frozen=True)
class _FeedForward:
    """The feed-forward layers' part of a call, every layer together (see `_moe_mlp`)."""

    flops: float
    weight_bytes: float
    act_sharded: float
    act_full: float
    flops_experts: float = 0.0
    bytes_experts: float = 0.0
    experts_read: float = 0.0
    moe_layers: int = 0


def _moe_mlp(cfg, layer_tokens, lin, act: int, par: int) -> _FeedForward:
    """The feed-forward part of a mixture-of-experts config (`LLaDA2Config`): layer i
    with `layer_tokens[i]` tokens through it, a dense SwiGLU in the first
    `first_dense_layers`, router + shared expert + routed experts after them (the
    module docstring says what counts)."""
    d, m = cfg.d_model, cfg.mlp_hidden
    E, k, me = cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_hidden
    ms = cfg.moe_hidden * cfg.n_shared_experts  # the shared expert's width (0: none)
    expert = 2 * lin(d, me) + lin(me, d)  # one routed expert's three kernels
    shared = 2 * lin(d, ms) + lin(ms, d) if ms else 0
    router = d * E * par + E * par  # kernel and expert_bias, in the parameter dtype
    flops = flops_experts = weight_bytes = bytes_experts = experts_read = 0.0
    sharded = full = 0  # bytes, exact integers
    moe_layers = 0
    for i, n in enumerate(layer_tokens):
        if not cfg.moe_layer(i):
            flops += 2.0 * n * 3 * d * m
            weight_bytes += 2 * lin(d, m) + lin(m, d)
            sharded += 4 * n * m * act  # gate's and up's outputs, read by down
            full += 3 * n * d * act  # gate and up read the input, down writes
            continue
        moe_layers += 1
        read = expected_experts(E, k, n)
        experts_read += read
        bytes_experts += read * expert
        weight_bytes += router + shared + read * expert
        routed = 2.0 * n * k * 3 * d * me
        flops_experts += routed
        flops += 2.0 * n * (d * E + 3 * d * ms) + routed
        # The shared expert's hidden outputs; the k rows per token gathered for the
        # routed experts (written, read by gate and up), their hidden states (gate's
        # and up's outputs, read by down) and down's rows (read by the weighted sum).
        sharded += n * (4 * ms + 5 * k * d + 4 * k * me) * act
        # The router reads the input, the shared expert's gate and up read it and its
        # down writes, the weighted sum writes; the router's float32 scores and the
        # chosen experts (int32) and weights (float32), each written and read.
        full += n * (d + (3 * d if ms else 0) + d) * act + n * (2 * 4 * E + 2 * 8 * k)
    return _FeedForward(flops=flops, weight_bytes=weight_bytes, act_sharded=sharded,
                        act_full=full, flops_experts=flops_experts,
                        bytes_experts=bytes_experts, experts_read=experts_read,
                        moe_layers=moe_layers)


def call_cost(cfg: ModelConfig, shape: CallShape, weights: str = "bf16",
              last_layer: str = "all") -> CallCost:
    """FLOPs and bytes of one model call (see the module docstring for what counts).

    Args:
      cfg: the model's config (a preset, `asynclane_jax.models.preset(name)`). A
        mixture-of-experts config (LLaDA2) reads, per expert layer, the expected
        distinct experts of its tokens under uniform routing (`expected_experts`).
      shape: the call's shape (`asynclane_jax.decoding.stats.CallShape`).
      weights: the linear kernels' format: "bf16", "int8" (weight-only, per-channel
        float32 scales) or "f32".
      last_layer: "all" (every query through the whole last layer, as the model is
        written) or "logits" (its attention, o and MLP at the logits columns only, as
        XLA compiles it when it moves the logits gather above them).
    Returns:
      CallCost.
    Raises:
      CostError: an unknown weight format or an impossible shape.
    """
    weights = check_weights(weights)
    shape = check_shape(shape)
    if last_layer not in LAST_LAYER:
        raise CostError(f"last_layer={last_layer!r}: expected one of {LAST_LAYER}")
    if shape.kind == "mixed":
        return _mixed_cost(cfg, shape, weights, last_layer)
    L, d, m, V = cfg.n_layers, cfg.d_model, cfg.mlp_hidden, cfg.vocab_size
    qw, kvw = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    act = cfg.jnp_dtype.itemsize  # activations and the K/V cache
    par = cfg.jnp_param_dtype.itemsize  # norms, biases, embedding
    b, q, k, n = shape.rows, shape.queries, shape.keys, shape.logits
    t = b * q  # query tokens
    lin = lambda d_in, d_out, bias=False: _linear(d_in, d_out, weights, par, bias)

    # The last layer past its q / k / v projections (whose K/V go to the cache): every
    # query, or the logits columns only (see the module docstring).
    last = t if last_layer == "all" else b * min(n, q)
    all_q = L * t  # query tokens through the q / k / v projections, over the layers
    rest = (L - 1) * t + last  # ... through the attention, o and the MLP
    attends = (L - 1) + (1 if last else 0)  # layers whose attention runs at all
    head_bytes = 0
    if n > 0:
        head_bytes = d * V * par if cfg.tie_embeddings else lin(d, V)
    kv_col = 2 * b * kvw * act  # bytes of one K/V column (both) of one layer, every row
    if cfg.is_moe:
        # The feed-forward layer by layer; the per-head q and k norms' scales (QK-norm).
        ff = _moe_mlp(cfg, [t] * (L - 1) + [last], lin, act, par)
        qk_norms = L * 2 * cfg.head_dim * par
    else:  # the dense SwiGLU of every layer, as `_moe_mlp` prices a dense layer
        ff = _FeedForward(flops=2.0 * rest * 3 * d * m,
                          weight_bytes=float(L * (2 * lin(d, m) + lin(m, d))),
                          act_sharded=4 * rest * m * act, act_full=3 * rest * d * act)
        qk_norms = 0
    return CallCost(
        shape=shape, weights=weights, layers=L, heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads, mlp_hidden=m, vocab=V,
        flops_qo=2.0 * (all_q * d * qw + rest * qw * d),
        flops_kv=2.0 * all_q * 2 * d * kvw,
        flops_mlp=ff.flops,
        flops_attention=2.0 * 2 * rest * k * qw,
        flops_head=2.0 * b * n * d * V,
        bytes_qo=float(L * (lin(d, qw, cfg.qkv_bias) + lin(qw, d))),
        bytes_kv=float(L * 2 * lin(d, kvw, cfg.qkv_bias)),
        bytes_mlp=ff.weight_bytes,
        bytes_head=float(head_bytes),
        bytes_other=float((2 * L + 1) * d * par + t * d * par + qk_norms),
        bytes_kv_read=float(attends * k * kv_col if shape.cache else 0),
        bytes_kv_write=float(L * q * kv_col if shape.cache else 0),
        # Each written once and read once: q (read by the attention), the fresh K/V
        # (read by the attention, or by the scatter into the cache), the attention's
        # output (read by o), gate's and up's outputs (read by down, SiLU and the
        # product fused into its input).
        bytes_act_sharded=float((all_q * qw + rest * qw + 4 * all_q * kvw
                                 + 2 * rest * qw) * act + ff.act_sharded),
        # q / k / v, gate and up read their input; o and down write their output; the
        # head reads its rows.
        bytes_act_full=float((3 * all_q * d + rest * d + b * n * d) * act + ff.act_full),
        bytes_inputs=float(INDEX_BYTES * (2 * t + (t if shape.cache else 0) + b * n)
                           + b * shape.canvas),
        bytes_logits=float(4 * b * n * V),
        allreduces=2 * attends,
        allreduce_bytes=float(2 * rest * d * act),
        moe_layers=ff.moe_layers, experts=cfg.n_experts if cfg.is_moe else 0,
        experts_read=ff.experts_read, flops_experts=ff.flops_experts,
        bytes_experts=ff.bytes_experts,
    )


# The CallCost fields that are weight bytes: a mixed call reads them once for both parts.
_WEIGHT_FIELDS = ("bytes_qo", "bytes_kv", "bytes_mlp", "bytes_head")


def _mixed_cost(cfg: ModelConfig, shape: CallShape, weights: str, last_layer: str) -> CallCost:
    """A mixed call (`CallShape.parts`: a full forward over some rows and a cached call
    of others, `DiffusionLM.forward_mixed`): the two parts' arithmetic, activations,
    cache traffic and all-reduce payloads added, their weights read once."""
    if cfg.is_moe:
        raise CostError(f"{shape}: mixed calls are priced for dense configs only (a "
                        "mixture-of-experts call's experts depend on its tokens together)")
    full, cached = (call_cost(cfg, p, weights, last_layer) for p in shape.parts())
    fields = {}
    for f in dataclasses.fields(CallCost):
        a, b = getattr(full, f.name), getattr(cached, f.name)
        if f.name in _WEIGHT_FIELDS:
            fields[f.name] = max(a, b)
        elif f.name == "bytes_other":  # the norms once; the embedding rows of both parts
            norms = (2 * cfg.n_layers + 1) * cfg.d_model * cfg.jnp_param_dtype.itemsize
            fields[f.name] = a + b - norms
        elif f.name == "allreduces":
            fields[f.name] = max(a, b)
        elif isinstance(a, (int, float)) and f.name not in (
                "layers", "heads", "kv_heads", "mlp_hidden", "vocab", "moe_layers",
                "experts"):
            fields[f.name] = a + b
        else:
            fields[f.name] = a
    fields["shape"] = shape
    return CallCost(**fields)


__all__ = ["CallCost", "INDEX_BYTES", "LAST_LAYER", "SCALE_BYTES", "WEIGHT_BYTES", "call_cost",
           "check_shape", "check_weights", "expected_experts"]
