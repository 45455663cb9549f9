"""Converted model folders: save and load.

A converted folder holds:
  config.json        {"format": "asynclane-jax", "format_version": 1,
                      "model": <ModelConfig fields>, "hf_config": <original config.json or null>}
  params/            an orbax checkpoint of the parameters (nested dict of arrays)
  digests.json       a digest of every stored array (see `array_digest`), recorded when the
                     folder was written; `load` checks each array against it as it is read
                     (`verify=False` or ASYNCLANE_VERIFY=0 to skip) and `verify_folder`
                     (`asynclane-jax verify DIR`) checks a folder on demand
  tokenizer files    tokenizer.json and friends, copied verbatim (optional)

The same loader serves the shipped tiny models (by name) and converted 8B checkpoints.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import pathlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from asynclane_jax.models import quantize as quantize_lib
from asynclane_jax.models.config import ConfigError, ModelConfig, show
from asynclane_jax.models.model import DiffusionLM, abstract_model

FORMAT = "asynclane-jax"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# config.json's key for weights stored quantized ("int8": int8 kernels and their scales).
QUANTIZATION_KEY = "quantization"
# config.json's key for the layers whose stored int8 values are [..., out, in]
# (`Linear.int8_out_in`: q / k / v); a folder of int8 weights without it was written
# before that layout and is refused with a message saying how to make it again.
INT8_OUT_IN_KEY = "int8_out_in"
DIGESTS_FILE = "digests.json"
COMMIT_MARKER = "commit_success.txt"  # orbax's completion marker in params/
COMMIT_MARKER_TEXT = "Checkpoint commit was successful"
DIGESTS_FORMAT = "asynclane-jax-digests"
# sha256 over the concatenated sha256 digests of the array's bytes in chunks of this size
# (one chunk for a smaller array): the chunks of a large array hash in parallel.
DIGEST_ALGORITHM = "sha256-chunks-64MiB"
DIGEST_CHUNK = 64 * 2**20
# Set to 0 to load without checking the digests (as `load(..., verify=False)`).
VERIFY_ENV = "ASYNCLANE_VERIFY"
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


# --------------------------------------------------------------------------- signals

@contextlib.contextmanager
def signals_held(*, raise_after: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM arriving inside are held, not acted on, until the block ends;
    then (with raise_after) KeyboardInterrupt is raised if one came.

    For work that must not stop halfway: orbax's save (whose writer threads would go on
    filling a folder being removed), renames that install a folder, and the removal of
    a temporary folder itself. Outside the main thread signals cannot be handled here:
    the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if arrived and raise_after:
        raise KeyboardInterrupt


def remove_tree(path: pathlib.Path | None) -> None:
    """Removes a temporary folder, every file of it, with signals held meanwhile."""
    if path is None:
        return
    with signals_held(raise_after=False):
        for _ in range(5):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                return


# --------------------------------------------------------------------------- digests

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, min(8, os.cpu_count() or 1)),
                thread_name_prefix="asynclane-digest")
        return _pool


def array_digest(array: np.ndarray) -> str:
    """The digest of an array's bytes as stored (C order, little-endian), hex.

    sha256 of the concatenated sha256 digests of its bytes in DIGEST_CHUNK pieces (a
    smaller array is one piece): a large array's pieces hash in parallel (hashlib
    releases the GIL), and it is computed on an array already in memory, no copy.
    Reproducible without this package:
    `sha256(b"".join(sha256(piece).digest() for piece in pieces)).hexdigest()`.
    """
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    data = memoryview(a.reshape(-1).view(np.uint8))
    pieces = [data[i:i + DIGEST_CHUNK] for i in range(0, len(data), DIGEST_CHUNK)] or [data]
    hash_one = lambda piece: hashlib.sha256(piece).digest()
    digests = (list(_hash_pool().map(hash_one, pieces)) if len(pieces) > 1
               else [hash_one(pieces[0])])
    return hashlib.sha256(b"".join(digests)).hexdigest()


def digest_entry(array: np.ndarray) -> dict:
    """What digests.json records of one array: its dtype, shape and digest."""
    return {"dtype": np.dtype(array.dtype).name, "shape": list(array.shape),
            "digest": array_digest(array)}


def flat_arrays(tree, prefix: str = "") -> dict[str, Any]:
    """A nested dict of arrays as {"layers.0.attn.q_proj.kernel": array}: the names orbax
    gives the stored arrays, which key digests.json."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_arrays(v, name + "."))
        else:
            out[name] = v
    return out


