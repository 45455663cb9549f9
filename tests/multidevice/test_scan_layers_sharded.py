"""The scanned layer layout on 8 (fake CPU) devices: stacked parameters keep their
leading layer axis unsharded, and every sampler's tokens on a 2x4 mesh equal the
unrolled model's on one device."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import asynclane_jax
from asynclane_jax import checkpoint
from asynclane_jax.decoding import generate
from asynclane_jax.testbed import evaluate, tasks

MESH = "data=2,tensor=4"
CASES = [("tiny-llada", "vanilla", {}), ("tiny-llada", "fast-dllm", {"cache": "dual"}),
         ("tiny-llada", "fast-dllm", {"cache": "prefix"}), ("tiny-llada", "localleap", {}),
         ("tiny-llada", "asynclane", {}), ("tiny-dream", "dream", {}),
         ("tiny-dream", "asynclane", {}), ("tiny-llada", "d2f", {}), ("tiny-llada", "eb", {})]


@functools.cache
def models(name):
    unrolled, tok, _ = asynclane_jax.load(name)
    scanned = checkpoint.load_model(name, mesh=MESH, scan_layers=True)
    return unrolled, scanned, tok


def test_every_sampler_is_covered():
    assert {s for _, s, _ in CASES} == set(asynclane_jax.decoding.samplers())


def test_stacked_parameters_placed_with_an_unsharded_layer_axis():
    _, scanned, _ = models("tiny-llada")
    cfg = scanned.cfg
    k = scanned.layers.mlp.up_proj.kernel[...]
    assert k.shape == (cfg.n_layers, cfg.d_model, cfg.mlp_hidden)
    assert k.sharding.spec == P(None, None, "tensor")
    norm = scanned.layers.attn_norm.scale[...]
    assert norm.sharding.spec[:1] in ((), (None,))
    assert len(k.addressable_shards) == 8
    assert k.addressable_shards[0].data.shape == (cfg.n_layers, cfg.d_model,
                                                  cfg.mlp_hidden // 4)


@pytest.mark.parametrize("name,sampler,options", CASES,
                         ids=[f"{n}-{s}-{'-'.join(o.values())}".rstrip("-")
                              for n, s, o in CASES])
def test_scanned_sharded_tokens_equal_unrolled(name, sampler, options):
    unrolled, scanned, tok = models(name)
    prompts = evaluate.prompts_for(tasks.heldout(4))
    kw = dict(tokenizer=tok, sampler=sampler, gen_length=64, **options)
    want, got = generate(unrolled, prompts, **kw), generate(scanned, prompts, **kw)
    assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert got.stats.nfe == want.stats.nfe
