"""int8 weight-only quantization of the LLaDA2 mixture-of-experts model
(asynclane_jax.models.quantize): the stacked routed experts as int8 values [E, in, out]
with one float32 scale per (expert, output channel) [E, 1, out], applied to the grouped
matmuls' output rows; the router left in float32; the shared expert's Linears quantized
as any other. On the tiny random model (`tiny-llada2-test`)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asynclane_jax import aot, checkpoint, sharding
from asynclane_jax.models import abstract_model, moe, preset, quantize
from asynclane_jax.models.model import init_model

TINY = "tiny-llada2-test"  # 3 layers (the first dense), 8 experts [8, 32, 16], top-2


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _pure(model) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {jax.tree_util.keystr(p): v for p, v in flat}


def _routing(model, tokens, monkeypatch) -> list:
    """The experts `moe.route` chooses in each mixture-of-experts layer of an eager
    forward, and the logits."""
    seen, route = [], moe.route

    def recording(*a, **kw):
        experts, weights = route(*a, **kw)
        seen.append(np.asarray(experts))
        return experts, weights

    monkeypatch.setattr(moe, "route", recording)
    logits = np.asarray(model(tokens))
    monkeypatch.setattr(moe, "route", route)
    return seen, logits


def test_quantized_model_logits_close_and_routing_unchanged(monkeypatch):
    cfg = preset(TINY)
    model = init_model(cfg, seed=1)
    q = quantize.quantize_model(init_model(cfg, seed=1))
    assert quantize.quantization_of(model) is None and quantize.quantization_of(q) == "int8"
    # The router is not quantized: same float32 arrays.
    for i in range(cfg.first_dense_layers, cfg.n_layers):
        for name in ("kernel", "expert_bias"):
            a, b = (getattr(m.layers[i].mlp.gate, name)[...] for m in (model, q))
            assert b.dtype == jnp.float32
            np.testing.assert_array_equal(a, b)

    tokens = jax.random.randint(jax.random.key(2), (2, 24), 2, cfg.vocab_size)
    base_routes, base = _routing(model, tokens, monkeypatch)
    q_routes, logits = _routing(q, tokens, monkeypatch)
    assert len(base_routes) == len(q_routes) == cfg.n_layers - cfg.first_dense_layers
    for a, b in zip(base_routes, q_routes):  # the same experts for every token
        np.testing.assert_array_equal(a, b)
    diff = float(np.abs(logits - base).max())
    assert diff < 0.02 * float(np.abs(base).max()), diff
    # As the dense int8 test measures it: the KL of the next-token distributions.
    a, b = jax.nn.log_softmax(base), jax.nn.log_softmax(logits)
    kl = float((jnp.exp(a) * (a - b)).sum(-1).mean())
    assert 0 < kl < 1e-3, kl

    # Through split / merge under jit, as the decode runs it.
    run = jax.jit(lambda graphdef, s, t: nnx.merge(graphdef, s)(t), static_argnums=0)
    np.testing.assert_allclose(np.asarray(run(*nnx.split(q), tokens)), logits,
                               atol=1e-5, rtol=1e-5)


def _moe_inputs(cfg, n=40, seed=0):
    rng = np.random.default_rng(seed)
    E, d, m = cfg.n_experts, cfg.d_model, cfg.moe_hidden
    x = rng.standard_normal((n, d)).astype(np.float32)
    gate, up = (rng.standard_normal((E, d, m)).astype(np.float32) * 0.2 for _ in range(2))
    down = rng.standard_normal((E, m, d)).astype(np.float32) * np.linspace(0.05, 1, d)
    router = rng.standard_normal((d, E)).astype(np.float32)
    experts, weights = moe.route(x, router, np.zeros(E, np.float32),
                                 top_k=cfg.n_experts_per_tok, n_groups=cfg.n_expert_groups,
                                 topk_groups=cfg.n_topk_groups, scaling=cfg.routed_scaling)
    return x, experts, weights, gate, up, down


def test_routed_experts_int8_equals_dequantized_reference():
    cfg = preset(TINY)
    x, experts, weights, *kernels = _moe_inputs(cfg)
    quantized = [quantize.int8_weights(k) for k in kernels]
    for (values, scale), k in zip(quantized, kernels):
        assert values.dtype == jnp.int8 and values.shape == k.shape
        assert scale.dtype == jnp.float32 and scale.shape == (k.shape[0], 1, k.shape[2])
    values = [v for v, _ in quantized]
    scales = tuple(s for _, s in quantized)
    dequantized = [np.asarray(v, np.float32) * np.asarray(s) for v, s in quantized]

    got = moe.routed_experts(x, experts, weights, *values, jnp.float32, scales=scales)
    # The reference: token by token, expert by expert, with the dequantized weights.
    silu = lambda z: z / (1 + np.exp(-z))
    want = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(experts[t]), np.asarray(weights[t])):
            g, u, dn = (k[e] for k in dequantized)
            want[t] += w * ((silu(x[t] @ g) * (x[t] @ u)) @ dn)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
    # = moe.routed_experts with the dequantized float kernels, and the unsharded
    # sharding.routed_experts is the same function.
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(moe.routed_experts(x, experts, weights, *dequantized,
                                                       jnp.float32)), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(
        sharding.routed_experts(x, experts, weights, *values, jnp.float32, scales=scales), got)
    # In bfloat16 (the int8 values are exact in it), close to the float32 result.
    bf16 = moe.routed_experts(x, experts, weights, *values, jnp.bfloat16, scales=scales)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), want, atol=0.05, rtol=0.05)


def test_quantized_tree_names_and_bytes():
    cfg = preset(TINY)
    q = quantize.quantize_model(init_model(cfg, seed=0))
    arrays = _pure(q)
    E, d, m = cfg.n_experts, cfg.d_model, cfg.moe_hidden
    shapes = {"gate_proj": (E, d, m), "up_proj": (E, d, m), "down_proj": (E, m, d)}
    for i in range(cfg.first_dense_layers, cfg.n_layers):
        prefix = f"['layers'][{i}]['mlp']"
        for name, shape in shapes.items():
            values = arrays[f"{prefix}['experts']['{name}']"]
            scale = arrays[f"{prefix}['experts']['{name}_scale']"]
            assert values.dtype == jnp.int8 and values.shape == shape
            assert scale.dtype == jnp.float32 and scale.shape == (E, 1, shape[2])
            assert arrays[f"{prefix}['shared_experts']['{name}']['kernel']"].dtype == jnp.int8
        assert arrays[f"{prefix}['gate']['kernel']"].dtype == jnp.float32
        assert f"{prefix}['gate']['scale']" not in arrays
    # The values are int8_weights' of the float kernels (same seed, same init).
    float_model = init_model(cfg, seed=0)
    v, s = quantize.int8_weights(float_model.layers[1].mlp.experts.down_proj[...])
    np.testing.assert_array_equal(q.layers[1].mlp.experts.down_proj[...], v)
    np.testing.assert_array_equal(q.layers[1].mlp.experts.down_proj_scale[...], s)
    # Names: the scale has its kernel's, the contracted dimension unnamed; both are
    # split along the expert axis.
    experts = q.layers[1].mlp.experts
    assert tuple(experts.up_proj.get_metadata()["out_sharding"]) == (None, "embed", "mlp")
    assert tuple(experts.up_proj_scale.get_metadata()["out_sharding"]) == (None, None, "mlp")
    assert tuple(experts.down_proj_scale.get_metadata()["out_sharding"]) == \
        (None, None, "embed")
    # (the placement on 8 devices: tests/multidevice/test_llada2_int8_sharded.py)
    from jax.tree_util import DictKey as K
    path = (K("layers"), K(1), K("mlp"), K("experts"), K("up_proj_scale"))
    assert sharding.logical_names(path, (None, None, "mlp")) == ("expert", None, "mlp")

    # quantized_paths / quantized_names: the experts and the Linears, not the router.
    abstract = nnx.state(quantize.abstract_quantized(abstract_model(cfg)))
    paths = quantize.quantized_paths(abstract)
    assert ("layers", 1, "mlp", "experts", "gate_proj") in paths
    assert ("layers", 1, "mlp", "gate", "kernel") not in paths
    names = quantize.quantized_names(abstract)
    assert "layers.mlp.experts.down_proj" in names and "layers.mlp.gate.kernel" not in names

    # Bytes: the experts' drop about 4x from float32 (1 byte a weight + a float32 scale
    # per expert and output channel).
    def expert_bytes(state):
        return sum(quantize.weight_bytes(state["layers"][i]["mlp"]["experts"])
                   for i in range(cfg.first_dense_layers, cfg.n_layers))

    full = expert_bytes(nnx.state(abstract_model(cfg)))
    int8 = expert_bytes(abstract)
    assert int8 == full // 4 + 4 * (cfg.n_layers - 1) * E * (2 * m + d)
    # 3.43x here: the scales weigh 4 / in of the values, in = 16 or 32 at this size.
    assert 3.3 < full / int8 < 4.0, full / int8
    assert quantize.weight_bytes(abstract) < 0.4 * quantize.weight_bytes(
        nnx.state(abstract_model(cfg)))


def test_abstract_quantized_compiles_on_cpu():
    """The quantized model compiled from ShapeDtypeStructs alone (what `aot` lowers),
    here for the CPU: the int8 expert values are the program's arguments."""
    cfg = preset(TINY).replace(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params = nnx.split(quantize.abstract_quantized(abstract_model(cfg)))
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    lowered = fn.lower(params, tokens)
    int8 = [x for x in jax.tree.leaves(nnx.to_pure_dict(params)) if x.dtype == jnp.int8]
    assert len(int8) == 3 * 2 + 3 * 2 + 2 * 3 + 3 + 1  # experts, shared, attn, dense, head
    E, d, m = cfg.n_experts, cfg.d_model, cfg.moe_hidden
    text = lowered.as_text()
    assert f"tensor<{E}x{d}x{m}xi8>" in text and f"tensor<{E}x1x{m}xf32>" in text
    # (on CPU jax lowers ragged_dot to masked dense products; the TPU program's
    # grouped matmuls: test_aot_int8_on_a_v5e_slice)
    compiled = lowered.compile()
    assert compiled.as_text()


def test_load_and_convert_int8(tmp_path, capsys):
    """load(..., quantize="int8") of a float LLaDA2 folder quantizes each array as it is
    read (the router kept float) and equals quantize_model of the float model; the
    converter's --quantize int8 stores exactly that."""
    import importlib.util
    import pathlib

    import hf_reference as H

    spec = importlib.util.spec_from_file_location(
        "llada2_reference", pathlib.Path(__file__).parent / "test_llada2_reference.py")
    R = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(R)
    hf = R.hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, R.random_tensors(hf, seed=1),
                             layout="sharded", shards=2)
    rc, _, err = H.convert_cli(capsys, src, tmp_path / "f32", "--dtype", "float32")
    assert rc == 0, err
    rc, _, err = H.convert_cli(capsys, src, tmp_path / "int8", "--dtype", "float32",
                               "--quantize", "int8")
    assert rc == 0, err
    data = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert data["quantization"] == "int8"
    digests = json.loads((tmp_path / "int8" / "digests.json").read_text())["arrays"]
    assert digests["layers.1.mlp.experts.gate_proj"]["dtype"] == "int8"
    assert digests["layers.1.mlp.experts.gate_proj_scale"]["dtype"] == "float32"
    assert digests["layers.1.mlp.gate.kernel"]["dtype"] == "float32"

    float_model = checkpoint.load_model(tmp_path / "f32", verify=False)
    want = _pure(quantize.quantize_model(nnx.clone(float_model)))
    for folder, kw in [(tmp_path / "f32", {"quantize": "int8"}), (tmp_path / "int8", {})]:
        got = _pure(checkpoint.load_model(folder, verify=True, **kw))
        assert got.keys() == want.keys(), folder
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.mark.tpu_aot
@pytest.mark.skipif(not aot.tpu_compiler_available(), reason="libtpu is not installed")
def test_aot_int8_on_a_v5e_slice():
    """`aot --quantize int8` for LLaDA2: the experts split 8 ways with their scales, the
    arguments int8, no stacked expert kernel gathered."""
    cfg = preset(TINY)
    with jax.default_matmul_precision("default"):  # see tests/commands/test_aot_llada2.py
        kw = dict(sampler="d2f", gen_length=64, batch=4, prompt_len=32, topology="v5e:2x4",
                  mesh="tensor=8", dtype="bfloat16", keep_hlo=True)
        report = aot.compile_for_topology(TINY, quantize="int8", **kw)
    assert report.fits and report.quantize == "int8" and report.experts_per_chip == 1
    bf16 = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    assert report.param_bytes == quantize.weight_bytes(
        nnx.state(quantize.abstract_quantized(abstract_model(bf16))))
    E, d, m = cfg.n_experts, cfg.d_model, cfg.moe_hidden
    import re
    gathered = set(re.findall(r"= \w+(\[[\d,]*\])\S* all-gather(?:-start)?\(",
                              report.hlo_text))
    assert not {f"[{E},{d},{m}]", f"[{E},{m},{d}]"} & gathered, gathered
    assert "ragged-dot" in report.hlo_text
