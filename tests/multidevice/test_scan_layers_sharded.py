"""The scanned layer layout on 8 (fake CPU) devices: stacked parameters keep their
leading layer axis unsharded (every sampler's tokens from the scanned layout on a 2x4
mesh are checked against the unrolled model on one device in test_sharded_decode.py)."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from asynclane_jax import checkpoint

MESH = "data=2,tensor=4"


def test_stacked_parameters_placed_with_an_unsharded_layer_axis():
    scanned = checkpoint.load_model("tiny-llada", mesh=MESH, scan_layers=True)
    cfg = scanned.cfg
    k = scanned.layers.mlp.up_proj.kernel[...]
    assert k.shape == (cfg.n_layers, cfg.d_model, cfg.mlp_hidden)
    assert k.sharding.spec == P(None, None, "tensor")
    norm = scanned.layers.attn_norm.scale[...]
    assert norm.sharding.spec[:1] in ((), (None,))
    assert len(k.addressable_shards) == 8
    assert k.addressable_shards[0].data.shape == (cfg.n_layers, cfg.d_model,
                                                  cfg.mlp_hidden // 4)
