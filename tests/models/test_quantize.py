"""int8 weight-only quantization (asynclane_jax.models.quantize, load(quantize="int8"),
--quantize on the command lines)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import asynclane_jax
from asynclane_jax import aot, cli, sharding
from asynclane_jax.models import abstract_model, quantize, tiny_llada
from asynclane_jax.models.model import DiffusionLM, init_model


def _kernels(model) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {jax.tree_util.keystr(p): v for p, v in flat}


def test_int8_weights_error_bounded_per_channel():
    w = jax.random.normal(jax.random.key(0), (48, 24)) * jnp.linspace(0.01, 3.0, 24)
    int8_weights = jax.jit(quantize.int8_weights)
    values, scale = int8_weights(w)
    assert values.dtype == jnp.int8 and scale.shape == (1, 24) and scale.dtype == jnp.float32
    # qwix's symmetric int8: scale = absmax / 127.5, so each channel's largest weight
    # lands on 127 or -127 / -128 (+127.5 rounds up and saturates at 127).
    np.testing.assert_allclose(scale[0], jnp.abs(w).max(0) / 127.5, rtol=1e-6)
    v = jnp.abs(values.astype(jnp.int32)).max(0)
    assert bool(jnp.all((v == 127) | (v == 128)))
    err = jnp.abs(values.astype(jnp.float32) * scale - w)
    assert bool(jnp.all(err <= scale / 2 * (1 + 1e-5)))  # rounding: half a step at most
    # A stacked kernel [L, in, out]: each layer as if quantized alone.
    stacked = jnp.stack([w, 2 * w, w[::-1]])
    sv, ss = int8_weights(stacked)
    assert ss.shape == (3, 1, 24)
    for i in range(3):
        v1, s1 = int8_weights(stacked[i])
        np.testing.assert_array_equal(sv[i], v1)
        np.testing.assert_allclose(ss[i], s1, rtol=1e-7)


def test_quantized_model_stores_int8_and_stays_close():
    cfg = tiny_llada()
    model = init_model(cfg, seed=1)
    q = quantize.quantize_model(init_model(cfg, seed=1))
    assert quantize.quantization_of(model) is None and quantize.quantization_of(q) == "int8"
    arrays = _kernels(q)
    kernels = {k: v for k, v in arrays.items() if k.endswith("['kernel']")}
    assert len(kernels) == 7 * cfg.n_layers + (0 if cfg.tie_embeddings else 1)
    assert all(v.dtype == jnp.int8 for v in kernels.values())
    # q / k / v keep their int8 values [out, in] (scale [out, 1]), the others [in, out].
    assert quantize.out_in_layers(q) == ("k_proj", "q_proj", "v_proj")
    float_kernels = _kernels(model)
    for k, v in kernels.items():
        scale = arrays[k.replace("['kernel']", "['scale']")]
        if any(f"['{name}']" in k for name in ("q_proj", "k_proj", "v_proj")):
            assert v.shape == float_kernels[k].shape[::-1] and scale.shape == (v.shape[0], 1)
        else:
            assert v.shape == float_kernels[k].shape and scale.shape == (1, v.shape[1])
    assert all(v.dtype != jnp.int8 for k, v in arrays.items() if not k.endswith("['kernel']"))
    # The scale is named as its kernel, the contracted dimension unnamed; a transposed
    # kernel's names are transposed with it.
    attn = q.layers[0].attn
    assert tuple(attn.q_proj.kernel.get_metadata()["out_sharding"]) == ("heads", "embed")
    assert tuple(attn.q_proj.scale.get_metadata()["out_sharding"]) == ("heads", None)
    assert tuple(attn.o_proj.kernel.get_metadata()["out_sharding"]) == ("heads", "embed")
    assert tuple(attn.o_proj.scale.get_metadata()["out_sharding"]) == (None, "embed")
    # The transposed values are the [in, out] quantization's, transposed.
    values, scale = quantize.int8_weights(model.layers[0].attn.q_proj.kernel[...])
    np.testing.assert_array_equal(attn.q_proj.kernel[...], values.T)
    np.testing.assert_array_equal(attn.q_proj.scale[...], scale.T)
    # Through split / merge under jit, as the decode runs it.
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 2, cfg.vocab_size)
    run = jax.jit(lambda graphdef, s, t: nnx.merge(graphdef, s)(t), static_argnums=0)
    a = jax.nn.log_softmax(run(*nnx.split(model), tokens))
    b = jax.nn.log_softmax(run(*nnx.split(q), tokens))
    kl = float((jnp.exp(a) * (a - b)).sum(-1).mean())
    assert 0 < kl < 1e-3, kl


def test_abstract_model_and_shardings():
    cfg = tiny_llada()
    abstract = quantize.abstract_quantized(abstract_model(cfg))
    state = nnx.state(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    assert abstract.layers[0].mlp.down_proj.kernel.dtype == jnp.int8
    full = quantize.weight_bytes(nnx.state(abstract_model(cfg)))
    assert quantize.weight_bytes(state) < 0.5 * full
    plan = sharding.plan_for(cfg, "tensor")
    specs = plan.param_shardings(nnx.state(abstract, nnx.Param))
    assert specs["layers"][0]["mlp"]["gate_proj"]["scale"].get_value().spec[0] is None


def test_load_int8_as_quantized_after_load_and_tokens_agree():
    model, tok, cfg = asynclane_jax.load("tiny-llada")
    q, _, _ = asynclane_jax.load("tiny-llada", quantize="int8")
    by_hand = quantize.quantize_model(nnx.clone(model))
    a, b = _kernels(q), _kernels(by_hand)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed.evaluate import prompts_for

    prompts = prompts_for(tasks.split("heldout", 8), tok)
    kw = dict(sampler="vanilla", gen_length=32, steps=32, block_length=32)
    full = asynclane_jax.generate(model, prompts, tokenizer=tok, **kw).tokens
    int8 = asynclane_jax.generate(q, prompts, tokenizer=tok, **kw).tokens
    assert float((full == int8).mean()) >= 0.9


def test_bad_mode_refused():
    with pytest.raises(quantize.QuantizeError, match="expected one of none, int8"):
        asynclane_jax.load("tiny-llada", quantize="int4")
    assert quantize.check_mode("none") is None and quantize.check_mode("INT8") == "int8"


def test_cli_flag_refuses_bad_value(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--quantize", "int4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--quantize" in err and "invalid choice: 'int4'" in err and "int8" in err


def test_cli_info_int8_bytes(capsys):
    assert cli.main(["info", "--preset", "llada-8b-instruct", "--quantize", "int8"]) == 0
    out = capsys.readouterr().out
    assert "14.93 GiB in bfloat16" in out and "7.95 GiB with int8" in out


@pytest.mark.skipif(not aot.tpu_compiler_available(), reason="libtpu is not installed")
def test_aot_int8_arguments_are_int8():
    cfg = tiny_llada(vocab_size=256)
    kw = dict(sampler="fast-dllm", gen_length=32, batch=1, prompt_len=32,
              topology="v5e:1x1", dtype="bfloat16")
    report = aot.compile_for_topology(cfg, quantize="int8", **kw)
    assert report.quantize == "int8"
    abstract = quantize.abstract_quantized(abstract_model(
        cfg.replace(dtype="bfloat16", param_dtype="bfloat16")))
    assert report.param_bytes == quantize.weight_bytes(nnx.state(abstract))
    # The program's arguments are the int8 weights (plus the canvas and a few vectors).
    assert report.param_bytes <= report.argument_bytes < report.param_bytes + 64 * 1024
    arrays = _kernels(abstract)
    linear = sum(x.size for p, x in arrays.items() if p.endswith("['kernel']"))
    scales = sum(x.size for p, x in arrays.items()
                 if p.endswith("['scale']") and p.replace("scale", "kernel") in arrays)
    bf16 = quantize.weight_bytes(nnx.state(
        nnx.eval_shape(lambda: DiffusionLM(cfg.replace(dtype="bfloat16",
                                                       param_dtype="bfloat16"),
                                           rngs=nnx.Rngs(0)))))
    # One byte instead of two per linear weight, plus a float32 scale per output channel.
    assert report.param_bytes == bf16 - linear + 4 * scales


# ------------------------------------------------------------ int8 stored by the converter

def _convert(tmp_path, name, *flags):
    import hf_reference as H

    from checkpoints_convert.cli import main as convert_main

    src = tmp_path / "src"
    if not src.exists():
        hf = H.llada_hf_config()
        H.write_checkpoint(src, hf, H.random_tensors(hf, seed=4), layout="single")
    assert convert_main([str(src), str(tmp_path / name), "--no-progress", *flags]) == 0
    return tmp_path / name


def _pure(model) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def test_converter_stores_int8_that_loads_as_the_load_time_quantization(tmp_path):
    """`convert --quantize int8` stores int8 kernels and their scales (config.json says
    so; digests checked on load): loading it gives exactly what load(quantize="int8")
    makes of the float folder, in either layer layout, with or without quantize=."""
    import json

    from asynclane_jax import checkpoint

    float_dir = _convert(tmp_path, "f32", "--dtype", "float32")
    int8_dir = _convert(tmp_path, "int8", "--dtype", "float32", "--quantize", "int8")
    stacked_dir = _convert(tmp_path, "int8-stacked", "--dtype", "float32", "--quantize",
                           "int8", "--scan-layers")
    assert json.loads((int8_dir / "config.json").read_text())["quantization"] == "int8"
    assert "quantization" not in json.loads((float_dir / "config.json").read_text())
    stored = {d: json.loads((d / "digests.json").read_text())["arrays"]
              for d in (float_dir, int8_dir)}
    kernels = [k for k in stored[float_dir] if k.endswith("kernel")]
    assert kernels and all(stored[int8_dir][k]["dtype"] == "int8" for k in kernels)
    assert all(stored[float_dir][k]["dtype"] == "float32" for k in kernels)
    assert all(stored[int8_dir][k[:-len("kernel")] + "scale"]["dtype"] == "float32"
               for k in kernels)

    want = _pure(checkpoint.load_model(float_dir, quantize="int8", verify=False))
    for folder, kw in [(int8_dir, {}), (int8_dir, {"quantize": "int8"}),
                       (stacked_dir, {"scan_layers": False})]:
        model = checkpoint.load_model(folder, verify=True, **kw)
        assert quantize.quantization_of(model) == "int8"
        got = _pure(model)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{folder.name} {k}")
    stacked = checkpoint.load_model(stacked_dir)
    assert stacked.cfg.scan_layers and stacked.layers.mlp.up_proj.kernel[...].dtype == jnp.int8
    tokens = jnp.asarray([[5, 9, 2, 7]])
    ref = checkpoint.load_model(float_dir, quantize="int8")
    np.testing.assert_allclose(np.asarray(stacked(tokens)), np.asarray(ref(tokens)),
                               rtol=1e-5, atol=1e-5)


def test_saved_quantized_model_round_trips_and_bad_mode_is_refused(tmp_path):
    import json

    from asynclane_jax import checkpoint
    from asynclane_jax.checkpoint import CheckpointError

    model = quantize.quantize_model(init_model(tiny_llada(), seed=2))
    folder = checkpoint.save(tmp_path / "q", model)
    assert json.loads((folder / "config.json").read_text())["quantization"] == "int8"
    back = checkpoint.load_model(folder)
    a, b = _pure(model), _pure(back)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["int8_out_in"] == ["k_proj", "q_proj", "v_proj"]
    # int8 weights written before q / k / v were kept [out, in] say nothing of it:
    # refused in one line that says how to make them again, never read transposed.
    legacy = dict(cfg)
    del legacy["int8_out_in"]
    (folder / "config.json").write_text(json.dumps(legacy))
    with pytest.raises(CheckpointError, match=r"keep None as \[out, in\].*keeps \['k_proj', "
                                              r"'q_proj', 'v_proj'\]; convert the float "
                                              r"checkpoint again with --quantize int8"):
        checkpoint.load_model(folder)
    cfg["quantization"] = "int4"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization 'int4'; this asynclane-jax "
                                              "reads int8"):
        checkpoint.load_model(folder)


def test_qkv_read_their_kernels_in_place():
    """What lets the TPU compiler read the q / k / v kernels as stored: their int8
    values kept [out, in], their float outputs behind an optimization barrier (an
    identity: the logits equal a model without it)."""
    cfg = tiny_llada()
    model = init_model(cfg, seed=4)
    attn = model.layers[0].attn
    assert attn.q_proj.float_barrier and attn.k_proj.float_barrier and attn.v_proj.float_barrier
    assert not attn.o_proj.float_barrier and not model.layers[0].mlp.up_proj.float_barrier
    tokens = jnp.asarray([[5, 9, 2, 7, 1, 1]])
    graphdef, state = nnx.split(model)
    text = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).as_text()
    assert text.count("optimization_barrier") == 3 * cfg.n_layers
    with_barrier = np.asarray(model(tokens))
    for layer in model.layers:
        for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
            proj.float_barrier = False
    np.testing.assert_array_equal(with_barrier, np.asarray(model(tokens)))
