"""`asynclane-jax convert` of LLaDA2 (`llada2_moe`) checkpoints: a tiny checkpoint in the
exact Hugging Face layout (safetensors shards, model.safetensors.index.json, config.json
with model_type llada2_moe, one tensor per routed expert) converted by the CLI, loaded,
and compared with the independent PyTorch reference (tests/models/
test_llada2_reference.py); per-expert tensors stacked into one array per layer; every
tensor used exactly once; streaming and atomic as for the dense families.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import hf_reference as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hostile import leftovers

from asynclane_jax import checkpoint, load
from asynclane_jax.checkpoint.verify import verify_folder
from asynclane_jax.models.model import stack_layer_params
from checkpoints_convert import convert as conv
from checkpoints_convert.export import hf_tensors

jax.config.update("jax_default_matmul_precision", "highest")

_spec = importlib.util.spec_from_file_location(
    "llada2_reference", pathlib.Path(__file__).parents[1] / "models" / "test_llada2_reference.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)

TOKENS = H.TOKENS


@nnx.jit
def forward(model, tokens):
    return model(tokens)


run_cli = H.convert_cli


def snapshot(folder, hf=None, tensors=None, *, shards=3, dtype=torch.float32):
    hf = hf or R.hf_config()
    tensors = tensors if tensors is not None else R.random_tensors(hf, seed=1, dtype=dtype)
    return H.write_checkpoint(folder, hf, tensors, layout="sharded", shards=shards), hf, tensors


def test_convert_sharded_snapshot_then_load_matches_reference(tmp_path, capsys):
    src, hf, tensors = snapshot(tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # experts spread over the shards
    rc, out, err = run_cli(capsys, src, tmp_path / "dst", "--dtype", "float32")
    assert rc == 0, err
    assert out.startswith(f"converted llada2: {len(tensors)} tensors")
    model, tokenizer, cfg = load(tmp_path / "dst", dtype="float32")
    assert tokenizer is not None and cfg.family == "llada2" and cfg.n_experts == 8
    ours = np.asarray(forward(model, jnp.asarray(TOKENS)))
    want = R.logits(hf, tensors, TOKENS)
    assert np.max(np.abs(ours - want)) <= 1e-4
    np.testing.assert_array_equal(ours.argmax(-1), want.argmax(-1))
    # one stacked array per projection and layer, expert e at index e
    stacked = np.asarray(model.layers[2].mlp.experts.down_proj[...])
    assert stacked.shape == (8, 16, 32)
    np.testing.assert_array_equal(
        stacked[5], tensors["model.layers.2.mlp.experts.5.down_proj.weight"].numpy().T)
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert saved["hf_config"] == hf and saved["model"]["family"] == "llada2"
    digests = json.loads((tmp_path / "dst" / "digests.json").read_text())
    assert "layers.1.mlp.experts.gate_proj" in json.dumps(digests)
    assert verify_folder(tmp_path / "dst") == len(tensors) - 2 * 3 * 8 + 2 * 3
    assert leftovers(tmp_path) == []


def test_bf16_experts_are_stored_exactly(tmp_path, capsys):
    src, _, tensors = snapshot(tmp_path / "src", dtype=torch.bfloat16)
    rc, _, err = run_cli(capsys, src, tmp_path / "dst")
    assert rc == 0, err
    model, _, cfg = load(tmp_path / "dst")
    assert cfg.param_dtype == "bfloat16"
    got = np.asarray(model.layers[1].mlp.experts.gate_proj[...], np.float32)
    for e in range(8):
        want = tensors[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].float().numpy().T
        np.testing.assert_array_equal(got[e], want)
    # the way back gives the published names and tensors
    back = hf_tensors(model)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        np.testing.assert_array_equal(back[name], t.float().numpy())


def _convert_fails(tmp_path, capsys, tensors, *messages):
    src, _, _ = snapshot(tmp_path / "src", tensors=tensors)
    rc, _, err = run_cli(capsys, src, tmp_path / "dst")
    assert rc == 2, err
    for m in messages:
        assert m in err, err
    assert "nothing was written" in err
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path) == []


def test_missing_expert_is_named(tmp_path, capsys):
    t = R.random_tensors(R.hf_config())
    del t["model.layers.2.mlp.experts.6.up_proj.weight"]
    _convert_fails(tmp_path, capsys, t, "1 missing tensors",
                   "model.layers.2.mlp.experts.6.up_proj.weight")


def test_expert_beyond_the_config_is_refused(tmp_path, capsys):
    t = R.random_tensors(R.hf_config())
    t["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(16, 32)
    _convert_fails(tmp_path, capsys, t, "tensors the config has no parameter for",
                   "model.layers.1.mlp.experts.8.up_proj.weight -> "
                   "layers.1.mlp.experts.up_proj[8]")


def test_experts_in_a_dense_layer_are_refused(tmp_path, capsys):
    t = R.random_tensors(R.hf_config())
    t["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(16, 32)
    t["model.layers.0.mlp.gate.expert_bias"] = torch.zeros(8)
    _convert_fails(tmp_path, capsys, t, "2 tensors the config has no parameter for")


def test_misshaped_expert_is_named(tmp_path, capsys):
    t = R.random_tensors(R.hf_config())
    t["model.layers.1.mlp.experts.3.down_proj.weight"] = torch.zeros(16, 32)
    _convert_fails(tmp_path, capsys, t, "model.layers.1.mlp.experts.3.down_proj.weight has "
                   "shape [16, 32], the config needs [32, 16]")


def test_nonfinite_expert_is_refused(tmp_path, capsys):
    t = R.random_tensors(R.hf_config())
    t["model.layers.2.mlp.experts.4.gate_proj.weight"][0, 0] = float("nan")
    _convert_fails(tmp_path, capsys, t, "NaN or infinite", "layers.2.mlp.experts.gate_proj[*]")


def test_scan_layers_stacks_dense_and_expert_layers(tmp_path, capsys):
    """--scan-layers on a LLaDA2 checkpoint: the dense first layer and the expert layers
    stacked apart (`layers.dense`, `layers.moe`); the reference's logits; read back into
    the unrolled layout exactly; int8 quantized on read into either layout, or at
    conversion, the same arrays."""
    src, hf, tensors = snapshot(tmp_path / "src")
    rc, _, err = run_cli(capsys, src, tmp_path / "flat", "--dtype", "float32")
    assert rc == 0, err
    rc, _, err = run_cli(capsys, src, tmp_path / "stacked", "--dtype", "float32",
                         "--scan-layers")
    assert rc == 0, err
    digests = json.loads((tmp_path / "stacked" / "digests.json").read_text())["arrays"]
    assert digests["layers.moe.mlp.experts.down_proj"]["shape"] == [2, 8, 16, 32]
    assert digests["layers.dense.mlp.down_proj.kernel"]["shape"] == [1, 64, 32]
    assert verify_folder(tmp_path / "stacked") == len(digests)
    model, _, cfg = load(tmp_path / "stacked")
    assert cfg.scan_layers
    ours = np.asarray(forward(model, jnp.asarray(TOKENS)))
    want = R.logits(hf, tensors, TOKENS)
    assert np.max(np.abs(ours - want)) <= 1e-4
    np.testing.assert_array_equal(ours.argmax(-1), want.argmax(-1))
    np.testing.assert_array_equal(
        np.asarray(model.layers.moe.mlp.experts.down_proj[...])[1, 5],
        tensors["model.layers.2.mlp.experts.5.down_proj.weight"].numpy().T)

    def params(folder, **kw):
        return checkpoint.params_to_numpy(checkpoint.load_model(tmp_path / folder, **kw))

    H.assert_trees_equal(params("stacked", scan_layers=False), params("flat"))
    int8 = checkpoint.load_model(tmp_path / "flat", quantize="int8")
    assert np.asarray(int8.layers[2].mlp.experts.up_proj[...]).dtype == np.int8
    int8_stacked = stack_layer_params(checkpoint.params_to_numpy(int8), 3,
                                      cfg.layer_stacks())
    H.assert_trees_equal(params("flat", scan_layers=True, quantize="int8"), int8_stacked)
    H.assert_trees_equal(params("stacked", quantize="int8"), int8_stacked)
    rc, _, err = run_cli(capsys, src, tmp_path / "stacked8", "--dtype", "float32",
                         "--scan-layers", "--quantize", "int8")
    assert rc == 0, err
    H.assert_trees_equal(params("stacked8"), int8_stacked)
    assert leftovers(tmp_path) == []


def test_lora_merged_into_experts_and_fused_attention(tmp_path, capsys):
    """A LoRA adapter on the fused q/k/v, the attention output, and every SwiGLU
    projection (the dense layer's, each routed expert's and the shared expert's) merged
    at conversion, each expert's merge in its slice of the stacked array: the
    reference's logits on the weights merged in torch."""
    src, hf, base = snapshot(tmp_path / "src")
    merged = H.write_lora_adapter(tmp_path / "lora", base, [
        "query_key_value", "dense", "gate_proj", "up_proj", "down_proj"])
    n = sum(not torch.equal(merged[k], base[k]) for k in base)
    assert n == 3 * 2 + 3 + 2 * (8 + 1) * 3  # attention, dense MLP, experts + shared
    rc, out, err = run_cli(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora",
                           "--dtype", "float32")
    assert rc == 0, err
    assert f"{n} LoRA-merged" in out
    model, _, _ = load(tmp_path / "dst")
    ours = np.asarray(forward(model, jnp.asarray(TOKENS)))
    want = R.logits(hf, merged, TOKENS)
    assert np.max(np.abs(ours - want)) <= 2e-4
    np.testing.assert_array_equal(ours.argmax(-1), want.argmax(-1))
    assert np.max(np.abs(ours - R.logits(hf, base, TOKENS))) > 1e-2
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].mlp.experts.up_proj[...])[6],
        merged["model.layers.1.mlp.experts.6.up_proj.weight"].numpy().T)


def test_interrupted_conversion_leaves_nothing(tmp_path):
    src, _, _ = snapshot(tmp_path / "src")
    seen = []

    def on_tensor(name):
        seen.append(name)
        if len(seen) == 20:  # midway through the experts
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conv.convert(str(src), tmp_path / "dst", progress=False, on_tensor=on_tensor)
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path) == []
