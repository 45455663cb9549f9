"""Converted model folders: save and load.

A converted folder holds:
  config.json        {"format": "asynclane-jax", "format_version": 1,
                      "model": <ModelConfig fields>, "hf_config": <original config.json or null>}
  params/            an orbax checkpoint of the parameters (nested dict of arrays)
  tokenizer files    tokenizer.json and friends, copied verbatim (optional)

The same loader serves the shipped tiny models (by name) and converted 8B checkpoints.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from flax import nnx

from asynclane_jax.models.config import ModelConfig
from asynclane_jax.models.model import DiffusionLM, abstract_model

FORMAT = "asynclane-jax"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")

# Folder whose converted subfolders are the built-in shipped models, named by folder
# (the testbed's tiny models). It is listed on every lookup, not once at import, so a
# model exported there by the testbed trainer is loadable in the same process.
BUILTIN_MODELS_DIR = pathlib.Path(__file__).parent / "testbed" / "models"

# Shipped models added by `register_shipped`: name -> converted folder.
_registered: dict[str, pathlib.Path] = {}


class CheckpointError(ValueError):
    """A converted folder is missing, malformed, or does not match its config."""


def _builtin_models() -> dict[str, pathlib.Path]:
    if not BUILTIN_MODELS_DIR.is_dir():
        return {}
    return {p.name: p for p in BUILTIN_MODELS_DIR.iterdir() if (p / CONFIG_FILE).is_file()}


def shipped_registry() -> dict[str, pathlib.Path]:
    """Every shipped model: name -> converted folder, built-in and registered, by name."""
    return dict(sorted({**_builtin_models(), **_registered}.items()))


def shipped_models() -> list[str]:
    """Names of the shipped models (the package's own and any registered)."""
    return list(shipped_registry())


def register_shipped(name: str, folder: str | os.PathLike, *, replace: bool = False) -> None:
    """Makes a converted folder loadable by name, like the package's own models.

    Args:
      name: the model name, e.g. "my-tiny-llada"; no path separators (a name must not
        read as a relative folder path).
      folder: the converted folder (holding config.json).
      replace: let `name` point to another folder than it already does (built-in
        names included).
    Raises:
      CheckpointError for a bad name, a folder that is not converted (or whose config.json
      is not an asynclane-jax one), or a name taken.
    """
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise CheckpointError(f"shipped model name {name!r}: must be non-empty, without "
                              "path separators")
    path = pathlib.Path(folder).expanduser().absolute()
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path} is not a converted model folder (no {CONFIG_FILE})")
    read_config(path)  # refuses a Hugging Face snapshot or a malformed config now
    current = shipped_registry().get(name)
    if current is not None and current.absolute() != path and not replace:
        raise CheckpointError(f"shipped model {name!r} is already {current}; pass "
                              "replace=True to point it to another folder")
    _registered[name] = path


def unregister_shipped(name: str) -> None:
    """Removes a name added by `register_shipped` (built-in models stay)."""
    _registered.pop(name, None)


def resolve(path_or_name: str | os.PathLike) -> pathlib.Path:
    """Maps a shipped model name or a folder path to a converted folder.

    A folder path wins over a shipped name that reads the same.
    """
    p = pathlib.Path(path_or_name)
    if (p / CONFIG_FILE).is_file():
        return p
    shipped = shipped_registry().get(str(path_or_name))
    if shipped is not None:
        if not (shipped / CONFIG_FILE).is_file():  # a registered folder removed since
            raise CheckpointError(f"shipped model {str(path_or_name)!r}: {shipped} is no "
                                  f"longer a converted model folder (no {CONFIG_FILE})")
        return shipped
    if p.exists():
        raise CheckpointError(f"{p} is not a converted model folder (no {CONFIG_FILE})")
    raise CheckpointError(
        f"no model {str(path_or_name)!r}: not a folder, and not a shipped model "
        f"(shipped: {shipped_models() or 'none'})")


