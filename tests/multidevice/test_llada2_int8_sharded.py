"""The int8 LLaDA2 model (asynclane_jax.models.quantize: int8 stacked experts with one
scale per expert and output channel) sharded over 8 (fake CPU) devices: the int8 values
and their scales split along the expert axis together, the expert-parallel routed
experts (`sharding.routed_experts` with scales) equal the unsharded ones, and the
model's logits equal the single-device int8 model's."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from expert_hlo import assert_no_expert_kernel_gathered
from flax import nnx
from jax.sharding import PartitionSpec as P

from asynclane_jax import sharding
from asynclane_jax.models import init_model, moe, preset, quantize

MESHES = ["data=2,tensor=4", "tensor=8", "fsdp=2,tensor=4"]


@functools.cache
def tiny():
    cfg = preset("tiny-llada2-test")
    return quantize.quantize_model(init_model(cfg, seed=3)), cfg


def test_int8_experts_and_scales_split_on_the_expert_axis():
    model, cfg = tiny()
    plan = sharding.plan_for(cfg, "data=2,tensor=4")
    placed = sharding.shard_model(nnx.clone(model), plan)
    experts = nnx.state(placed, nnx.Param)["layers"][1]["mlp"]["experts"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert experts[name][...].dtype == np.int8
        assert experts[name][...].sharding.spec == P("tensor", None, None), name
        assert experts[f"{name}_scale"][...].sharding.spec == P("tensor", None, None), name


@pytest.mark.parametrize("mesh", MESHES)
def test_expert_parallel_int8_routed_experts(mesh):
    _, cfg = tiny()
    rng = np.random.default_rng(0)
    E, d, m, n = cfg.n_experts, cfg.d_model, cfg.moe_hidden, 40
    x = rng.standard_normal((n, d)).astype(np.float32)
    kernels = [rng.standard_normal(s).astype(np.float32) * 0.2
               for s in ((E, d, m), (E, d, m), (E, m, d))]
    quantized = [quantize.int8_weights(k) for k in kernels]
    values = [v for v, _ in quantized]
    scales = tuple(s for _, s in quantized)
    experts, weights = moe.route(x, rng.standard_normal((d, E)).astype(np.float32),
                                 np.zeros(E, np.float32), top_k=cfg.n_experts_per_tok,
                                 n_groups=cfg.n_expert_groups,
                                 topk_groups=cfg.n_topk_groups, scaling=cfg.routed_scaling)
    base = moe.routed_experts(x, experts, weights, *values, np.float32, scales=scales)

    plan = sharding.plan_for(cfg, mesh)
    split = lambda a: jax.device_put(a, plan.sharding(("expert", None, None), a.shape))
    args = (x, experts, weights, *map(split, values))
    placed_scales = tuple(map(split, scales))

    def run(x, e, w, gate, up, down, scales):
        with sharding.use(plan):
            return sharding.routed_experts(x, e, w, gate, up, down, np.float32, scales=scales)

    fn = jax.jit(run)
    np.testing.assert_allclose(np.asarray(fn(*args, placed_scales)), np.asarray(base),
                               atol=1e-5, rtol=1e-5)
    assert_no_expert_kernel_gathered(fn.lower(*args, placed_scales).compile().as_text(), cfg)


@pytest.mark.parametrize("mesh", ["data=2,tensor=4", "tensor=8"])
def test_sharded_int8_logits_equal_single_device(mesh):
    model, cfg = tiny()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size - 3, (4, 24)).astype(np.int32)
    graphdef, state = nnx.split(model)
    base = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)

    plan = sharding.plan_for(cfg, mesh)
    graphdef, state = nnx.split(sharding.shard_model(nnx.clone(model), plan))

    def forward(s, t):
        with sharding.use(plan):
            return nnx.merge(graphdef, s)(t)

    out = jax.jit(forward)(state, sharding.place(tokens, plan, sharding.TOKENS))
    np.testing.assert_allclose(np.asarray(out), np.asarray(base), atol=2e-5, rtol=1e-5)
