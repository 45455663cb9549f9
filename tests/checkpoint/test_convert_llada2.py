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

from asynclane_jax import load
from asynclane_jax.checkpoint.verify import verify_folder
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


@pytest.mark.parametrize("flag", [["--scan-layers"]])  # --quantize: test_llada2_int8.py
def test_options_not_built_for_experts_are_refused(tmp_path, capsys, flag):
    src, _, _ = snapshot(tmp_path / "src")
    rc, _, err = run_cli(capsys, src, tmp_path / "dst", *flag)
    assert rc == 2 and "not built yet" in err and "nothing was written" in err
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path) == []


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