def write_digests(folder: pathlib.Path, entries: Mapping[str, dict]) -> None:
    """Writes digests.json: {"format", "algorithm", "arrays": {name: entry}}."""
    data = {"format": DIGESTS_FORMAT, "algorithm": DIGEST_ALGORITHM,
            "arrays": dict(sorted(entries.items()))}
    (pathlib.Path(folder) / DIGESTS_FILE).write_text(json.dumps(data, indent=1) + "\n")


def read_digests(folder: pathlib.Path) -> dict[str, dict] | None:
    """The recorded digests of a converted folder (name -> entry), or None for a folder
    written before digests were recorded.

    Raises:
      CheckpointError for a digests.json that is unreadable or not in the format.
    """
    path = pathlib.Path(folder) / DIGESTS_FILE
    if not os.path.lexists(path):
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is unreadable: {str(e)[:120]}") from None
    arrays = data.get("arrays") if isinstance(data, dict) else None
    ok = (isinstance(arrays, dict) and data.get("format") == DIGESTS_FORMAT
          and data.get("algorithm") == DIGEST_ALGORITHM
          and all(isinstance(e, dict) and isinstance(e.get("digest"), str)
                  and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
                  for e in arrays.values()))
    if not ok:
        raise CheckpointError(f"{path} is not a digests file of this version "
                              f"(format {DIGESTS_FORMAT!r}, algorithm {DIGEST_ALGORITHM!r})")
    return arrays


