"""The scanned layer layout (`ModelConfig.scan_layers`): the same model as the unrolled
one, to float32 rounding; checkpoints in either layout read into either, exactly; the
converter writes either; every sampler's tokens unchanged."""

from __future__ import annotations

import functools
import json

import hf_reference as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import asynclane_jax
from asynclane_jax import checkpoint
from asynclane_jax.decoding import generate
from asynclane_jax.models import KVCache, init_model, preset, tiny_dream, tiny_llada
from asynclane_jax.models.model import layer_layout, stack_layer_params, unstack_layer_params
from asynclane_jax.testbed import evaluate, tasks
from checkpoints_convert import convert as conv

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 1e-6


def pair(cfg, seed=3):
    """The same random model in both layouts (one seed: the stacked one is the
    unrolled one's blocks stacked)."""
    return init_model(cfg, seed), init_model(cfg.replace(scan_layers=True), seed)


def numpy_params(model):
    return checkpoint.params_to_numpy(model)


@nnx.jit
def _forwards(model, tokens, key_mask, block_ids, q_cols):
    """A full forward (with its K/V), then a cached call of q_cols against that cache
    with a key bound, as decoding makes them."""
    b, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T), (b, T))
    full, cache = model.forward(tokens, pos, key_mask=key_mask, block_ids=block_ids,
                                cache=KVCache.zeros(model.cfg, b, T), write_index=pos)
    tq = jnp.take_along_axis(tokens, q_cols, 1)
    cached, cache2 = model.forward(tq, q_cols, key_mask=key_mask, cache=cache,
                                   write_index=q_cols, block_ids=block_ids, key_len=T - 4)
    return full, cache, cached, cache2


@pytest.mark.parametrize("cfg,blocks", [(tiny_llada().replace(n_layers=3), True),
                                        (tiny_dream().replace(n_layers=3,
                                                              tie_embeddings=True), False)],
                         ids=["llada-block-causal", "dream-tied"])
def test_scanned_forward_matches_unrolled(cfg, blocks):
    unrolled, scanned = pair(cfg)
    assert layer_layout(numpy_params(unrolled)) == "unrolled"
    assert layer_layout(numpy_params(scanned)) == "stacked"
    k = scanned.layers.attn.q_proj.kernel
    assert k.shape == (cfg.n_layers, cfg.d_model, cfg.n_heads * cfg.head_dim)
    rng = np.random.default_rng(0)
    b, T = 3, 20
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, T)), jnp.int32)
    key_mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [2], [5]]))
    q_cols = jnp.asarray(np.sort(rng.permutation(T - 4)[:6])[None].repeat(b, 0), jnp.int32)
    for block_ids in [jnp.asarray(np.arange(T)[None].repeat(b, 0) // 8) if blocks else None]:
        got = _forwards(scanned, tokens, key_mask, block_ids, q_cols)
        want = _forwards(unrolled, tokens, key_mask, block_ids, q_cols)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=TOL)
        # A cache entry at the bound's far side was never written by the cached call.
        assert np.array_equal(np.asarray(got[3].k[:, :, -1]), np.asarray(got[1].k[:, :, -1]))


def test_llada2_two_stacks_match_unrolled():
    """A LLaDA2 model (a dense first layer, then expert layers): two stacks, `dense`
    [1, ...] and `moe` [2, ...], run by two scans; the same logits and K/V as unrolled,
    block-causal and cached with a key bound; the layout functions exact both ways."""
    cfg = preset("tiny-llada2-test")
    assert cfg.layer_stacks() == (("dense", 0, 1), ("moe", 1, 3))
    unrolled, scanned = pair(cfg)
    assert layer_layout(numpy_params(scanned)) == "stacked"
    assert scanned.layers.dense.mlp.gate_proj.kernel.shape == (1, cfg.d_model, cfg.mlp_hidden)
    assert scanned.layers.moe.mlp.experts.gate_proj.shape == (
        2, cfg.n_experts, cfg.d_model, cfg.moe_hidden)
    assert scanned.layers.moe.mlp.gate.expert_bias.shape == (2, cfg.n_experts)
    rng = np.random.default_rng(1)
    b, T = 2, 24
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, T)), jnp.int32)
    key_mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3]]))
    q_cols = jnp.asarray(np.sort(rng.permutation(T - 4)[:5])[None].repeat(b, 0), jnp.int32)
    block_ids = jnp.asarray(np.arange(T)[None].repeat(b, 0) // 8)
    got = _forwards(scanned, tokens, key_mask, block_ids, q_cols)
    want = _forwards(unrolled, tokens, key_mask, block_ids, q_cols)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=TOL)
    # The last layer on the read rows only (logits_index) is the moe stack's last.
    cols = jnp.asarray([[1, 7], [0, 20]], jnp.int32)
    np.testing.assert_allclose(np.asarray(scanned(tokens, logits_index=cols)),
                               np.asarray(unrolled(tokens, logits_index=cols)),
                               rtol=0, atol=TOL)

    stacks = cfg.layer_stacks()
    stacked = stack_layer_params(numpy_params(unrolled), 3, stacks)
    H.assert_trees_equal(stacked, numpy_params(scanned))
    back = unstack_layer_params(numpy_params(scanned), 3, stacks, str_keys=True)
    H.assert_trees_equal(back, numpy_params(unrolled))
    with pytest.raises(ValueError, match="layer 1 has other parameters than layer 0"):
        stack_layer_params(numpy_params(unrolled), 3)  # one stack: the layers differ
    with pytest.raises(ValueError, match="layers.dense.attn.k_norm.scale: shape .1, 8., "
                                         "expected a leading axis of 3 layers"):
        unstack_layer_params(numpy_params(scanned), 3)  # read as one stack
    with pytest.raises(ValueError, match=r"hold \['dense', 'moe'\], expected the stacks"):
        unstack_layer_params(numpy_params(scanned), 3, (("a", 0, 1), ("b", 1, 3)))
    with pytest.raises(ValueError, match="do not split layers 0..2"):
        stack_layer_params(numpy_params(unrolled), 3, (("dense", 0, 1), ("moe", 2, 3)))


