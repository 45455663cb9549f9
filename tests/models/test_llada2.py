"""LLaDA2 (mixture of experts, `llada2_moe`): the config (presets, exact parameter
counts, the published config.json read field by field, clear errors), the routing and
expert arithmetic (asynclane_jax.models.moe), and parity of our model, holding weights
given under the published tensor names through the converter's table, with the
independent PyTorch reference of tests/models/test_llada2_reference.py: logits within
1e-4 and equal argmax, with routing ties and with the group limit changing the experts.
"""

from __future__ import annotations

import dataclasses
import json

import hf_reference as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_llada2_reference as R
import torch
from flax import nnx

from asynclane_jax.cli import main
from asynclane_jax.models import (
    ConfigError,
    ModelConfig,
    from_hf_config,
    param_stats,
    preset,
)
from asynclane_jax.models import moe as moe_lib
from asynclane_jax.models.config import (
    LLADA2_FIELDS,
    LLaDA2Config,
    n_active_params,
    n_params,
)
from checkpoints_convert.names import expected_sources

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 1e-4

# inclusionAI/LLaDA2.0-mini's config.json: the fields and values that copies of it in
# public code show (docs/llada2.md says what was and was not seen).
LLADA2_MINI = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "dtype": "bfloat16", "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "max_position_embeddings": 32768, "moe_intermediate_size": 512,
    "moe_router_enable_expert_bias": True, "n_group": 8, "norm_head": False,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4,
    "num_shared_experts": 1, "output_router_logits": False, "pad_token_id": 156892,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_theta": 600000,
    "routed_scaling_factor": 2.5, "score_function": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "use_qk_norm": True, "use_qkv_bias": False, "vocab_size": 157184,
}
# Other fields the authors' modelling code reads or its config class may write, at the
# values that leave the computation as published: read without complaint.
OTHER_FIELDS = {
    "use_bias": False, "rope_scaling": None, "use_cache": True, "attention_dropout": 0.0,
    "embedding_dropout": 0.0, "output_dropout": 0.0, "max_window_layers": 20,
    "rotary_dim": 64, "num_nextn_predict_layers": 0, "router_dtype": "fp32",
    "use_rmsnorm": True, "use_sliding_window": False, "torch_dtype": "bfloat16",
    "moe_shared_expert_intermediate_size": 512, "transformers_version": "x",
}

# The size of the published LLaDA2.0-mini safetensors index ("total_size"): every tensor
# bfloat16, the routers' expert_bias included.
LLADA2_MINI_BYTES = 32_511_286_784


# --------------------------------------------------------------------------- config