def params_to_numpy(model: DiffusionLM) -> dict:
    """The parameters as a nested dict of numpy arrays (string keys)."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree.map(np.asarray, _str_keys(pure))


def _str_keys(tree):
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _restore_keys(tree, template):
    """Gives a restored dict the key types (ints for layer lists) of the template."""
    if isinstance(template, dict):
        return {k: _restore_keys(tree[str(k)], v) for k, v in template.items()}
    return tree


def write_config(folder: pathlib.Path, cfg: ModelConfig, hf_config: dict | None,
                 extra: dict | None = None) -> None:
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": cfg.to_dict(),
            "hf_config": hf_config}
    if extra:
        data.update(extra)
    (folder / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_params(params_dir: pathlib.Path, params: dict) -> None:
    """Writes a nested dict of arrays as an orbax checkpoint, synchronously, no copies.

    orbax's defaults deep-copy host arrays before an asynchronous write and compress
    every array in memory; either doubles the peak memory for a model-sized dict. The
    write here is synchronous, so the arrays are written in place, uncompressed (bf16
    weights barely compress anyway). orbax also splits any array over its OCDBT target
    file size (2 GiB: a float32 output head) into chunks across its largest axis, which
    tensorstore can only fill by copying the whole array first; with no target size
    every array is one chunk, written from the array itself. `load_model` reads the
    result.
    """
    import orbax.checkpoint as ocp

    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry,
                                          use_compression=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(params_dir.absolute(), args=ocp.args.PyTreeSave(
            _str_keys(params), ocdbt_target_data_file_size=0))


def save(folder: str | os.PathLike, model: DiffusionLM, *, hf_config: dict | None = None,
         tokenizer_dir: str | os.PathLike | None = None, extra: dict | None = None,
         overwrite: bool = False) -> pathlib.Path:
    """Saves a model as a converted folder, atomically (temp folder, then rename).

    Args:
      folder: destination.
      model: the model.
      hf_config: original Hugging Face config to keep verbatim.
      tokenizer_dir: folder whose tokenizer files are copied in.
      extra: additional top-level entries for config.json (e.g. a model card summary).
      overwrite: replace an existing destination.
    Returns:
      The destination path.
    """
    dst = pathlib.Path(folder).absolute()
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists; pass overwrite=True to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        write_config(tmp, model.cfg, hf_config, extra)
        save_params(tmp / PARAMS_DIR, params_to_numpy(model))
        if tokenizer_dir is not None:
            copy_tokenizer_files(pathlib.Path(tokenizer_dir), tmp)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def copy_tokenizer_files(src: pathlib.Path, dst: pathlib.Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def read_config(folder: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Reads a converted folder's config.json; returns (ModelConfig, the whole json)."""
    folder = resolve(folder)
    try:
        data = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder / CONFIG_FILE} is not valid JSON: {e}") from None
    if data.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder / CONFIG_FILE} is not an asynclane-jax config; if this is a Hugging Face "
            "snapshot, convert it first with `asynclane-jax convert SRC DST`")
    return ModelConfig.from_dict(data["model"]), data


def load_model(folder: str | os.PathLike, *, dtype: str | None = None,
               mesh=None) -> DiffusionLM:
    """Loads the model of a converted folder (or shipped name).

    Each parameter is read straight into its final place, one tensor (or a few small
    ones) in flight at a time: the host holds the parameters already placed plus about
    the largest tensor, never a second whole copy.

    Args:
      folder: a converted folder or a shipped model name.
      dtype: override the stored compute/param dtype ("float32", "bfloat16"); each
        tensor is cast on the host as it is read.
      mesh: place the parameters on a mesh: a `jax.sharding.Mesh` with the axes
        `sharding.MESH_AXES`, or a spec such as "data=2,tensor=4" (see
        `sharding.make_mesh`). Each parameter is then restored into its shards of
        `sharding.plan_for(cfg, mesh)` (every host reads only the shards of its own
        devices); None: everything on the default device.
    Raises:
      CheckpointError for a folder whose parameters do not match its config, and for a
      mesh that cannot be used (wrong device count, axes other than data/fsdp/tensor).
    """
    folder = resolve(folder)
    cfg, _ = read_config(folder)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    graphdef, abs_state = nnx.split(abstract_model(cfg))
    template = nnx.to_pure_dict(abs_state)
    shardings = _str_keys(nnx.to_pure_dict(_param_shardings(cfg, abs_state, mesh)))
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          _str_keys(template), shardings)
    restored = restore_params(folder / PARAMS_DIR, target)
    nnx.replace_by_pure_dict(abs_state, _restore_keys(restored, template))
    return nnx.merge(graphdef, abs_state)