def test_layout_functions_exact_and_checked():
    unrolled, scanned = pair(tiny_dream().replace(n_layers=3))
    stacked = stack_layer_params(numpy_params(unrolled), 3)
    H.assert_trees_equal(stacked, numpy_params(scanned))
    back = unstack_layer_params(numpy_params(scanned), 3, str_keys=True)
    H.assert_trees_equal(back, numpy_params(unrolled))
    with pytest.raises(ValueError, match="expected 0..3"):
        stack_layer_params(numpy_params(unrolled), 4)
    with pytest.raises(ValueError, match="leading axis of 4 layers"):
        unstack_layer_params(numpy_params(scanned), 4)
    with pytest.raises(ValueError, match="mix numbered and named"):
        layer_layout({"layers": {"0": {}, "attn": {}}})


def test_checkpoint_layouts_round_trip_exactly(tmp_path):
    """Stacked folder -> unrolled model -> unrolled folder -> stacked model: every array
    bit for bit, each folder storing the layout its config names."""
    shipped, _, cfg = asynclane_jax.load("tiny-llada")
    assert not cfg.scan_layers
    stacked_model = checkpoint.load_model("tiny-llada", scan_layers=True)
    assert stacked_model.cfg.scan_layers
    H.assert_trees_equal(numpy_params(stacked_model),
                       stack_layer_params(numpy_params(shipped), cfg.n_layers))
    checkpoint.save(tmp_path / "stacked", stacked_model)
    data = json.loads((tmp_path / "stacked" / "config.json").read_text())
    assert data["model"]["scan_layers"] is True
    digests = checkpoint.read_digests(tmp_path / "stacked")
    assert "layers.attn.q_proj.kernel" in digests
    assert digests["layers.attn.q_proj.kernel"]["shape"][0] == cfg.n_layers
    assert checkpoint.verify_folder(tmp_path / "stacked") == len(digests)
    unrolled = checkpoint.load_model(tmp_path / "stacked", scan_layers=False)
    assert not unrolled.cfg.scan_layers
    H.assert_trees_equal(numpy_params(unrolled), numpy_params(shipped))
    checkpoint.save(tmp_path / "unrolled", unrolled)
    assert checkpoint.read_digests(tmp_path / "unrolled") == checkpoint.read_digests(
        checkpoint.resolve("tiny-llada"))
    again = checkpoint.load_model(tmp_path / "unrolled", scan_layers=True)
    H.assert_trees_equal(numpy_params(again), numpy_params(stacked_model))
    as_stored = checkpoint.load_model(tmp_path / "stacked")  # the folder's own layout
    assert as_stored.cfg.scan_layers
    H.assert_trees_equal(numpy_params(as_stored), numpy_params(stacked_model))


