"""Loading a converted folder: one array in flight at a time, dtype cast per array, the
same values as before; a folder whose parameters do not fit its config is refused."""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from orbax.checkpoint._src.serialization import limits

import asynclane_jax
from asynclane_jax import checkpoint
from asynclane_jax.checkpoint import CheckpointError
from asynclane_jax.checkpoint.format import str_keys


def _params(model):
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(k): v for k, v in flat[0]}


def _stored(name):
    """The stored arrays, read by orbax as plain numpy (no model involved)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as c:
        tree = c.restore((checkpoint.resolve(name) / checkpoint.PARAMS_DIR).absolute())
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k).replace("['", "[").replace("']", "]"): np.asarray(v)
            for k, v in flat}


def _by_path(params):
    return {k.replace("['", "[").replace("']", "]"): v for k, v in params.items()}


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_load_equals_stored_arrays(name):
    model, _, cfg = asynclane_jax.load(name)
    stored = _stored(name)
    got = _by_path(_params(model))
    assert set(got) == set(stored)
    for k, a in got.items():
        assert isinstance(a, jax.Array) and a.dtype == jnp.dtype(cfg.param_dtype)
        assert a.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
        np.testing.assert_array_equal(np.asarray(a), stored[k], err_msg=k)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dtype_override_equals_cast_of_stored(dtype):
    model, _, cfg = asynclane_jax.load("tiny-llada", dtype=dtype)
    assert cfg.param_dtype == dtype and cfg.dtype == dtype
    stored = _stored("tiny-llada")
    for k, a in _by_path(_params(model)).items():
        assert a.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(a), stored[k].astype(jnp.dtype(dtype)))


def test_bf16_folder_loads_as_float32_exactly(tmp_path):
    model, tok, _ = asynclane_jax.load("tiny-dream", dtype="bfloat16")
    folder = checkpoint.save(tmp_path / "bf16", model)
    back, _, cfg = asynclane_jax.load(folder, dtype="float32")
    assert cfg.param_dtype == "float32"
    ref = _params(model)
    for k, a in _params(back).items():
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(ref[k]).astype(np.float32))


def test_one_array_in_flight_on_a_mesh(monkeypatch):
    """With shardings on a mesh, orbax reads at most about one array's bytes at a time
    (by default it would read every array at once)."""
    live = {"now": 0, "max": 0, "calls": 0}
    real = limits.reserved_bytes

    @contextlib.asynccontextmanager
    async def counting(limiter, nbytes):
        async with real(limiter, nbytes):
            live["now"] += nbytes
            live["max"] = max(live["max"], live["now"])
            live["calls"] += 1
            try:
                yield
            finally:
                live["now"] -= nbytes

    monkeypatch.setattr(limits, "reserved_bytes", counting)
    model, _, _ = asynclane_jax.load("tiny-llada")
    params = _params(model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                          str_keys(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    live.update(calls=0, max=0)
    back = checkpoint.restore_params(checkpoint.resolve("tiny-llada") / "params", target)
    largest = max(a.nbytes for a in params.values())
    assert live["calls"] == len(params)
    assert largest <= live["max"] <= largest + 1
    for a in jax.tree.leaves(back):
        assert a.sharding == rep


def test_parameters_that_do_not_fit_the_config(tmp_path):
    model, _, _ = asynclane_jax.load("tiny-llada")
    folder = checkpoint.save(tmp_path / "m", model)
    cfg_path = folder / checkpoint.CONFIG_FILE
    data = json.loads(cfg_path.read_text())
    data["model"]["vocab_size"] += 1
    cfg_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"do not match the config: .*embed.*stored"):
        asynclane_jax.load(folder)


def test_missing_parameters_are_named(tmp_path):
    model, _, cfg = asynclane_jax.load("tiny-llada")
    folder = checkpoint.save(tmp_path / "m", model)
    cfg_path = folder / checkpoint.CONFIG_FILE
    data = json.loads(cfg_path.read_text())
    data["model"]["n_layers"] = cfg.n_layers + 1
    cfg_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"missing .*layers.*{cfg.n_layers}"):
        asynclane_jax.load(folder)


# --------------------------------------------------------------------------- converting

@pytest.mark.parametrize("layout", ["sharded", "bin"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_blockwise_conversion_equals_whole_tensor(tmp_path, layout, out_dtype):
    """Reading a tensor a few rows at a time into its transposed output gives what the
    whole-tensor conversion gives, for every tensor of a snapshot, blocks of any size."""
    import torch
    from hf_reference import dream_hf_config, random_tensors, write_checkpoint

    from checkpoints_convert import convert

    hf = dream_hf_config()
    src = write_checkpoint(tmp_path / "src", hf, random_tensors(hf, dtype=torch.bfloat16),
                           layout=layout)
    snap, cfg, assignments, _ = convert.prepare(str(src), dtype=out_dtype)
    dtype = convert.NP_DTYPES[out_dtype]
    seen = 0
    for info, source in snap.iter_sources(assignments):
        a = assignments[info.name]
        whole = convert.to_output(source.read(), a, dtype)
        for block in (1, 3 * info.dtype.itemsize * int(np.prod(info.shape[1:])) + 1, 10**9):
            got = convert.read_output(source, a, dtype, block_bytes=block)
            assert got.dtype == dtype and got.flags.c_contiguous
            np.testing.assert_array_equal(got, whole, err_msg=f"{info.name} block {block}")
        seen += 1
    assert seen == len(assignments)


def test_large_array_saved_as_one_chunk(tmp_path, monkeypatch):
    """An array over orbax's OCDBT target file size is written as one chunk (orbax would
    split it across its largest axis, copying it whole first)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import tensorstore_utils

    monkeypatch.setattr(tensorstore_utils, "_DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE", 2**12)
    x = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)  # 24 KiB > 4 KiB
    checkpoint.save_params(tmp_path / "p", {"a": {"w": x}, "b": x[:2, :3].copy()})
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
        meta = c.metadata((tmp_path / "p").absolute()).item_metadata.tree
    assert tuple(meta["a"]["w"].storage.chunk_shape) == x.shape
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    back = checkpoint.restore_params(tmp_path / "p", {
        "a": {"w": jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=single)},
        "b": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=single)})
    np.testing.assert_array_equal(np.asarray(back["a"]["w"]), x.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(back["b"]), x[:2, :3])