def printable(path) -> str:
    """A path as text any terminal can show: bytes that were not UTF-8 (surrogate
    escapes) are written as backslash escapes instead of failing to print."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def _verify_by_default() -> bool:
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


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
    try:
        return _resolve(path_or_name)
    except (OSError, ValueError) as e:  # a name too long for the OS, a NUL in a path
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"no model {show(str(path_or_name))}: {e}") from None


def _resolve(path_or_name: str | os.PathLike) -> pathlib.Path:
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
    # orbax leaves a marker naming the absolute path it wrote to (a temporary folder on
    # this machine); nothing reads its text, so it is rewritten without the path.
    marker = params_dir / COMMIT_MARKER
    if marker.is_file():
        marker.write_text(COMMIT_MARKER_TEXT)


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
    stored = quantize_lib.quantization_of(model)
    if stored is not None:
        extra = {**(extra or {}), QUANTIZATION_KEY: stored,
                 INT8_OUT_IN_KEY: list(quantize_lib.out_in_layers(model))}
    tmp = None
    try:
        with signals_held():
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
        write_config(tmp, model.cfg, hf_config, extra)
        params = params_to_numpy(model)
        write_digests(tmp, {k: digest_entry(v) for k, v in flat_arrays(params).items()})
        with signals_held():
            save_params(tmp / PARAMS_DIR, params)
        del params
        if tokenizer_dir is not None:
            copy_tokenizer_files(pathlib.Path(tokenizer_dir), tmp)
        with signals_held():
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(tmp, dst)
    except BaseException:
        remove_tree(tmp)
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
    path = folder / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise CheckpointError(f"{path} is not a readable JSON file: {str(e)[:120]}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not an asynclane-jax config; if this is a Hugging Face "
            "snapshot, convert it first with `asynclane-jax convert SRC DST`")
    if data.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {show(data.get('format_version'))}; "
                              f"this asynclane-jax reads version {FORMAT_VERSION}")
    try:
        return ModelConfig.from_dict(data.get("model")), data
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def stored_quantization(data: dict) -> str | None:
    """The quantization a folder's weights are stored in (config.json's
    "quantization": "int8" when the converter or `save` wrote int8 kernels with their
    scales), None for float weights.

    Raises:
      CheckpointError for a value this version cannot read.
    """
    value = data.get(QUANTIZATION_KEY)
    if value is None:
        return None
    try:
        return quantize_lib.check_mode(value)
    except quantize_lib.QuantizeError:
        raise CheckpointError(f"config.json: {QUANTIZATION_KEY} {show(value)}; this "
                              f"asynclane-jax reads {', '.join(quantize_lib.MODES)}") from None


def load_model(folder: str | os.PathLike, *, dtype: str | None = None,
               mesh=None, verify: bool | None = None,
               scan_layers: bool | None = None, quantize: str | None = None) -> DiffusionLM:
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
      verify: check every array against the folder's digests.json as it is read (each
        array is hashed once, in memory; on a mesh the arrays are first read whole one
        at a time to be checked). None: yes unless ASYNCLANE_VERIFY=0. A folder without
        digests.json (written before digests were recorded) loads unchecked.
      scan_layers: the model's layer layout (`ModelConfig.scan_layers`); None: the
        folder's. A folder stored in the other layout is read as stored (and checked
        against its digests as stored), then each layer tensor is stacked or split on
        its devices, exactly, one tensor at a time (`model.stack_layer_params`).
      quantize: "int8" for int8 weights with per-channel scales in every linear layer
        (asynclane_jax.models.quantize); each kernel is quantized on its device as soon
        as it is read (on one device no whole float copy of the weights is ever held;
        on a mesh orbax reads the float shards first); None or "none": as stored. A
        folder stored in int8 (`convert --quantize int8`) is read as it is, with either
        value: its float weights are not there to go back to.
    Raises:
      CheckpointError for a folder whose parameters do not match its config or their
      digests (naming the array), and for a mesh that cannot be used (wrong device
      count, axes other than data/fsdp/tensor); QuantizeError for an unknown quantize.
    """
    mode = quantize_lib.check_mode(quantize)
    folder = resolve(folder)
    cfg, data = read_config(folder)
    stored_mode = stored_quantization(data)
    verify = _verify_by_default() if verify is None else verify
    digests = read_digests(folder) if verify else None
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    stored_cfg = cfg
    if scan_layers is not None:
        cfg = cfg.replace(scan_layers=bool(scan_layers))
    graphdef, abs_state = nnx.split(abstract_model(cfg))
    template = nnx.to_pure_dict(abs_state)
    target = _target(cfg, abs_state, mesh)
    read_target, on_read = target, None
    if stored_mode is not None or mode is not None:
        graphdef, abs_state = nnx.split(quantize_lib.abstract_quantized(
            nnx.merge(graphdef, abs_state), stored_mode or mode))
        template = nnx.to_pure_dict(abs_state)
        target = _target(cfg, abs_state, mesh)
        out_in = quantize_lib.out_in_layers(nnx.merge(graphdef, abs_state))
        if stored_mode is None:  # the float kernels are read, each quantized as it arrives
            on_read = functools.partial(_quantize_kernel, out_in=frozenset(out_in))
        else:  # int8 kernels and their scales, read as stored
            _check_int8_layout(folder, data, out_in)
            read_target = target
    if stored_cfg.scan_layers == cfg.scan_layers:
        restored = restore_params(folder / PARAMS_DIR, read_target, digests=digests,
                                  on_read=on_read)
    else:  # read in the stored layout, then stack or split the layers on their devices
        stored_model = abstract_model(stored_cfg)
        if stored_mode is not None:
            stored_model = quantize_lib.abstract_quantized(stored_model, stored_mode)
        stored_target = _target(stored_cfg, nnx.split(stored_model)[1], mesh)
        restored = relayout_params(
            restore_params(folder / PARAMS_DIR, stored_target, digests=digests,
                           on_read=on_read),
            cfg.n_layers, target)
    if on_read is not None:  # the scales where the plan puts them
        restored = jax.tree.map(
            lambda a, t: a if a.sharding == t.sharding else jax.device_put(a, t.sharding),
            restored, target)
    nnx.replace_by_pure_dict(abs_state, _restore_keys(restored, template))
    return nnx.merge(graphdef, abs_state)


def _quantize_kernel(name: str, array: jax.Array, out_in: frozenset = frozenset()):
    """`restore_params`' on_read for `load_model(quantize="int8")`: a linear layer's
    kernel (every stored `...kernel`) becomes {"kernel": int8 values, "scale": scales},
    computed on its device, transposed for the layers named in out_in; any other array
    is kept."""
    if not name.endswith("kernel"):
        return array
    values, scale = quantize_lib.quantize_array(
        array, out_in=quantize_lib.layer_of(name) in out_in)
    return {"kernel": values, "scale": scale}