def test_corrupt_stacked_folder_named_on_relayout(tmp_path):
    model = checkpoint.load_model("tiny-dream", scan_layers=True)
    checkpoint.save(tmp_path / "m", model)
    path = tmp_path / "m" / checkpoint.DIGESTS_FILE
    data = json.loads(path.read_text())
    data["arrays"]["layers.mlp.up_proj.kernel"]["digest"] = "0" * 64
    path.write_text(json.dumps(data))
    with pytest.raises(checkpoint.CheckpointError, match="layers.mlp.up_proj.kernel"):
        checkpoint.load_model(tmp_path / "m", scan_layers=False)


def test_converter_writes_the_stacked_layout(tmp_path):
    hf = H.llada_hf_config()
    tensors = H.random_tensors(hf, seed=4, dtype=torch.float32)
    src = H.write_checkpoint(tmp_path / "src", hf, tensors, layout="single")
    conv.convert(src, tmp_path / "flat", progress=False)
    conv.convert(src, tmp_path / "stacked", progress=False, scan_layers=True)
    flat_cfg, _ = checkpoint.read_config(tmp_path / "flat")
    stacked_cfg, _ = checkpoint.read_config(tmp_path / "stacked")
    assert not flat_cfg.scan_layers and stacked_cfg.scan_layers
    assert checkpoint.verify_folder(tmp_path / "stacked") > 0
    flat = checkpoint.load_model(tmp_path / "flat")
    stacked = checkpoint.load_model(tmp_path / "stacked")
    assert stacked.cfg.scan_layers
    H.assert_trees_equal(numpy_params(stacked),
                       stack_layer_params(numpy_params(flat), flat_cfg.n_layers))
    H.assert_trees_equal(numpy_params(checkpoint.load_model(tmp_path / "stacked",
                                                          scan_layers=False)),
                       numpy_params(flat))


# Tokens, unrolled vs scanned, for the samplers whose calls differ most (full forwards
# only, dual cache with key bounds, block-causal cache, routers; LLaDA2's two stacks
# under its own sampler and under the dual cache on its blocks); every sampler is
# compared sharded in tests/multidevice/test_scan_layers_sharded.py.
SAMPLERS = [("tiny-llada", "vanilla", {}), ("tiny-llada", "fast-dllm", {"cache": "dual"}),
            ("tiny-llada", "asynclane", {}), ("tiny-dream", "asynclane", {}),
            ("tiny-llada", "eb", {}), ("tiny-llada2-v4b", "llada2", {}),
            ("tiny-llada2-v4b", "fast-dllm", {"cache": "dual"})]


@functools.cache
def models(name):
    model, tok, _ = asynclane_jax.load(name)
    return model, checkpoint.load_model(name, scan_layers=True), tok


@pytest.mark.parametrize("name,sampler,options", SAMPLERS,
                         ids=[f"{n}-{s}-{'-'.join(o.values())}".rstrip("-")
                              for n, s, o in SAMPLERS])
def test_sampler_tokens_unchanged(name, sampler, options):
    unrolled, scanned, tok = models(name)
    prompts = evaluate.prompts_for(tasks.heldout(2))
    kw = dict(tokenizer=tok, sampler=sampler, gen_length=48, **options)
    want, got = generate(unrolled, prompts, **kw), generate(scanned, prompts, **kw)
    assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert got.stats.nfe == want.stats.nfe