def _param_shardings(cfg: ModelConfig, abs_state: nnx.State, mesh) -> nnx.State:
    """The sharding of every parameter: the plan's on a mesh, else the default device."""
    from asynclane_jax import sharding

    try:
        return sharding.param_shardings(cfg, abs_state, mesh)
    except ValueError as e:  # ShardingError and friends: name the model and the mesh
        shown = mesh if isinstance(mesh, str) or not hasattr(mesh, "shape") else dict(mesh.shape)
        raise CheckpointError(f"cannot load {cfg.family} ({cfg.n_heads} heads, vocabulary "
                              f"{cfg.vocab_size}) on mesh {shown!r}: {e}") from e


def restore_params(params_dir: pathlib.Path, target: dict) -> dict:
    """Restores an orbax checkpoint of arrays into `target`'s shapes, dtypes, shardings.

    Args:
      params_dir: the checkpoint (a converted folder's params/).
      target: nested dict of jax.ShapeDtypeStruct with a sharding each (string keys).
    Returns:
      The nested dict of jax.Arrays.

    Targets each on one device are read one array at a time by `_restore_one_device`.
    Others (shardings on a mesh) go through orbax's restore, which reads on each host
    only the shards of its devices; orbax reads every array at once by default (host
    buffers for the whole model alive together with their device copies), so the bytes
    in flight are limited here to about the largest array (orbax's restore byte limiter,
    sized from the checkpoint's own metadata). Either way a dtype cast happens in the
    read, per array, on the host. Figures: experiments/results/load_memory.md.
    """
    import orbax.checkpoint as ocp

    path = params_dir.absolute()
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            item_metadata = ckptr.metadata(path).item_metadata
        stored = item_metadata.tree
    except Exception as e:  # orbax raises several types for bad checkpoints
        raise CheckpointError(f"cannot read parameters in {params_dir}: {e}") from e
    flat_stored, flat_target = _flat(stored), _flat(target)
    _check_shapes(params_dir, flat_stored, flat_target)
    if all(isinstance(t.sharding, jax.sharding.SingleDeviceSharding)
           for t in flat_target.values()):
        return _restore_one_device(params_dir, target, use_zarr3=item_metadata.use_zarr3)
    in_flight = max(_read_bytes(flat_stored[k], t) for k, t in flat_target.items()) + 1
    restore_args = jax.tree.map(
        lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape,
                                       dtype=t.dtype), target)
    handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=in_flight / 10**9)
    with ocp.Checkpointer(handler) as ckptr:
        try:
            return ckptr.restore(path, args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args))
        except Exception as e:
            raise CheckpointError(f"cannot read parameters in {params_dir}: {e}") from e


