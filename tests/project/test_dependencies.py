"""What this package relies on in its dependencies beyond their public API, checked so
that an upgrade which moves it fails here, naming what moved, rather than somewhere deep.

* orbax: the shipped models are orbax checkpoints, read and written through its public
  API only (`asynclane_jax.checkpoint.restore` / `save`), so the package is not pinned
  below a release; tests/checkpoint/test_checkpoint_memory.py patches two private names
  in `orbax.checkpoint._src`, checked here so that a release which moves them fails here.
* safetensors: `checkpoints_convert.reader` parses safetensors files by hand (8-byte
  little-endian header length, JSON header, raw data) instead of through the package:
  pinned with an upper bound in pyproject.toml.

The first test checks that the pins are there and every installed version is inside
pyproject.toml's range.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Distribution -> what is relied on, hence why it carries an upper bound.
RELIED_ON = {
    "safetensors": "the safetensors file layout parsed by checkpoints_convert.reader",
}


def _requirements() -> dict[str, Requirement]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(line) for line in data["project"]["dependencies"]]
    return {r.name.lower(): r for r in reqs}


def test_relied_on_dependencies_are_pinned_and_installed_in_range():
    reqs = _requirements()
    for name, why in RELIED_ON.items():
        req = reqs.get(name)
        assert req is not None, f"pyproject.toml no longer lists {name} ({why})"
        uppers = [s for s in req.specifier if s.operator in ("<", "<=", "==", "~=")]
        assert uppers, (f"pyproject.toml: {req} has no upper bound, but the package relies "
                        f"on {why}; pin it to the tested range")
    for name, req in reqs.items():
        installed = Version(importlib.metadata.version(name))
        assert req.specifier.contains(installed, prereleases=True), (
            f"{name} {installed} is installed, outside pyproject.toml's {req.specifier}"
            + (f": {RELIED_ON[name]} may have moved; rerun tests/project/test_dependencies.py, "
               "tests/checkpoint/test_checkpoint_memory.py and tests/checkpoint/test_convert.py "
               "before widening the pin" if name in RELIED_ON else ""))


# --------------------------------------------------------------------------- orbax

def test_orbax_private_names_the_tests_patch_still_exist():
    """tests/checkpoint/test_checkpoint_memory.py monkeypatches these; a rename would make its
    patch fail (or, for a module attribute, silently do nothing)."""
    moved = []
    for module, attr in (("orbax.checkpoint._src.serialization.limits", "reserved_bytes"),
                         ("orbax.checkpoint._src.serialization.tensorstore_utils",
                          "_DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE")):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            moved.append(f"module {module} ({e})")
            continue
        if not hasattr(mod, attr):
            moved.append(f"{module}.{attr}")
    assert not moved, ("orbax private names used by tests/checkpoint/test_checkpoint_memory.py "
                       "moved: " + "; ".join(moved) + f" (orbax-checkpoint "
                       f"{importlib.metadata.version('orbax-checkpoint')})")


def test_orbax_target_file_size_patch_takes_effect(tmp_path, monkeypatch):
    """The private default OCDBT target file size still decides how orbax chunks a large
    array (what test_large_array_saved_as_one_chunk lowers to make its array 'large')."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import tensorstore_utils

    monkeypatch.setattr(tensorstore_utils, "_DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE", 2**12)
    x = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)  # 24 KiB > 4 KiB
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
        c.save((tmp_path / "p").absolute(), args=ocp.args.PyTreeSave({"w": x}))
        meta = c.metadata((tmp_path / "p").absolute()).item_metadata.tree
    assert tuple(meta["w"].storage.chunk_shape) != x.shape, (
        "orbax no longer reads tensorstore_utils._DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE when "
        "it chunks an array: tests/checkpoint/test_checkpoint_memory.py::"
        "test_large_array_saved_as_one_chunk would pass without testing anything")