def _check_int8_layout(folder, data: dict, out_in) -> None:
    """Refuses int8 weights stored with another [out, in] layer set than the model's."""
    stored = data.get(INT8_OUT_IN_KEY)
    if isinstance(stored, list) and sorted(map(str, stored)) == sorted(out_in):
        return
    raise CheckpointError(
        f"{folder}: its int8 weights keep {show(stored)} as [out, in] ({INT8_OUT_IN_KEY} in "
        f"config.json), this asynclane-jax keeps {list(out_in)}; convert the float "
        "checkpoint again with --quantize int8, or load the float folder with "
        "quantize=\"int8\"")


def _merge_read(tree):
    """Puts what an on_read returned as a dict in a leaf's place beside it: {"kernel":
    {"kernel": v, "scale": s}} -> {"kernel": v, "scale": s}."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if k == "kernel" and isinstance(v, dict) and set(v) == {"kernel", "scale"}:
            out.update(v)
        else:
            out[k] = _merge_read(v)
    return out


def _target(cfg: ModelConfig, abs_state: nnx.State, mesh) -> dict:
    """ShapeDtypeStructs with their shardings for every parameter (string keys)."""
    shardings = _str_keys(nnx.to_pure_dict(_param_shardings(cfg, abs_state, mesh)))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        _str_keys(nnx.to_pure_dict(abs_state)), shardings)


def relayout_params(params: dict, n_layers: int, target: dict) -> dict:
    """Parameters (string keys, arrays on their devices) in the layer layout of
    `target` (ShapeDtypeStructs with shardings, as `load_model` builds), each result
    placed by its target's sharding. Exact; consumes `params`' layers (one layer tensor
    in both layouts at a time)."""
    from asynclane_jax.models.model import layer_layout, stack_layer_params, unstack_layer_params

    want = layer_layout(target)
    if layer_layout(params) == want:
        return params
    layers = params.pop("layers")
    params = {k: v for k, v in params.items()}
    if want == "stacked":
        out = stack_layer_params({"layers": layers}, n_layers)["layers"]
    else:
        out = unstack_layer_params({"layers": layers}, n_layers, str_keys=True)["layers"]
    del layers
    params["layers"] = jax.tree.map(lambda a, t: jax.device_put(a, t.sharding),
                                    out, target["layers"])
    return params


def _param_shardings(cfg: ModelConfig, abs_state: nnx.State, mesh) -> nnx.State:
    """The sharding of every parameter: the plan's on a mesh, else the default device."""
    from asynclane_jax import sharding

    try:
        return sharding.param_shardings(cfg, abs_state, mesh)
    except ValueError as e:  # ShardingError and friends: name the model and the mesh
        shown = mesh if isinstance(mesh, str) or not hasattr(mesh, "shape") else dict(mesh.shape)
        raise CheckpointError(f"cannot load {cfg.family} ({cfg.n_heads} heads, vocabulary "
                              f"{cfg.vocab_size}) on mesh {shown!r}: {e}") from e


