"""ModelConfig from real Hugging Face config.json files, refusals, and `info`."""

from __future__ import annotations

import json

import hf_reference as H
import pytest

from asynclane_jax.cli import main
from asynclane_jax.models import ConfigError, from_hf_config, preset

LLADA_8B = H.llada_8b_hf_config()
DREAM_7B = H.dream_7b_hf_config()

ARCH = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
        "mlp_hidden", "rope_theta", "norm_eps", "qkv_bias", "tie_embeddings", "logit_shift",
        "mask_token_id", "eos_token_id", "pad_token_id", "max_seq_len", "dtype", "param_dtype")


@pytest.mark.parametrize("hf, name", [(LLADA_8B, "llada-8b-instruct"),
                                      (DREAM_7B, "dream-7b-instruct")])
def test_real_configs_reproduce_presets(hf, name):
    got, want = from_hf_config(hf), preset(name)
    assert {k: getattr(got, k) for k in ARCH} == {k: getattr(want, k) for k in ARCH}


def test_llada_mlp_ratio_fallback_and_gqa():
    hf = dict(LLADA_8B, mlp_hidden_size=None, n_kv_heads=8)
    cfg = from_hf_config(hf)
    assert cfg.mlp_hidden == 4 * 4096 and cfg.n_kv_heads == 8


def test_dtype_override():
    assert from_hf_config(DREAM_7B, dtype="float32").param_dtype == "float32"


@pytest.mark.parametrize("hf, field", [
    (dict(LLADA_8B, alibi=True), "alibi"),
    (dict(LLADA_8B, include_bias=True), "include_bias"),
    (dict(LLADA_8B, clip_qkv=8.0), "clip_qkv"),
    (dict(LLADA_8B, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(LLADA_8B, layer_norm_type="default"), "layer_norm_type"),
    (dict(LLADA_8B, activation_type="swiglu"), "activation_type"),
    (dict(LLADA_8B, block_type="sequential"), "block_type"),
    (dict(LLADA_8B, input_emb_norm=True), "input_emb_norm"),
    (dict(LLADA_8B, bias_for_layer_norm=True), "bias_for_layer_norm"),
    (dict(DREAM_7B, use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
    (dict(DREAM_7B, rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(DREAM_7B, hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_fields_raise(hf, field):
    with pytest.raises(ConfigError, match=field):
        from_hf_config(hf)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        from_hf_config(dict(LLADA_8B, alibi=True, clip_qkv=8.0, include_bias=True))
    assert all(f in str(e.value) for f in ("alibi", "clip_qkv", "include_bias"))


def test_unsupported_model_type():
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("name, params", [("llada-8b-instruct", 8_015_581_184),
                                          ("dream-7b-instruct", 7_615_616_512)])
def test_info_cli_param_counts(name, params, capsys):
    assert main(["info", "--preset", name, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == params
