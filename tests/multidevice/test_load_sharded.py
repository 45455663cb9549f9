"""Loading straight onto a mesh of 8 (fake CPU) devices: every parameter arrives with the
plan's sharding and the unsharded values, from a mesh spec or a Mesh; a mesh that
cannot be used is refused with a clear CheckpointError."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import asynclane_jax
from asynclane_jax import checkpoint, sharding
from asynclane_jax.checkpoint import CheckpointError


@functools.cache
def unsharded(name):
    return asynclane_jax.load(name)


def _params(model):
    return jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("spec", ["data=2,tensor=4", "tensor=8", "fsdp=2,tensor=4"])
@pytest.mark.parametrize("as_mesh", [False, True], ids=["spec", "Mesh"])
def test_sharded_load_places_and_matches(name, spec, as_mesh):
    base, _, cfg = unsharded(name)
    mesh = sharding.make_mesh(spec) if as_mesh else spec
    model, tok, cfg2 = asynclane_jax.load(name, mesh=mesh)
    assert cfg2 == cfg and tok is not None
    plan = sharding.plan_for(cfg, mesh)
    want = dict(_params_of(plan.param_shardings(nnx.state(model, nnx.Param))))
    got, ref = _params(model), dict(_params(base))
    assert len(got) == len(ref) == len(want)
    split = 0
    for path, a in got:
        assert a.sharding == want[path], jax.tree_util.keystr(path)
        assert len(a.sharding.device_set) == 8
        split += a.sharding.spec != jax.sharding.PartitionSpec(*([None] * a.ndim))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(ref[path]))
    assert split, "some parameter is split on this mesh"
    assert sharding.mesh_of(model) is not None
    assert sharding.describe(sharding.mesh_of(model)) == sharding.describe(plan.mesh)


def _params_of(state):
    return jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]


@pytest.mark.parametrize("spec", ["data=2,tensor=4", "fsdp=8"])
def test_sharded_load_holds_only_shards(spec):
    """Each device holds its shards of each parameter and nothing more: less than the
    model where parameters are split."""
    model, _, _ = asynclane_jax.load("tiny-llada", mesh=spec)
    per_device: dict = {}
    total = 0
    for _, a in _params(model):
        total += a.nbytes
        for s in a.addressable_shards:
            assert s.data.shape == a.sharding.shard_shape(a.shape)
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    assert len(per_device) == 8
    assert max(per_device.values()) < total


def test_sharded_load_with_dtype_override():
    base, _, _ = unsharded("tiny-llada")
    model, _, cfg = asynclane_jax.load("tiny-llada", mesh="data=2,tensor=4", dtype="bfloat16")
    assert cfg.param_dtype == "bfloat16"
    ref = dict(_params(base))
    for path, a in _params(model):
        assert a.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(a),
                                      np.asarray(ref[path]).astype(jax.numpy.bfloat16))


@pytest.mark.parametrize("mesh,match", [
    ("data=3,tensor=4", "12 devices, but there are 8"),
    ("tensor=16", "16 devices, but there are 8"),
    ("model=8", "is not AXIS=SIZE"),
    ("", "names no axis"),
])
def test_bad_mesh_spec_is_a_clear_error(mesh, match):
    with pytest.raises(CheckpointError, match=match) as e:
        asynclane_jax.load("tiny-llada", mesh=mesh)
    assert "cannot load llada" in str(e.value)


def test_mesh_without_the_axis_names_is_refused():
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    with pytest.raises(CheckpointError, match="lacks data, fsdp, tensor"):
        asynclane_jax.load("tiny-llada", mesh=mesh)


def test_mesh_of_another_type_is_refused():
    with pytest.raises(CheckpointError, match="expected a jax.sharding.Mesh"):
        checkpoint.load("tiny-llada", mesh=8)