def restore_params(params_dir: pathlib.Path, target: dict, *,
                   digests: Mapping[str, dict] | None = None, on_read=None) -> dict:
    """Restores an orbax checkpoint of arrays into `target`'s shapes, dtypes, shardings.

    Args:
      params_dir: the checkpoint (a converted folder's params/).
      target: nested dict of jax.ShapeDtypeStruct with a sharding each (string keys).
      digests: the folder's digests.json entries: each array is checked against its
        entry as stored (before any dtype cast); None: no check.
      on_read: called as on_read(name, array) with each array once it is on its
        device(s) (name as in digests.json); what it returns takes the array's place,
        and a dict it returns is put beside it (`_merge_read`); on one device the next
        array is read only then. None: the arrays as read.
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
    if digests is not None:
        _check_listing(params_dir, digests, flat_arrays(_tree_dict(stored)))
    if all(isinstance(t.sharding, jax.sharding.SingleDeviceSharding)
           for t in flat_target.values()):
        restored = _restore_one_device(params_dir, target, use_zarr3=item_metadata.use_zarr3,
                                       digests=digests, on_read=on_read)
        return restored if on_read is None else _merge_read(restored)
    if digests is not None:  # orbax reads shards; check each array whole first
        bad = _verify_arrays(params_dir, digests, use_zarr3=item_metadata.use_zarr3,
                             first_only=True)
        if bad:
            raise CheckpointError(_corrupt_message(params_dir, bad))
    in_flight = max(_read_bytes(flat_stored[k], t) for k, t in flat_target.items()) + 1
    restore_args = jax.tree.map(
        lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape,
                                       dtype=t.dtype), target)
    handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=in_flight / 10**9)
    with ocp.Checkpointer(handler) as ckptr:
        try:
            restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args))
        except Exception as e:
            raise CheckpointError(f"cannot read parameters in {params_dir}: {e}") from e
    if on_read is None:
        return restored
    flat = flat_arrays(restored)
    for name in list(flat):
        flat[name] = on_read(name, flat.pop(name))
    return _merge_read(_tree_dict_of_meta(flat))


def _aligned_empty(shape: tuple, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary: what the
    CPU backend needs to adopt a host buffer without copying it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _restore_one_device(params_dir: pathlib.Path, target: dict, *,
                        use_zarr3: bool, digests: Mapping[str, dict] | None = None,
                        on_read=None) -> dict:
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

    With `digests`, each array is read in its stored dtype and hashed in a background
    thread while the next one is read (one hash in flight: a stored array is kept at
    most until the next has been read), then cast on the host if the target's dtype
    differs (numpy's cast, round to nearest even as tensorstore's). A mismatch is
    raised, naming the array, before the model is returned.
    """
    reader = _ArrayReader(params_dir, use_zarr3=use_zarr3)
    pending: list[tuple[str, concurrent.futures.Future]] = []

    def check_pending() -> None:
        while pending:
            name, digest = pending.pop()
            if digest.result() != digests[name]["digest"]:
                raise CheckpointError(_corrupt_message(params_dir, [name]))

    def read(keys: tuple, t: jax.ShapeDtypeStruct) -> jax.Array:
        name = ".".join(str(getattr(k, "key", k)) for k in keys)
        if digests is None:
            out = reader.read(name, t.dtype)
        else:
            out = reader.read(name, None)
            check_pending()
            pending.append((name, hasher.submit(array_digest, out)))
            if out.dtype != np.dtype(t.dtype):
                cast = _aligned_empty(out.shape, t.dtype)
                cast[...] = out
                out = cast
        placed = jax.device_put(out, t.sharding).block_until_ready()
        return placed if on_read is None else on_read(name, placed)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load-check") as hasher:
        restored = jax.tree_util.tree_map_with_path(read, target)
        if digests is not None:
            check_pending()
    return restored


class _ArrayReader:
    """Reads whole stored arrays of an orbax checkpoint by name, through the tensorstore
    specs of orbax's public `type_handlers`, into 64-byte-aligned numpy buffers."""

    def __init__(self, params_dir: pathlib.Path, *, use_zarr3: bool):
        import orbax.checkpoint as ocp

        self.params_dir = params_dir
        self.path = params_dir.absolute()
        self.use_zarr3 = use_zarr3
        self.use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self.path)
        self.context = ocp.type_handlers.get_ts_context(use_ocdbt=self.use_ocdbt)

    def read(self, name: str, dtype=None) -> np.ndarray:
        """The array `name`, cast to dtype as tensorstore reads it (None: as stored)."""
        import orbax.checkpoint as ocp
        import tensorstore as ts
        from etils import epath

        info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(self.path),
                                           is_ocdbt_checkpoint=self.use_ocdbt,
                                           use_zarr3=self.use_zarr3, ts_context=self.context)
        spec = ocp.type_handlers.get_cast_tspec_deserialize(
            ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.use_ocdbt),
            ocp.RestoreArgs(dtype=dtype))
        try:
            store = ts.open(ts.Spec(spec), open=True, read=True, context=self.context).result()
            out = _aligned_empty(tuple(store.shape),
                                 store.dtype.numpy_dtype if dtype is None else dtype)
            ts.array(out).write(store).result()
        except Exception as e:  # tensorstore's errors for missing / corrupt data
            raise CheckpointError(f"cannot read parameter {name} in {self.params_dir}: "
                                  f"{str(e)[:300]}") from e
        return out