def test_orbax_public_api_the_loader_uses():
    import orbax.checkpoint as ocp

    th = ocp.type_handlers
    missing = [f"ocp.type_handlers.{n}" for n in
               ("NumpyHandler", "ArrayHandler", "create_type_handler_registry")
               if not hasattr(th, n)]
    missing += [f"ocp.{n}" for n in ("Checkpointer", "PyTreeCheckpointHandler", "RestoreArgs",
                                     "ArrayRestoreArgs") if not hasattr(ocp, n)]
    assert not missing, f"orbax public API used by asynclane_jax.checkpoint moved: {missing}"
    wanted = {
        th.NumpyHandler: ("deepcopy_host_arrays",),
        ocp.PyTreeCheckpointHandler: ("type_handler_registry", "use_compression",
                                      "restore_concurrent_gb"),
        ocp.args.PyTreeSave: ("ocdbt_target_data_file_size",),
        ocp.args.PyTreeRestore: ("item", "restore_args", "partial_restore"),
        ocp.RestoreArgs: ("restore_type",),
        ocp.ArrayRestoreArgs: ("sharding", "global_shape"),
    }
    lost = [f"{cls.__name__}({p}=)" for cls, params in wanted.items() for p in params
            if p not in inspect.signature(cls).parameters]
    assert not lost, f"orbax arguments used by asynclane_jax.checkpoint moved: {lost}"


def _layout(params_dir: pathlib.Path) -> tuple[set, set]:
    names = {p.name for p in params_dir.iterdir()}
    meta = json.loads((params_dir / "_METADATA").read_text())
    return names, set(meta)


def test_orbax_writes_the_format_of_the_shipped_models(tmp_path):
    """A checkpoint written now has the layout of the shipped ones (same top-level files,
    same metadata keys, OCDBT, zarr v2), and the shipped ones read back in both loaders."""
    from asynclane_jax import checkpoint

    shipped = checkpoint.resolve("tiny-llada") / checkpoint.PARAMS_DIR
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    checkpoint.save_params(tmp_path / "p", {"a": {"w": x}, "b": x[0].astype(ml_dtypes.bfloat16)})
    new_names, new_keys = _layout(tmp_path / "p")
    old_names, old_keys = _layout(shipped)
    assert (new_names, new_keys) == (old_names, old_keys), (
        f"orbax {importlib.metadata.version('orbax-checkpoint')} writes another on-disk "
        f"layout than the shipped models: files {sorted(new_names ^ old_names)} and "
        f"_METADATA keys {sorted(new_keys ^ old_keys)} differ")
    import orbax.checkpoint as ocp

    assert ocp.type_handlers.is_ocdbt_checkpoint(shipped.absolute()), (
        "orbax no longer recognises the shipped models as OCDBT checkpoints")
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
        assert c.metadata(shipped.absolute()).item_metadata.use_zarr3 is False

    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for sharding in (single, rep):  # host reads placed on a device; reads into shards
        back = checkpoint.restore_params(tmp_path / "p", {
            "a": {"w": jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sharding)},
            "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)})
        np.testing.assert_array_equal(np.asarray(back["a"]["w"]), x)
        np.testing.assert_array_equal(np.asarray(back["b"]), x[0])
    model, _, _ = checkpoint.load("tiny-llada")
    assert model.cfg.vocab_size > 0


# --------------------------------------------------------------------------- safetensors

def test_safetensors_layout_the_reader_parses(tmp_path):
    """Files the installed safetensors writes are parsed by the hand-written reader into
    the same tensors (header length, JSON header, __metadata__, offsets, dtypes)."""
    from safetensors.numpy import load_file, save_file

    from checkpoints_convert import reader

    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "bf16": rng.standard_normal((4, 2, 3)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal(7).astype(np.float16),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "u8": np.arange(5, dtype=np.uint8),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    version = importlib.metadata.version("safetensors")
    try:
        infos = reader.read_safetensors_header(path)
    except Exception as e:
        pytest.fail(f"safetensors {version} writes files checkpoints_convert.reader cannot "
                    f"parse: {e}")
    assert {i.name for i in infos} == set(tensors), (
        f"safetensors {version}: the header lists {sorted(i.name for i in infos)}")
    reference = load_file(str(path))
    with open(path, "rb") as f:
        for info in infos:
            got = reader.read_at(f, info)
            assert got.dtype == tensors[info.name].dtype and got.shape == info.shape, (
                f"safetensors {version}: {info.name} parsed as {got.dtype}{got.shape}")
            np.testing.assert_array_equal(got, tensors[info.name], err_msg=(
                f"safetensors {version}: {info.name} read by hand differs from what was "
                "written (the file layout moved)"))
            np.testing.assert_array_equal(got, reference[info.name])