def _aligned_empty(shape: tuple, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary: what the
    CPU backend needs to adopt a host buffer without copying it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _restore_one_device(params_dir: pathlib.Path, target: dict, *,
                        use_zarr3: bool) -> dict:
    """Reads the arrays one at a time onto their (single) devices.

    orbax's restore reads each array into a fresh numpy buffer beside tensorstore's own
    read buffer, then copies it to the device: three copies of the array being read.
    Here tensorstore fills a 64-byte-aligned buffer (casting to the target dtype as it
    reads), which `jax.device_put` adopts without copying on the CPU backend and copies
    once elsewhere; the buffer is dropped before the next array is read. The host holds
    the arrays already placed plus about two of the array in flight at most.

    The tensorstore specs come from orbax's public `type_handlers` (the same functions
    its own restore uses); `use_zarr3` is the checkpoint's (its tree metadata's), and
    OCDBT is detected from the checkpoint's files as orbax does.
    """
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    path = params_dir.absolute()
    use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(path)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)

    def read(keys: tuple, t: jax.ShapeDtypeStruct) -> jax.Array:
        name = ".".join(str(getattr(k, "key", k)) for k in keys)
        info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(path),
                                           is_ocdbt_checkpoint=use_ocdbt,
                                           use_zarr3=use_zarr3, ts_context=context)
        spec = ocp.type_handlers.get_cast_tspec_deserialize(
            ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt),
            ocp.RestoreArgs(dtype=t.dtype))
        try:
            store = ts.open(ts.Spec(spec), open=True, read=True, context=context).result()
            out = _aligned_empty(tuple(store.shape), t.dtype)
            ts.array(out).write(store).result()
        except Exception as e:  # tensorstore's errors for missing / corrupt data
            raise CheckpointError(f"cannot read parameter {name} in {params_dir}: "
                                  f"{e}") from e
        del store
        return jax.device_put(out, t.sharding).block_until_ready()

    return jax.tree_util.tree_map_with_path(read, target)


def _read_bytes(meta, target) -> int:
    """What orbax reserves to read one array: the stored chunks covering it, whole, in
    the dtype it is read as (the target's: tensorstore casts while reading)."""
    shape = tuple(meta.shape)
    chunks = getattr(getattr(meta, "storage", None), "chunk_shape", None) or shape
    n = 1
    for dim, chunk in zip(shape, chunks, strict=True):
        n *= -(-dim // max(chunk, 1)) * max(chunk, 1)
    return n * max(np.dtype(meta.dtype).itemsize, np.dtype(target.dtype).itemsize)


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(params_dir: pathlib.Path, flat_stored: dict, flat_target: dict) -> None:
    missing = sorted(set(flat_target) - set(flat_stored))
    wrong = [f"{k}: stored {tuple(flat_stored[k].shape)}, model {tuple(t.shape)}"
             for k, t in flat_target.items()
             if k in flat_stored and tuple(flat_stored[k].shape) != tuple(t.shape)]
    if missing or wrong:
        parts = ([f"missing {', '.join(missing[:8])}"] if missing else []) + wrong[:8]
        raise CheckpointError(f"parameters in {params_dir} do not match the config: "
                              + "; ".join(parts))


def load_tokenizer(folder: str | os.PathLike):
    """The folder's tokenizer as a transformers PreTrainedTokenizerFast, or None.

    Never executes code from the folder (no trust_remote_code).
    """
    folder = resolve(folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        tok_cfg = json.loads(cfg_path.read_text())
        for key in ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token"):
            tok = tok_cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                kwargs[key] = tok
        if isinstance(tok_cfg.get("chat_template"), str):
            kwargs["chat_template"] = tok_cfg["chat_template"]
    if "chat_template" not in kwargs and (folder / "chat_template.jinja").is_file():
        kwargs["chat_template"] = (folder / "chat_template.jinja").read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)


def load(path_or_name: str | os.PathLike, *, dtype: str | None = None, mesh=None):
    """Loads a converted folder or shipped model.

    Args:
      path_or_name: a folder written by `asynclane-jax convert` / `save`, or a shipped
        model name such as "tiny-llada".
      dtype: override the stored compute/param dtype ("float32", "bfloat16").
      mesh: a `jax.sharding.Mesh` or a spec such as "data=2,tensor=4": each parameter
        is restored straight into its shards (`sharding.plan_for`), so no host holds
        the whole model; `generate` then runs on that mesh. None: one device.
    Returns:
      (model, tokenizer or None, ModelConfig).
    """
    folder = resolve(path_or_name)
    model = load_model(folder, dtype=dtype, mesh=mesh)
    return model, load_tokenizer(folder), model.cfg