def _tree_dict(tree):
    """orbax's metadata tree as plain nested dicts (string keys)."""
    if isinstance(tree, Mapping):
        return {str(k): _tree_dict(v) for k, v in tree.items()}
    return tree


def _check_listing(params_dir: pathlib.Path, digests: Mapping[str, dict],
                   stored: Mapping[str, Any]) -> None:
    """The digests must list exactly the stored arrays, with their dtypes and shapes."""
    problems = [f"{n} is stored but has no digest" for n in sorted(set(stored) - set(digests))]
    problems += [f"{n} has a digest but is not stored" for n in sorted(set(digests) - set(stored))]
    for name in sorted(set(stored) & set(digests)):
        meta, entry = stored[name], digests[name]
        if (list(meta.shape) != entry["shape"]
                or np.dtype(meta.dtype).name != entry["dtype"]):
            problems.append(f"{name} is stored as {np.dtype(meta.dtype).name}"
                            f"{list(meta.shape)}, recorded as {entry['dtype']}{entry['shape']}")
    if problems:
        raise CheckpointError(f"parameters in {params_dir} do not match "
                              f"{DIGESTS_FILE}: " + "; ".join(problems[:6])
                              + ("; ..." if len(problems) > 6 else ""))


def _corrupt_message(params_dir: pathlib.Path, names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"{params_dir.parent} is corrupt: parameter{'s' if len(names) > 1 else ''} "
            f"{shown} differ{'' if len(names) > 1 else 's'} from the digest recorded when the "
            f"folder was written ({DIGESTS_FILE}); convert or copy the model again")


def _verify_arrays(params_dir: pathlib.Path, digests: Mapping[str, dict], *,
                   use_zarr3: bool, first_only: bool = False) -> list[str]:
    """The names of the stored arrays whose bytes do not match their digests (each read
    whole in its stored dtype, one at a time)."""
    reader = _ArrayReader(params_dir, use_zarr3=use_zarr3)
    bad = []
    for name in sorted(digests):
        try:
            ok = array_digest(reader.read(name)) == digests[name]["digest"]
        except CheckpointError:
            ok = False
        if not ok:
            bad.append(name)
            if first_only:
                break
    return bad


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


