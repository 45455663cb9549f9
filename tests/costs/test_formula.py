"""asynclane_jax.costs.formula: the FLOPs against XLA's own count of the same call
compiled for the CPU, the parameter bytes against the model's own arrays, and the
rules (int8, the K/V cache, the head and last layer at the logits columns)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from asynclane_jax.costs import CostError, call_cost
from asynclane_jax.costs.measure import call_arrays
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models import abstract_model, preset
from asynclane_jax.models import quantize as quantize_lib

# Wide enough that the matmuls dominate: what the formula leaves out (norms, RoPE, the
# softmax, SiLU, residual adds) is O(d + m + H x keys) per token and layer against the
# matmuls' O(d x (d + m)), a share near 1% at these widths. XLA counts both, so its
# figure lies a little above the formula's, never below. TOLERANCE bounds the excess;
# each drift the shapes below are chosen to expose (the head over every query, the
# attention over the whole canvas instead of `keys`) puts the count outside that band
# (test_the_check_can_fail).
TOLERANCE = 0.02
WIDE = dict(d_model=256, head_dim=64, mlp_hidden=1024, vocab_size=512, n_layers=2)
SHAPES = (CallShape("full", 2, 64, 64, 4, False, 64),
          CallShape("cached", 1, 8, 32, 2, True, 128))


def _config(family: str):
    return preset(f"tiny-{family}-test").replace(**WIDE)


def xla_flops(cfg, shape: CallShape) -> float:
    """XLA's FLOP count of one forward of `shape`, compiled for the CPU."""
    graphdef, params = nnx.split(abstract_model(cfg))
    arrays = call_arrays(cfg, shape)
    key_len = arrays.pop("key_len")
    arrays = jax.eval_shape(lambda: arrays)

    def call(params, a):
        return nnx.merge(graphdef, params).forward(
            a["tokens"], a["positions"], key_mask=a["key_mask"], cache=a["cache"],
            write_index=a["write_index"], logits_index=a["logits_index"], key_len=key_len)

    ca = jax.jit(call).lower(params, arrays).compile().cost_analysis()
    return float((ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"])


# LLaDA in both shapes; Dream (grouped K/V heads, q/k/v biases) in the cached one.
CASES = (("llada", SHAPES[0]), ("llada", SHAPES[1]), ("dream", SHAPES[1]))


@pytest.fixture(scope="module")
def counted():
    """{(family, shape): XLA's FLOPs}: compiled once for the module."""
    return {(f, s): xla_flops(_config(f), s) for f, s in CASES}


def priced(cfg, shape) -> list[float]:
    """The formula's FLOPs for either program XLA may compile: the last layer at every
    query, or past its q / k / v projections at the logits columns only (when the
    attention's implementation lets XLA move the logits gather above it)."""
    return [call_cost(cfg, shape, "f32", last).flops for last in ("all", "logits")]


@pytest.mark.parametrize("family, shape", CASES, ids=["llada-full", "llada-cached",
                                                       "dream-cached"])
def test_flops_match_xla_on_the_cpu(counted, family, shape):
    xla = counted[(family, shape)]
    formulas = priced(_config(family), shape)
    assert any(within(f, xla) for f in formulas), (xla, [xla / f for f in formulas])


def test_the_check_can_fail(counted):
    """The drifts the check guards against move the count past its tolerance."""
    cfg = _config("llada")
    full, cached = SHAPES
    drifts = {
        # the head priced at every query, not the logits columns
        "logits": (full, CallShape("full", 2, 64, 64, 64, False, 64)),
        # the attention priced over the whole canvas, not `keys`
        "keys": (cached, CallShape("cached", 1, 8, 128, 2, True, 128)),
    }
    for name, (shape, drifted) in drifts.items():
        xla = counted[("llada", shape)]
        for wrong in priced(cfg, drifted):
            assert not within(wrong, xla), (name, wrong / xla)


def within(formula: float, xla: float) -> bool:
    """The check: XLA's count at or above the formula's, by at most TOLERANCE."""
    return formula <= xla <= formula * (1 + TOLERANCE)


@pytest.mark.parametrize("name", ["llada-8b-instruct", "dream-7b-instruct"])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_parameter_bytes_are_the_models_arrays(name, weights):
    """A call with the head reads every parameter array of the model as stored
    (int8 kernels, their float32 scales, biases, norms) but the embedding table, of
    which it reads the rows gathered."""
    cfg = preset(name).replace(n_layers=2)  # the real widths; layers alike, fewer
    model = abstract_model(cfg)
    if weights == "int8":
        model = quantize_lib.abstract_quantized(model, "int8")
    state = nnx.state(model, nnx.Param)
    stored = quantize_lib.weight_bytes(state)
    table = cfg.vocab_size * cfg.d_model * cfg.jnp_param_dtype.itemsize
    shape = CallShape("cached", 1, 32, 640, 32, True, 640)
    cost = call_cost(cfg, shape, weights)
    gathered = 32 * cfg.d_model * cfg.jnp_param_dtype.itemsize
    assert cost.weight_bytes - gathered == stored - table


def test_int8_halves_the_linear_weight_bytes():
    cfg = preset("llada-8b-instruct")
    shape = CallShape("cached", 1, 32, 640, 32, True, 640)
    bf16, int8 = call_cost(cfg, shape, "bf16"), call_cost(cfg, shape, "int8")
    ratio = int8.linear_weight_bytes / bf16.linear_weight_bytes
    # Half, plus one float32 scale per output channel: 0.5 + 2 / in for a kernel [in,
    # out], and every kernel's in-width is at least d.
    assert 0.5 < ratio < 0.5 + 2 / cfg.d_model
    assert int8.bytes_head / bf16.bytes_head == pytest.approx(0.5 + 2 / cfg.d_model)
    assert int8.flops == bf16.flops
    assert int8.bytes_kv_read == bf16.bytes_kv_read  # the cache stays in bfloat16


def test_cache_bytes():
    cfg = preset("dream-7b-instruct")
    kv_col = 2 * cfg.n_kv_heads * cfg.head_dim * 2  # K and V of one column, bfloat16
    cached = call_cost(cfg, CallShape("cached", 8, 32, 512, 32, True, 640))
    assert cached.bytes_kv_read == cfg.n_layers * 8 * 512 * kv_col
    assert cached.bytes_kv_write == cfg.n_layers * 8 * 32 * kv_col
    full = call_cost(cfg, CallShape("full", 8, 640, 640, 32, False, 640))
    assert full.bytes_kv_read == full.bytes_kv_write == 0
    with_cache = call_cost(cfg, CallShape("full", 8, 640, 640, 32, True, 640))
    assert with_cache.bytes_kv_write == cfg.n_layers * 8 * 640 * kv_col


def test_the_head_at_the_logits_columns():
    cfg = preset("llada-8b-instruct")
    at_32 = call_cost(cfg, CallShape("cached", 1, 160, 640, 32, True, 640))
    at_all = call_cost(cfg, CallShape("cached", 1, 160, 640, 160, True, 640))
    d, V = cfg.d_model, cfg.vocab_size
    assert at_all.flops_head - at_32.flops_head == 2 * 128 * d * V
    assert at_all.flops_mlp == at_32.flops_mlp  # every layer at every query
    none = call_cost(cfg, CallShape("cached", 1, 160, 640, 0, True, 640))
    assert none.flops_head == none.bytes_head == none.bytes_logits == 0


def test_the_last_layer_at_the_logits_columns():
    cfg = preset("llada-8b-instruct")
    shape = CallShape("cached", 1, 160, 640, 32, True, 640)
    every, sunk = call_cost(cfg, shape), call_cost(cfg, shape, last_layer="logits")
    d, m, qw = cfg.d_model, cfg.mlp_hidden, cfg.n_heads * cfg.head_dim
    assert every.flops_mlp - sunk.flops_mlp == 2 * 128 * 3 * d * m
    assert every.flops_attention - sunk.flops_attention == 4 * 128 * 640 * qw
    assert every.flops_kv == sunk.flops_kv  # K/V of every query, into the cache
    assert every.weight_bytes == sunk.weight_bytes
    with pytest.raises(CostError, match="last_layer"):
        call_cost(cfg, shape, last_layer="some")


@pytest.mark.parametrize("weights", ["fp8", "", None, "int4"])
def test_unknown_weight_format(weights):
    with pytest.raises(CostError, match="bf16, int8"):
        call_cost(preset("tiny-llada-test"), SHAPES[0], weights)


@pytest.mark.parametrize("shape, problem", [
    (CallShape("cached", 1, 8, 64, 8, False, 64), "has a cache"),
    (CallShape("full", 1, 64, 32, 8, False, 64), "keys == queries"),
    (CallShape("cached", 1, 8, 128, 8, True, 64), "at most the canvas"),
    (CallShape("cached", 0, 8, 64, 8, True, 64), "rows must be positive"),
    ((1, 8, 64), "expected a CallShape"),
])
def test_impossible_shapes(shape, problem):
    with pytest.raises(CostError, match=problem):
        call_cost(preset("tiny-llada-test"), shape)


# ------------------------------------------------------------------ mixture of experts


def _expert_layer_parts(cfg, weights="f32"):
    """Bytes of one expert layer's router, shared expert and one routed expert, from the
    config's fields (float32 parameters: the tiny config's dtype)."""
    wb = {"bf16": 2, "f32": 4}[weights]
    par = cfg.jnp_param_dtype.itemsize
    d, me, E = cfg.d_model, cfg.moe_hidden, cfg.n_experts
    router = (d * E + E) * par
    shared = 3 * d * me * cfg.n_shared_experts * wb
    expert = 3 * d * me * wb
    return router, shared, expert


def test_one_token_reads_exactly_its_k_experts():
    """One token: the attention (fused q/k/v, the sizes of separate q, k, v), the dense
    first layer, and in each expert layer the router, the shared expert and exactly
    top-k routed experts; the same as the model's own arrays less the embedding table's
    other rows and the experts not chosen."""
    cfg = preset("tiny-llada2-test")
    assert cfg.jnp_param_dtype.itemsize == 4
    d, h, L, V = cfg.d_model, cfg.head_dim, cfg.n_layers, cfg.vocab_size
    qw, kvw = cfg.n_heads * h, cfg.n_kv_heads * h
    E, k = cfg.n_experts, cfg.n_experts_per_tok
    moe_layers = L - cfg.first_dense_layers
    router, shared, expert = _expert_layer_parts(cfg)
    attention = (d * qw + 2 * d * kvw + qw * d) * 4
    dense = 3 * d * cfg.mlp_hidden * 4
    norms = (2 * L + 1) * d * 4 + L * 2 * h * 4  # the layers' and final RMSNorm, QK-norm
    head, row = d * V * 4, d * 4  # the output head, the one embedding row gathered
    shape = CallShape("cached", 1, 1, 8, 1, True, 64)
    cost = call_cost(cfg, shape, "f32")
    assert cost.moe_layers == moe_layers and cost.experts == E
    assert cost.experts_read == moe_layers * k
    assert cost.bytes_experts == moe_layers * k * expert
    assert cost.weight_bytes == (L * attention + cfg.first_dense_layers * dense
                                 + moe_layers * (router + shared + k * expert)
                                 + norms + row + head)
    stored = quantize_lib.weight_bytes(nnx.state(abstract_model(cfg), nnx.Param))
    table = V * d * 4
    assert cost.weight_bytes == stored - table + row - moe_layers * (E - k) * expert


def test_many_tokens_read_every_expert():
    """The expected distinct experts grow with the tokens, from k at one token toward
    all E, and match a draw of uniform routing."""
    from asynclane_jax.costs.formula import expected_experts

    cfg = preset("tiny-llada2-test")
    E, k = cfg.n_experts, cfg.n_experts_per_tok
    moe_layers = cfg.n_layers - cfg.first_dense_layers
    read = [call_cost(cfg, CallShape("cached", b, q, q, q, True, 256), "f32").experts_read
            / moe_layers for b, q in ((1, 1), (1, 2), (1, 4), (2, 8), (4, 64), (64, 256))]
    assert read[0] == k and all(a < b for a, b in zip(read, read[1:-1]))
    assert read[-2] == pytest.approx(E, rel=1e-6) and read[-1] == E
    _, _, expert = _expert_layer_parts(cfg)
    huge = call_cost(cfg, CallShape("full", 64, 256, 256, 8, True, 256), "f32")
    assert huge.bytes_experts == moe_layers * E * expert
    # The uniform-routing expectation against a draw of it (LLaDA2-mini's 8 of 256).
    rng = np.random.default_rng(0)
    for tokens in (1, 32, 64):
        picks = np.argsort(rng.random((400, tokens, 256)), axis=-1)[..., :8]
        distinct = [len(np.unique(p)) for p in picks]
        assert np.mean(distinct) == pytest.approx(expected_experts(256, 8, tokens), rel=0.01)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_llada2_mini_full_forward_reads_every_parameter(weights):
    """A full forward of many tokens with the head reads every parameter of LLaDA2-mini
    (every routed expert of every layer) but the embedding table, of which it reads the
    rows gathered: in bfloat16, twice the parameter count less the table's other rows;
    int8 prices every kernel (the experts' too) at one byte plus float32 scales."""
    cfg = preset("llada2-mini")
    shape = CallShape("full", 8, 4096, 4096, 32, True, 4096)
    cost = call_cost(cfg, shape, weights)
    d, E, me = cfg.d_model, cfg.n_experts, cfg.moe_hidden
    moe_layers = cfg.n_layers - cfg.first_dense_layers
    assert cost.experts_read == moe_layers * E and cost.expert_share == 1.0
    table = cfg.vocab_size * d * 2
    gathered = 8 * 4096 * d * 2
    if weights == "bf16":
        assert cost.weight_bytes - gathered == 2 * 16_255_643_392 - table
        stored = quantize_lib.weight_bytes(nnx.state(abstract_model(cfg), nnx.Param))
        assert stored == 2 * 16_255_643_392
    else:  # gate and up [d, m] and down [m, d]: a scale per output channel
        one = 3 * d * me + (2 * me + d) * 4
        assert cost.bytes_experts == moe_layers * E * one


def test_expert_flops_grow_with_top_k_not_with_the_experts():
    cfg = preset("tiny-llada2-test")
    shape = CallShape("cached", 2, 16, 64, 16, True, 64)
    base = call_cost(cfg, shape, "f32")
    top4 = call_cost(cfg.replace(n_experts_per_tok=4), shape, "f32")
    wider = call_cost(cfg.replace(n_experts=16), shape, "f32")
    moe_layers = cfg.n_layers - cfg.first_dense_layers
    d, me, t = cfg.d_model, cfg.moe_hidden, 2 * 16
    assert base.flops_experts == 2.0 * moe_layers * t * cfg.n_experts_per_tok * 3 * d * me
    assert top4.flops_experts == 2 * base.flops_experts
    assert wider.flops_experts == base.flops_experts
    # Twice the experts: only the router's matmul grows (2 x tokens x d per expert).
    assert wider.flops - base.flops == 2.0 * moe_layers * t * d * cfg.n_experts
    assert top4.flops - base.flops == base.flops_experts


def test_dense_configs_read_no_experts():
    cost = call_cost(preset("llada-8b-instruct"), CallShape("cached", 1, 32, 640, 32, True,
                                                            640))
    assert cost.moe_layers == cost.experts == cost.experts_read == cost.bytes_experts == 0
    assert cost.expert_share == 0.0
