"""Decoding sharded over 8 (fake CPU) devices gives the unsharded tokens, for every
sampler: on a 2x4 (data x tensor) mesh in both layer layouts (unrolled, and scanned with
the stacked parameters' layer axis unsharded; the scanned run once per kind of call),
and on a 1x8 mesh for the samplers whose calls differ (full and cached forwards of both
families); the parameters and the K/V cache sit where the rules table says; heads that
do not divide the tensor axis are handled."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import asynclane_jax
from asynclane_jax import checkpoint, sharding
from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.api import build_canvas, make_schedule
from asynclane_jax.models import init_model, tiny_dream
from asynclane_jax.testbed import evaluate, tasks

MESH, WIDE = "data=2,tensor=4", "data=1,tensor=8"
GEN = 96
# Every registered sampler, on the shipped model of the family it was written for (the
# shared ones on both). `wide`: also decoded on the 1x8 mesh (a tensor axis wider than
# the 4 heads: attention replicated, the MLP split 8 ways); `scanned`: also decoded by
# the scanned layout on the 2x4 mesh.
# vanilla and dream (no cache, a full forward per step) at a quarter of their default
# steps: the same program, a quarter of its run.
CASES = [("tiny-llada", "vanilla", {"steps": GEN // 4}),
         ("tiny-llada", "fast-dllm", {"cache": "dual"}),
         ("tiny-llada", "fast-dllm", {"cache": "prefix"}), ("tiny-llada", "localleap", {}),
         ("tiny-llada", "asynclane", {}), ("tiny-dream", "dream", {"steps": GEN // 4}),
         ("tiny-dream", "fast-dllm", {"cache": "dual"}), ("tiny-dream", "asynclane", {}),
         ("tiny-llada", "d2f", {}), ("tiny-llada-block-causal", "d2f", {}),
         ("tiny-llada", "eb", {}), ("tiny-dream-causal", "ar", {}),
         ("tiny-llada-block-causal", "llada2", {})]
WIDE_CASES = {("tiny-llada", "vanilla"), ("tiny-llada", "asynclane"), ("tiny-dream", "dream"),
              ("tiny-dream", "asynclane")}
UNSCANNED = {"tiny-llada-block-causal"}  # the scanned check covers d2f on tiny-llada
# Cases whose calls another case's scanned run makes already: LocalLeap's are Fast-dLLM
# dual's on tiny-llada, and tiny-dream's dual-cache calls are tiny-dream AsyncLane's
# (full and cached forwards with Dream's shift) less its extra queries.
SCANNED_ELSEWHERE = {("tiny-llada", "localleap"), ("tiny-dream", "fast-dllm")}
# Samplers whose attention the shipped diffusion models were not trained for.
UNTRAINED = {"d2f", "ar", "llada2"}


@pytest.fixture(autouse=True)
def one_call_kind_per_iteration(request):
    """Mixed calls off (the 2x4 mesh splits the batch, where the driver does not mix),
    so that every run of a case makes the same calls; `test_mixed_calls_on_a_tensor_mesh`
    mixes."""
    with driver.switched(driver.MIXED_CALLS, request.node.name.startswith("test_mixed_calls")):
        yield


@functools.cache
def shipped(name):
    if name == "tiny-llada-block-causal":  # d2f's cached, block-causal path
        model, tok, cfg = asynclane_jax.load("tiny-llada")
        model.cfg = cfg = cfg.replace(block_causal=True)
        return model, tok, cfg
    if name == "tiny-dream-causal":  # ar's causal cached path (a causal config)
        model, tok, cfg = asynclane_jax.load("tiny-dream")
        model.cfg = cfg = cfg.replace(causal=True)
        return model, tok, cfg
    return asynclane_jax.load(name)


@functools.cache
def scanned(name):
    if name == "tiny-dream-causal":
        model = checkpoint.load_model("tiny-dream", mesh=MESH, scan_layers=True)
        model.cfg = model.cfg.replace(causal=True)
        return model
    return checkpoint.load_model(name, mesh=MESH, scan_layers=True)


@functools.cache
def prompts():
    return evaluate.prompts_for(tasks.heldout(4))


def test_every_sampler_is_covered():
    assert {s for _, s, _ in CASES} == set(asynclane_jax.decoding.samplers())
    assert {s for _, s in WIDE_CASES} >= {"vanilla", "dream", "asynclane"}


@pytest.mark.parametrize("name,sampler,options", CASES,
                         ids=[f"{n}-{s}-{'-'.join(map(str, o.values()))}".rstrip("-")
                              for n, s, o in CASES])
def test_sharded_tokens_equal_unsharded(name, sampler, options):
    model, tok, cfg = shipped(name)
    kw = dict(tokenizer=tok, sampler=sampler, gen_length=GEN, **options)
    base = generate(model, prompts(), **kw)
    if sampler not in UNTRAINED:
        assert np.mean([tasks.check(p, t) for p, t in zip(tasks.heldout(4), base.text)]) > 0
    runs = {f"mesh {MESH}": lambda: generate(model, prompts(), mesh=MESH, **kw)}
    if (name, sampler) in WIDE_CASES:
        runs[f"mesh {WIDE}"] = lambda: generate(model, prompts(), mesh=WIDE, **kw)
    if name not in UNSCANNED and (name, sampler) not in SCANNED_ELSEWHERE:
        runs[f"scanned on {MESH}"] = lambda: generate(scanned(name), prompts(), **kw)
    for label, run in runs.items():
        res = run()
        np.testing.assert_array_equal(res.tokens, base.tokens, err_msg=label)
        assert res.stats.nfe == base.stats.nfe, label


def test_mixed_calls_on_a_tensor_mesh():
    """A 1x8 mesh does not split the batch: its decode mixes its calls (driver.mixing),
    with the unsharded mixed decode's tokens and calls (two rows: mixed parts of one
    row)."""
    model, tok, _ = shipped("tiny-llada")
    kw = dict(tokenizer=tok, sampler="asynclane", gen_length=GEN, refresh_travel=16)
    base = generate(model, prompts()[1:3], **kw)
    res = generate(model, prompts()[1:3], mesh=WIDE, **kw)
    assert res.stats.call_shapes == base.stats.call_shapes
    assert any(s.kind == "mixed" and n for s, n in zip(res.stats.call_shapes,
                                                       res.stats.shape_calls))
    np.testing.assert_array_equal(res.tokens, base.tokens)
    np.testing.assert_array_equal(res.stats.shape_calls, base.stats.shape_calls)


def _spec(plan, names, shape):
    return plan.sharding(names, shape).spec


def test_parameter_and_cache_placement():
    """The parameters follow the rules; the cache the loop carries is split by rows on
    the data axis and by K/V heads on the tensor axis (tiny-llada: 4 K/V heads)."""
    model, _, cfg = shipped("tiny-llada")
    plan = sharding.plan_for(cfg, "data=2,tensor=4")
    params = jax.device_put(nnx.state(model, nnx.Param),
                            plan.param_shardings(nnx.state(model, nnx.Param)))
    layer = params["layers"][0]
    assert layer["attn"]["q_proj"]["kernel"][...].sharding.spec == P(None, "tensor")
    assert layer["attn"]["k_proj"]["kernel"][...].sharding.spec == P(None, "tensor")
    assert layer["attn"]["o_proj"]["kernel"][...].sharding.spec == P("tensor", None)
    assert layer["mlp"]["down_proj"]["kernel"][...].sharding.spec == P("tensor", None)
    # A 159-token vocabulary does not divide by 4: replicated, not refused.
    assert params["embed"][...].sharding.spec == P(None, None)
    assert params["lm_head"]["kernel"][...].sharding.spec == P(None, None)

    on_8 = sharding.plan_for(cfg, "tensor=8")  # 4 heads on 8 devices: attention replicated
    assert dict(on_8.rules)["heads"] is None and dict(on_8.rules)["mlp"] == "tensor"

    schedule = make_schedule("fast-dllm", gen_length=GEN, cache="dual")
    canvas, pad_len, _ = build_canvas([[5, 6, 7]] * 4, GEN, cfg, 32)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, plan.param_shardings(state))
    args = (state, sharding.place(canvas, plan, sharding.TOKENS),
            sharding.place(pad_len, plan, sharding.ROWS),
            sharding.place(np.ones(4, bool), plan, sharding.ROWS), jax.random.key(0))
    loop = jax.jit(functools.partial(driver.decode_loop, graphdef, schedule=schedule))
    with sharding.use(plan):
        final = loop(*args)
    k = final.cache.k
    assert k.sharding.is_equivalent_to(
        plan.sharding(sharding.CACHE, k.shape), k.ndim), k.sharding
    assert plan.spec(sharding.CACHE, k.shape) == P(None, "data", None, "tensor", None)
    assert final.canvas.sharding.is_equivalent_to(
        plan.sharding(sharding.TOKENS, final.canvas.shape), 2)


def test_model_loaded_on_a_mesh_decodes_there():
    """generate() without mesh= uses the mesh the parameters are on, pads the rows to
    the batch axes, and compiles once for repeated shapes."""
    model, tok, cfg = shipped("tiny-llada")
    base = generate(model, prompts()[:3], tokenizer=tok, gen_length=GEN)
    placed = sharding.shard_model(nnx.clone(model), sharding.plan_for(cfg, "data=4,tensor=2"))
    assert sharding.mesh_of(placed).shape["data"] == 4
    res = generate(placed, prompts()[:3], tokenizer=tok, gen_length=GEN)
    np.testing.assert_array_equal(res.tokens, base.tokens)
    assert res.stats.batch_bucket == 4
    again = generate(placed, prompts()[:3], tokenizer=tok, gen_length=GEN)
    assert not again.stats.compiled
    one = generate(placed, prompts()[:1], tokenizer=tok, gen_length=GEN)  # 1 row -> 4
    np.testing.assert_array_equal(one.tokens, base.tokens[:1])


def _seven_one_model():
    """A tiny Dream-shaped model with 7 query heads and 1 key/value head (Dream-7B's
    28/4 per K/V head), its output head sharpened so greedy choices are clear."""
    cfg = tiny_dream().replace(n_heads=7, n_kv_heads=1, head_dim=16, d_model=112)
    model = init_model(cfg, seed=3)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 30.0
    return model, cfg


@pytest.mark.parametrize("heads", ["whole", "split"])
def test_seven_query_one_kv_head_on_four_way_tensor_axis(heads):
    model, cfg = _seven_one_model()
    rng = np.random.default_rng(0)
    ids = [[int(t) for t in rng.integers(0, cfg.vocab_size - 3, n)] for n in (5, 9)]
    kw = dict(sampler="asynclane", gen_length=32)
    base = generate(model, ids, **kw)
    plan = sharding.plan_for(cfg, "data=2,tensor=4", heads=heads)
    q = plan.param_shardings(nnx.state(model, nnx.Param))["layers"][0]["attn"]["q_proj"]
    if heads == "whole":  # 7 heads do not divide by 4: attention replicated, MLP split
        assert q["kernel"].get_value().spec == P(None, None)
        assert _spec(plan, ("embed", "mlp"), (112, cfg.mlp_hidden)) == P(None, "tensor")
    else:  # 7 * 16 = 112 columns split 4 ways: 28 columns each, cutting heads
        assert q["kernel"].get_value().spec == P(None, "tensor")
    res = generate(model, ids, mesh=plan, **kw)
    np.testing.assert_array_equal(res.tokens, base.tokens)