def _read_json_object(path: pathlib.Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a valid {what}: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a valid {what}: not a JSON object")
    return data


def check_chat_template(template: str, where) -> None:
    """Raises CheckpointError for a chat template that is not valid Jinja (it would
    otherwise fail only when `--chat` first uses it)."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError:  # transformers needs it to apply templates at all
        return

    class Generation(jinja2.ext.Extension):
        # transformers' {% generation %} ... {% endgeneration %} (assistant-token masks)
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body)

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, Generation])
    try:
        env.parse(template)
    except jinja2.TemplateError as e:
        raise CheckpointError(f"the chat template of {where} is not valid Jinja: "
                              f"{str(e)[:120]}") from None


def load_tokenizer(folder: str | os.PathLike):
    """The folder's tokenizer as a transformers PreTrainedTokenizerFast, or None.

    Never executes code from the folder (no trust_remote_code).

    Raises:
      CheckpointError for a tokenizer.json, tokenizer_config.json or chat template that
      cannot be read.
    """
    folder = resolve(folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        tok_cfg = _read_json_object(cfg_path, "tokenizer config")
        for key in ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token"):
            tok = tok_cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                kwargs[key] = tok
        if isinstance(tok_cfg.get("chat_template"), str):
            kwargs["chat_template"] = tok_cfg["chat_template"]
    template = folder / "chat_template.jinja"
    if "chat_template" not in kwargs and template.is_file():
        try:
            kwargs["chat_template"] = template.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{template} is not a readable chat template: "
                                  f"{str(e)[:120]}") from None
    if "chat_template" in kwargs:
        check_chat_template(kwargs["chat_template"], folder)
    tok_path = folder / "tokenizer.json"
    _read_json_object(tok_path, "tokenizer")  # a clear message for what is not JSON
    try:
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_path), **kwargs)
    except Exception as e:  # the tokenizers library's parse errors have no common type
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{tok_path} is not a valid tokenizer: {first[:160]}") from None


def load(path_or_name: str | os.PathLike, *, dtype: str | None = None, mesh=None,
         verify: bool | None = None, scan_layers: bool | None = None,
         quantize: str | None = None):
    """Loads a converted folder or shipped model.

    Args:
      path_or_name: a folder written by `asynclane-jax convert` / `save`, or a shipped
        model name such as "tiny-llada".
      dtype: override the stored compute/param dtype ("float32", "bfloat16").
      mesh: a `jax.sharding.Mesh` or a spec such as "data=2,tensor=4": each parameter
        is restored straight into its shards (`sharding.plan_for`), so no host holds
        the whole model; `generate` then runs on that mesh. None: one device.
      verify: check every array against the folder's digests.json (see `load_model`);
        None: yes unless the environment sets ASYNCLANE_VERIFY=0.
      scan_layers: the model's layer layout (see `load_model`); None: the folder's.
      quantize: "int8": int8 weights with per-channel scales in the linear layers,
        quantized as they are read (see `load_model`); None or "none": as stored.
    Returns:
      (model, tokenizer or None, ModelConfig).
    Raises:
      CheckpointError for a folder that is missing, malformed, corrupt (an array that
      differs from its digest is named) or whose tokenizer files cannot be read.
    """
    folder = resolve(path_or_name)
    tokenizer = load_tokenizer(folder)  # a bad tokenizer fails before the weights load
    model = load_model(folder, dtype=dtype, mesh=mesh, verify=verify,
                       scan_layers=scan_layers, quantize=quantize)
    return model, tokenizer, model.cfg


# --------------------------------------------------------------------------- verify

def _stored_metadata(params_dir: pathlib.Path):
    import orbax.checkpoint as ocp

    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            item_metadata = ckptr.metadata(params_dir.absolute()).item_metadata
    except Exception as e:  # orbax raises several types for bad checkpoints
        raise CheckpointError(f"cannot read parameters in {params_dir}: "
                              f"{str(e)[:300]}") from e
    return flat_arrays(_tree_dict(item_metadata.tree)), item_metadata.use_zarr3


def verify_folder(folder: str | os.PathLike) -> int:
    """Checks a converted folder on demand: its config, that its parameters fit the
    config, and every stored array against digests.json.

    Returns:
      The number of arrays checked.
    Raises:
      CheckpointError naming every array that differs from its digest (or the first
      problem found with the config, the parameters or digests.json).
    """
    folder = resolve(folder)
    cfg, _ = read_config(folder)
    digests = read_digests(folder)
    if digests is None:
        raise CheckpointError(f"{folder} has no {DIGESTS_FILE} (written before digests were "
                              "recorded): there is nothing to check it against; convert it "
                              "again to get one")
    params_dir = folder / PARAMS_DIR
    stored, use_zarr3 = _stored_metadata(params_dir)
    _, abs_state = nnx.split(abstract_model(cfg))
    template = _str_keys(nnx.to_pure_dict(abs_state))
    _check_shapes(params_dir, _flat(_tree_dict_of_meta(stored)), _flat(template))
    _check_listing(params_dir, digests, stored)
    bad = _verify_arrays(params_dir, digests, use_zarr3=use_zarr3)
    if bad:
        raise CheckpointError(_corrupt_message(params_dir, bad))
    return len(digests)


def _tree_dict_of_meta(flat: Mapping[str, Any]) -> dict:
    """{"a.b": meta} -> {"a": {"b": meta}} (for `_flat`'s key strings)."""
    tree: dict = {}
    for name, meta in flat.items():
        node = tree
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = meta
    return tree


def record_digests(folder: str | os.PathLike) -> int:
    """Writes digests.json for a folder that has none, from its arrays as they are now
    (for folders written before digests were recorded, e.g. the shipped models): the
    same `digest_entry` the converter records. Returns the number of arrays.
    """
    folder = resolve(folder)
    read_config(folder)
    params_dir = folder / PARAMS_DIR
    stored, use_zarr3 = _stored_metadata(params_dir)
    reader = _ArrayReader(params_dir, use_zarr3=use_zarr3)
    entries = {name: digest_entry(reader.read(name)) for name in sorted(stored)}
    write_digests(folder, entries)
    return len(entries)