def test_mini_preset_has_the_published_size(capsys):
    cfg = preset("llada2-mini")
    stats = param_stats(cfg)
    assert stats["params"] * 2 == LLADA2_MINI_BYTES
    assert n_params(cfg.to_dict()) == stats["params"]
    assert sum(np.prod(s) for s in expected_sources(cfg).values()) == stats["params"]
    assert main(["info", "--preset", "llada2-mini", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == stats["params"] and out["config"]["n_experts"] == 256


# The parameter figures the LLaDA2.0 model cards give, activated per token and activated
# without the embedding and head, as (digits, unit): the cards truncate, so 1,432,973,056
# is "1.4B" and 789,147,392 is "789M".
PUBLISHED_ACTIVE = {"llada2-mini": ((14, 10**8), (789, 10**6)),
                    "llada2-flash": ((61, 10**8), (48, 10**8))}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_parameters_match_the_model_cards(name):
    cfg = preset(name).to_dict()
    (active, unit), (non_embedding, ne_unit) = PUBLISHED_ACTIVE[name]
    assert n_active_params(cfg) // unit == active
    assert n_active_params(cfg, embeddings=False) // ne_unit == non_embedding
    # A dense config uses every parameter.
    dense = preset("llada-8b-instruct").to_dict()
    assert n_active_params(dense) == n_params(dense)


def test_flash_preset_is_the_framework_config_at_the_published_context():
    """llada2-flash: the authors' training framework's flash config (its dimensions,
    docs/llada2.md), read through the published mini config's other fields."""
    flash = {**LLADA2_MINI, "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "intermediate_size": 9216,
             "moe_intermediate_size": 1024}
    assert from_hf_config(flash) == preset("llada2-flash")
    stats = param_stats(preset("llada2-flash"))
    assert stats["params"] == n_params(preset("llada2-flash").to_dict()) == 102_889_705_216
    assert stats["tensors"] == 446  # 32 layers, the first dense


def test_published_mini_config_reads_as_the_preset():
    assert set(LLADA2_MINI) <= LLADA2_FIELDS  # every published field name is mapped
    assert from_hf_config(LLADA2_MINI) == preset("llada2-mini")
    assert set(OTHER_FIELDS) <= LLADA2_FIELDS
    assert from_hf_config({**LLADA2_MINI, **OTHER_FIELDS}) == preset("llada2-mini")


def test_tiny_reference_config_reads_as_the_tiny_preset():
    got = from_hf_config(R.hf_config())
    assert got == preset("tiny-llada2-test").replace(dtype="float32", param_dtype="float32")


def test_config_round_trips_as_its_class():
    cfg = preset("llada2-mini")
    back = ModelConfig.from_dict(cfg.to_dict())
    assert back == cfg and type(back) is LLaDA2Config
    assert back.rope_dim == 64 and back.moe_layer(1) and not back.moe_layer(0)
    dense = preset("llada-8b-instruct")
    assert type(ModelConfig.from_dict(dense.to_dict())) is ModelConfig
    assert "n_experts" not in dense.to_dict()  # the dense configs' fields are unchanged


def test_llada2_family_needs_the_moe_fields():
    fields = dataclasses.asdict(preset("tiny-llada-test"))
    with pytest.raises(ConfigError, match="mixture-of-experts model"):
        ModelConfig(**dict(fields, family="llada2"))


@pytest.mark.parametrize("changes, message", [
    (dict(n_experts=6), "n_experts=6 is not a multiple of n_expert_groups=4"),
    (dict(n_expert_groups=8), "each group needs at least 2"),
    (dict(n_topk_groups=5), "n_topk_groups=5 is more than n_expert_groups=4"),
    (dict(n_experts_per_tok=5), "more than the 4 experts"),
    (dict(rotary_dim=3), "rotary_dim=3: RoPE needs an even width"),
    (dict(rotary_dim=10), "rotary_dim=10 is more than head_dim=8"),
    (dict(first_dense_layers=4), "first_dense_layers=4 is more than n_layers=3"),
    (dict(routed_scaling=float("nan")), "routed_scaling=nan"),
    (dict(n_experts=0), "n_experts=0: must be a positive integer"),
    (dict(n_shared_experts=-1), "n_shared_experts=-1"),
])
def test_bad_moe_fields_are_named(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preset("tiny-llada2-test").replace(**changes)


@pytest.mark.parametrize("changes, message", [
    (dict(colour="red"), r"unknown llada2_moe config fields \['colour'\]"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(score_function="softmax"), "score_function='softmax'"),
    (dict(use_qk_norm=False), "use_qk_norm=False"),
    (dict(use_qkv_bias=True), "use_qkv_bias=true"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=1"),
    (dict(rotary_dim=8), "rotary_dim=8 disagrees"),
    (dict(partial_rotary_factor=0.1), "RoPE needs an even, positive width"),
    (dict(n_group=None), "missing required field 'n_group'"),
    (dict(routed_scaling_factor=None), "missing required field 'routed_scaling_factor'"),
    (dict(num_experts=2.5), "num_experts=2.5: must be an integer"),
    (dict(mask_token_id=64), "mask_token_id=64: not an id of the vocabulary"),
])
def test_bad_hf_fields_are_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config(R.hf_config(**changes))


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        from_hf_config(R.hf_config(score_function="softmax", use_bias=True, n_group=None))
    assert all(s in str(e.value) for s in ("score_function", "use_bias", "n_group"))


# --------------------------------------------------------------------------- routing

def test_routed_experts_equal_a_dense_sum_over_experts():
    rng = np.random.default_rng(0)
    N, d, m, E, k = 10, 6, 5, 8, 3
    x = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(E, d, m)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(E, m, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]))
    weights = jnp.asarray(rng.random((N, k)), jnp.float32)
    got = moe_lib.routed_experts(x, experts, weights, gate, up, down, jnp.float32)
    every = jnp.stack([(jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e] for e in range(E)])
    want = jnp.einsum("nk,nkd->nd", weights, every[experts, jnp.arange(N)[:, None]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_route_matches_the_reference_gate():
    hf = R.hf_config()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 32, generator=g), torch.randn(8, 32, generator=g)
    bias = 0.3 * torch.randn(8, generator=g)
    want_e, want_w = R.route(hf, x, w, bias)
    got_e, got_w = moe_lib.route(jnp.asarray(x.numpy()), jnp.asarray(w.numpy().T),
                                 jnp.asarray(bias.numpy()), top_k=2, n_groups=4,
                                 topk_groups=2, scaling=2.5)
    np.testing.assert_array_equal(np.asarray(got_e), want_e.numpy())
    np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- parity

@nnx.jit
def forward(model, tokens, block_ids=None, key_mask=None):
    return model(tokens, block_ids=block_ids, key_mask=key_mask)


def tokens_for(hf, b=2, t=12, seed=0):
    return np.random.default_rng(seed).integers(0, hf["vocab_size"], (b, t)).astype(np.int32)


def tied_tensors(hf, seed):
    """Weights with exact routing ties in every expert layer: experts 2-5 (groups 1 and 2)
    get zero router rows and zero bias, so each scores sigmoid(0) = 0.5 on every token;
    the two groups tie at 1.0 and so do the experts within them. Experts 0 and 1 get a
    bias that makes group 0 lose to them."""
    t = R.random_tensors(hf, seed=seed)
    for i in range(hf["first_k_dense_replace"], hf["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.gate."
        t[p + "weight"][2:6] = 0.0
        t[p + "expert_bias"][2:6] = 0.0
        t[p + "expert_bias"][0:2] = -1.0
    return t


def group_limited_tensors(hf, seed):
    """Weights where the group limit changes the choice on every token: expert 0's bias
    (+2) makes it every token's best single expert, but its group mate's (-6) makes
    group 0 the worst group, so with the limit expert 0 is never chosen."""
    t = R.random_tensors(hf, seed=seed)
    for i in range(hf["first_k_dense_replace"], hf["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.gate."
        t[p + "expert_bias"][0] = 2.0
        t[p + "expert_bias"][1] = -6.0
    return t


CASES = {  # name: (config.json overrides, weights)
    "random": ({}, lambda hf: R.random_tensors(hf, seed=1)),
    "ties": ({}, lambda hf: tied_tensors(hf, seed=2)),
    "group-limit": ({}, lambda hf: group_limited_tensors(hf, seed=3)),
    # every layer routed, no shared expert, one group (no group limit), top-1 (weights
    # not normalised), tied head, full rotary
    "variant": (dict(first_k_dense_replace=0, num_shared_experts=0, n_group=1, topk_group=1,
                     num_experts_per_tok=1, tie_word_embeddings=True,
                     partial_rotary_factor=1.0), lambda hf: R.random_tensors(hf, seed=4)),
}
_BUILT: dict = {}


def _build(name):
    if name not in _BUILT:
        overrides, weights = CASES[name]
        hf = R.hf_config(**overrides)
        tensors = weights(hf)
        _BUILT[name] = (hf, tensors, H.ours_from(hf, tensors))
    return _BUILT[name]


def _layer_inputs(hf, tensors, tokens, layer):
    """The routers' input at an expert layer, from the reference (for routing checks)."""
    captured = {}
    original = R._moe

    def spy(hf_, t, p, x):
        captured.setdefault(p, x.clone())
        return original(hf_, t, p, x)

    R._moe = spy
    try:
        R.logits(hf, tensors, tokens)
    finally:
        R._moe = original
    return captured[f"model.layers.{layer}."]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_the_reference(name):
    hf, tensors, model = _build(name)
    tokens = tokens_for(hf)
    want = R.logits(hf, tensors, tokens)
    got = np.asarray(forward(model, jnp.asarray(tokens)))
    assert np.max(np.abs(got - want)) <= TOL
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_the_ties_case_has_ties_at_the_selection_boundary():
    """The ties are where they decide: some token's chosen group ties with an unchosen
    one, and some chosen expert with an unchosen one (a wrong tie rule would differ)."""
    hf, tensors, _ = _build("ties")
    x = _layer_inputs(hf, tensors, tokens_for(hf), layer=1)
    experts, _ = R.route(hf, x, tensors["model.layers.1.mlp.gate.weight"],
                         tensors["model.layers.1.mlp.gate.expert_bias"])
    picked = [set(row.tolist()) for row in experts]
    assert any(len(s & {2, 3}) == 1 for s in picked)  # an expert tie decided by index
    assert any(2 in s and 4 not in s for s in picked)  # group 1 over its twin group 2


def test_the_group_limit_changes_the_chosen_experts():
    hf, tensors, _ = _build("group-limit")
    x = _layer_inputs(hf, tensors, tokens_for(hf), layer=1)
    w, b = tensors["model.layers.1.mlp.gate.weight"], tensors["model.layers.1.mlp.gate.expert_bias"]
    limited, _ = R.route(hf, x, w, b)
    free, _ = R.route(hf, x, w, b, group_limit=False)
    assert (free == 0).any(-1).all() and not (limited == 0).any()


def test_block_causal_and_padding_match_the_reference():
    hf, tensors, model = _build("random")
    tokens = tokens_for(hf, seed=5)
    block_ids = np.broadcast_to(np.arange(12) // 4, (2, 12)).astype(np.int32)
    key_mask = np.ones((2, 12), bool)
    key_mask[1, :2] = False
    want = R.logits(hf, tensors, tokens, block_ids=block_ids, key_mask=key_mask)
    got = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(block_ids),
                             jnp.asarray(key_mask)))
    assert np.max(np.abs(got - want)) <= TOL
    # block-causal: an earlier block does not see a later one
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % hf["vocab_size"]
    again = np.asarray(forward(model, jnp.asarray(changed), jnp.asarray(block_ids),
                               jnp.asarray(key_mask)))
    np.testing.assert_array_equal(again[:, :8], got[:, :8])


def test_the_check_is_sensitive_to_one_expert_weight():
    hf, tensors, model = _build("random")
    tokens = tokens_for(hf)
    x = _layer_inputs(hf, tensors, tokens, layer=2)
    used = int(R.route(hf, x, tensors["model.layers.2.mlp.gate.weight"],
                       tensors["model.layers.2.mlp.gate.expert_bias"])[0][0, 0])
    changed = {k: v.clone() for k, v in tensors.items()}
    changed[f"model.layers.2.mlp.experts.{used}.down_proj.weight"][0, 0] += 0.5
    got = np.asarray(forward(model, jnp.asarray(tokens)))
    assert np.max(np.abs(got - R.logits(hf, changed, tokens))) > 10 * TOL


def test_cached_and_row_subset_calls_equal_the_full_forward():
    """The KV-cache path (fresh K/V written, then attended) and logits_index (the last
    layer on some rows only) run the fused-QKV attention and the expert layers as the
    full forward does."""
    hf, _, model = _build("random")
    tokens = jnp.asarray(tokens_for(hf, seed=7))
    full = np.asarray(forward(model, tokens))
    _, cache = nnx.jit(lambda m, t: m(t, return_kv=True))(model, tokens)
    cols = jnp.asarray(np.array([[3, 9], [0, 11]], np.int32))
    cached, _ = nnx.jit(lambda m, t, p, c: m.forward_cached(t, p, p, c))(
        model, jnp.take_along_axis(tokens, cols, axis=1), cols, cache)
    np.testing.assert_allclose(np.asarray(cached), np.take_along_axis(
        full, np.asarray(cols)[..., None], axis=1), rtol=0, atol=TOL)
    rows = np.asarray(nnx.jit(lambda m, t, i: m(t, logits_index=i))(model, tokens, cols))
    np.testing.assert_allclose(rows, np.take_along_axis(full, np.asarray(cols)[..., None],
                                                        axis=1), rtol=0, atol=TOL)
