"""ModelConfig from real Hugging Face config.json files, refusals, and `info`."""

from __future__ import annotations

import json

import hf_reference as H
import pytest

from asynclane_jax.cli import main
from asynclane_jax.models import ConfigError, from_hf_config, preset
from asynclane_jax.models.config import hf_family

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


@pytest.mark.parametrize("hf", [dict(LLADA_8B, clip_qkv="a\nb" * 40),
                                dict(LLADA_8B, rope_scaling="\n"),
                                dict(DREAM_7B, rope_scaling="x\ny")])
def test_a_refused_value_is_shown_on_one_short_line(hf):
    with pytest.raises(ConfigError) as e:
        from_hf_config(hf)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200, str(e.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        from_hf_config(dict(LLADA_8B, alibi=True, clip_qkv=8.0, include_bias=True))
    assert all(f in str(e.value) for f in ("alibi", "clip_qkv", "include_bias"))


def test_unsupported_model_type():
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("overrides, message", [
    # LLaDA-MoE: a relative whose names contain "llada", with another schema.
    ({"model_type": "llada_moe", "architectures": ["LLaDAMoEModelLM"]},
     "unsupported model_type 'llada_moe'"),
    ({"model_type": "lladamoe", "architectures": ["LLaDAMoEModelLM"]},
     "unsupported model_type 'lladamoe'"),
    ({"model_type": "dream_coder"}, "unsupported model_type 'dream_coder'"),
    ({"model_type": None, "architectures": ["LLaDAMoEModelLM"]},
     r"no model_type, architectures \['LLaDAMoEModelLM'\]"),
    ({"model_type": "llada", "architectures": ["LLaDAMoEModelLM"]},
     r"unsupported architectures \['LLaDAMoEModelLM'\] for model_type 'llada'"),
])
def test_family_detection_is_exact(overrides, message):
    hf = dict(LLADA_8B, num_experts=64, **overrides)
    with pytest.raises(ConfigError, match=message) as e:
        from_hf_config(hf)
    assert "missing" not in str(e.value)  # refused for its type, not a schema field


def test_family_from_exact_architecture_without_model_type():
    hf = {k: v for k, v in LLADA_8B.items() if k != "model_type"}
    assert hf_family(hf) == "llada" and from_hf_config(hf).d_model == 4096
    assert hf_family(dict(DREAM_7B, model_type="Dream")) == "dream"


def test_instruct_presets_stop_at_end_of_turn():
    # The published config.json files name no end-of-turn token (the converter takes it
    # from the tokenizer files); the instruct presets carry it, the base presets do not.
    assert from_hf_config(LLADA_8B).stop_token_ids == (126081,)
    assert preset("llada-8b-instruct").stop_token_ids == (126081, 126348)
    assert preset("dream-7b-instruct").stop_token_ids == (151643, 151645)
    assert preset("llada-8b-base").stop_token_ids == (126081,)
    assert preset("dream-7b-base").stop_token_ids == (151643,)


@pytest.mark.parametrize("name, params", [("llada-8b-instruct", 8_015_581_184),
                                          ("dream-7b-instruct", 7_615_616_512)])
def test_info_cli_param_counts(name, params, capsys):
    assert main(["info", "--preset", name, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == params
