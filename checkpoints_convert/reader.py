"""Reading Hugging Face snapshots lazily: config, tensor listing, one tensor at a time.

Safetensors files are parsed by hand (8-byte little-endian header length, JSON header,
raw little-endian data) so that bfloat16 tensors, which are what real LLaDA / Dream
checkpoints hold, come out as numpy arrays (ml_dtypes.bfloat16) without torch, and so
that a truncated or corrupt shard is detected from its header before any work is done.
`.bin` shards are read with `torch.load(weights_only=True)`: never arbitrary unpickling.

Nothing here executes code from the snapshot; `auto_map` entries of config.json are
kept as data only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from asynclane_jax.models.config import is_int, show
from checkpoints_convert.names import ConvertError

# safetensors dtype tag -> numpy dtype.
_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_), "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64),
}
_FLOATS = ("float64", "float32", "float16", "bfloat16")
_MAX_HEADER = 100 * 2**20  # a header larger than this is corrupt, not big


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one source tensor lives and what it looks like (no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shard: pathlib.Path
    offset: int | None = None  # absolute byte offset of the data (safetensors only)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Snapshot:
    """A local Hugging Face model folder, listed but not loaded."""

    folder: pathlib.Path
    hf_config: dict
    kind: str  # "safetensors" or "bin"
    shards: list[pathlib.Path]
    tensors: dict[str, TensorInfo]
    duplicates: list[str]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def float_dtype(self) -> str | None:
        """The one floating dtype all weight tensors share, if any ("bfloat16", ...)."""
        kinds = {str(t.dtype) for t in self.tensors.values() if str(t.dtype) in _FLOATS}
        return kinds.pop() if len(kinds) == 1 else None

    def iter_tensors(self, names=None) -> Iterator[tuple[TensorInfo, np.ndarray]]:
        """Yields (info, array) shard by shard, one tensor in memory at a time."""
        for info, source in self.iter_sources(names):
            yield info, source.read()

    def iter_sources(self, names=None) -> Iterator[tuple[TensorInfo, TensorSource]]:
        """Yields (info, source) shard by shard: a source reads its tensor whole or a
        block of rows at a time, and is valid until the next one is yielded."""
        wanted = set(self.tensors if names is None else names)
        for shard in self.shards:
            infos = [t for t in self.tensors.values() if t.shard == shard and t.name in wanted]
            if not infos:
                continue
            if self.kind == "safetensors":
                with open(shard, "rb") as f:
                    for info in sorted(infos, key=lambda t: t.offset):
                        yield info, TensorSource(info, f)
            else:
                state = torch_load(shard)
                for info in infos:
                    yield info, TensorSource(info, array=torch_to_numpy(state.pop(info.name)))
                del state


class TensorSource:
    """One source tensor, read whole (`read`) or by blocks of rows (`rows`): from an
    open safetensors shard without reading the rest, or from an array in memory."""

    def __init__(self, info: TensorInfo, f=None, array: np.ndarray | None = None):
        self.info, self._f, self._array = info, f, array

    def read(self) -> np.ndarray:
        return self._array if self._array is not None else read_at(self._f, self.info)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of the tensor (its first axis), in the stored dtype."""
        if self._array is not None:
            return self._array[start:stop]
        return read_at(self._f, self.info, start, stop)


# --------------------------------------------------------------------------- locating

def user_path(path) -> pathlib.Path:
    """pathlib.Path(path) with a leading ~ expanded (left as is for an unknown user)."""
    try:
        return pathlib.Path(path).expanduser()
    except RuntimeError:  # "~nobody/x": no such user's home
        return pathlib.Path(path)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_source(src: str, *, cache_dir: str | None = None) -> pathlib.Path:
    """A local snapshot folder, or a hub id already present in the local HF cache.

    This never downloads: the machine may have no hub access.
    """
    try:
        return _resolve_source(src, cache_dir=cache_dir)
    except OSError as e:  # a name too long for the OS, a folder that cannot be listed
        raise ConvertError(f"source {show(src)}: {e.strerror or e}") from None


def _resolve_source(src: str, *, cache_dir: str | None) -> pathlib.Path:
    path = user_path(src)
    if path.exists():
        if not path.is_dir():
            raise ConvertError(f"source {src} is a file; expected a snapshot folder with "
                               "config.json and weights")
        return path
    if _HUB_ID.fullmatch(src):
        try:
            from huggingface_hub import snapshot_download

            return pathlib.Path(snapshot_download(src, local_files_only=True,
                                                  cache_dir=cache_dir))
        except ImportError:
            pass
        except Exception:  # LocalEntryNotFoundError and friends: not cached
            raise ConvertError(
                f"no folder {src}, and the hub repository {src!r} is not in the local "
                "Hugging Face cache; this converter never downloads: fetch it with "
                f"`huggingface-cli download {src}` where the hub is reachable, then pass "
                "the snapshot folder") from None
    raise ConvertError(f"source folder {src} does not exist")


def read_hf_config(folder: pathlib.Path) -> dict:
    """The snapshot's config.json as data (auto_map and all; nothing is executed)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"no config.json in {folder}; expected a Hugging Face snapshot "
                           "folder (config.json plus *.safetensors or pytorch_model*.bin)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors: ValueError
        raise ConvertError(f"{path} is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path} does not hold a JSON object")
    return data


def _json_file(path: pathlib.Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError, RecursionError) as e:
        raise ConvertError(f"{path} is not valid JSON: {str(e)[:120]}") from None


def added_tokens(folder: pathlib.Path) -> dict[str, int]:
    """The added (special) tokens the snapshot's tokenizer files declare: content -> id.

    Read from tokenizer.json ("added_tokens"), tokenizer_config.json
    ("added_tokens_decoder") and added_tokens.json; where they disagree, tokenizer.json
    wins, as it is what a converted folder's tokenizer is built from.
    """
    out: dict[str, int] = {}
    listing = _json_file(folder / "added_tokens.json")
    if isinstance(listing, dict):
        out.update({str(c): int(i) for c, i in listing.items() if isinstance(i, int)})
    tok_cfg = _json_file(folder / "tokenizer_config.json")
    decoder = tok_cfg.get("added_tokens_decoder") if isinstance(tok_cfg, dict) else None
    if isinstance(decoder, dict):
        out.update({t["content"]: int(i) for i, t in decoder.items()
                    if isinstance(t, dict) and isinstance(t.get("content"), str)
                    and re.fullmatch(r"[0-9]+", str(i))})
    tok = _json_file(folder / "tokenizer.json")
    for t in (tok.get("added_tokens") or []) if isinstance(tok, dict) else []:
        if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(
                t.get("id"), int):
            out[t["content"]] = t["id"]
    return out


def chat_templates(folder: pathlib.Path) -> list[str]:
    """The snapshot's chat templates (tokenizer_config.json's, named ones, and
    chat_template.jinja), as text; empty for a model without any."""
    out = []
    tok_cfg = _json_file(folder / "tokenizer_config.json")
    template = tok_cfg.get("chat_template") if isinstance(tok_cfg, dict) else None
    if isinstance(template, str):
        out.append(template)
    elif isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        out += [t["template"] for t in template
                if isinstance(t, dict) and isinstance(t.get("template"), str)]
    if (folder / "chat_template.jinja").is_file():
        try:
            out.append((folder / "chat_template.jinja").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConvertError(f"{folder / 'chat_template.jinja'} is not UTF-8 text: "
                               f"{str(e)[:120]}") from None
    return out


def open_snapshot(folder: pathlib.Path) -> Snapshot:
    """Lists the snapshot's tensors from shard headers (no tensor data is read).

    Raises:
      ConvertError for missing weights, an index naming a missing shard, tensors the
      index and the shards disagree about, and truncated or corrupt shards.
    """
    hf_config = read_hf_config(folder)
    kind, shards, index = _find_weights(folder)
    tensors: dict[str, TensorInfo] = {}
    duplicates: list[str] = []
    for shard in shards:
        infos = (read_safetensors_header(shard) if kind == "safetensors"
                 else bin_listing(shard))
        for info in infos:
            if info.name in tensors:
                duplicates.append(f"{info.name} (in {tensors[info.name].shard.name} and "
                                  f"{shard.name})")
            else:
                tensors[info.name] = info
    if index is not None:
        problems = []
        for name, shard_name in index.items():
            info = tensors.get(name)
            if info is None:
                problems.append(f"{name} (index says {shard_name})")
            elif info.shard.name != shard_name:
                problems.append(f"{name} (index says {shard_name}, found in {info.shard.name})")
        extra = sorted(set(tensors) - set(index))
        if problems:
            raise ConvertError(f"the weight index and the shards disagree: {len(problems)} "
                               f"tensors not where the index says: {', '.join(problems[:8])}")
        if extra:
            raise ConvertError(f"the shards hold {len(extra)} tensors the weight index does "
                               f"not list: {', '.join(extra[:8])}")
    return Snapshot(folder, hf_config, kind, shards, tensors, duplicates)


def _find_weights(folder: pathlib.Path):
    for kind, index_name, single, glob in (
            ("safetensors", "model.safetensors.index.json", "model.safetensors", "*.safetensors"),
            ("bin", "pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")):
        index_path = folder / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except Exception:
                raise ConvertError(f"{index_path} is not a valid weight index (expected JSON "
                                   "with a 'weight_map' object)") from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise ConvertError(f"{index_name} names shard(s) missing from {folder}: "
                                   f"{', '.join(missing)}")
            return kind, [folder / n for n in names], weight_map
        if (folder / single).is_file():
            return kind, [folder / single], None
        found = sorted(p for p in folder.glob(glob)
                       if p.is_file() and not p.name.startswith("adapter_model"))
        if found:
            return kind, found, None
    raise ConvertError(f"no weights in {folder}: expected model.safetensors, sharded "
                       "*.safetensors with model.safetensors.index.json, or pytorch_model*.bin")


# --------------------------------------------------------------------------- safetensors

def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"names repeated in the header: {', '.join(map(show, dup[:4]))}")
    return dict(pairs)


def read_safetensors_header(path: pathlib.Path) -> list[TensorInfo]:
    """Parses and validates a safetensors header as the format specifies, against the
    file's size.

    The format: an 8-byte little-endian header length N (bounded here by the file and
    by _MAX_HEADER), then N bytes of UTF-8 JSON starting with "{" (space-padded at the
    end): an object whose entries are `"__metadata__": {str: str}` or
    `name: {"dtype": TAG, "shape": [int >= 0, ...], "data_offsets": [begin, end]}`, with
    offsets relative to the data that follows the header. Every tensor's bytes
    (end - begin) must be what its dtype and shape need, and the tensors must tile the
    data exactly: no overlaps, no holes, nothing after the last one.

    Raises:
      ConvertError naming the shard (and the tensor) for any violation.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConvertError(f"shard {path.name} is truncated or corrupt: {size} bytes, "
                               "too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ConvertError(f"shard {path.name} is truncated or corrupt: header length "
                               f"{n} does not fit in a {size}-byte file")
        raw = f.read(n)

    def corrupt(what: str) -> ConvertError:
        return ConvertError(f"shard {path.name} is corrupt: {what}")

    if not raw.startswith(b"{"):
        raise corrupt("its header does not start with '{' (not a safetensors file)")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise corrupt(f"its header is not a valid JSON object ({str(e)[:80]})") from None
    data_start = 8 + n
    infos, spans = [], []
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise corrupt("__metadata__ must map strings to strings")
            continue
        where = f"tensor {show(name)}"
        if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
            raise corrupt(f"{where}: its header entry is not an object with dtype, shape and "
                          "data_offsets")
        dtype_tag, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not isinstance(dtype_tag, str) or dtype_tag not in _ST_DTYPES:
            raise ConvertError(f"shard {path.name}: {where} has dtype {show(dtype_tag)}, which "
                               f"this converter does not read (supported: {sorted(_ST_DTYPES)})")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise corrupt(f"{where}: shape {show(shape)} is not a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(is_int(o) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            raise corrupt(f"{where}: data_offsets {show(offsets)} are not two integers "
                          "0 <= begin <= end")
        begin, end = offsets
        info = TensorInfo(name, tuple(shape), _ST_DTYPES[dtype_tag], path, data_start + begin)
        if end - begin != info.nbytes:
            raise corrupt(f"{where} spans {end - begin} bytes, its shape needs {info.nbytes}")
        infos.append(info)
        spans.append((begin, end, name))
    end_max = max((e for _, e, _ in spans), default=0)
    if data_start + end_max > size:
        raise ConvertError(f"shard {path.name} is truncated: its header describes "
                           f"{data_start + end_max} bytes, the file has {size}")
    covered = 0
    previous = None
    for begin, end, name in sorted(spans):
        if begin < covered:
            raise corrupt(f"tensors {show(previous)} and {show(name)} overlap (bytes "
                          f"{begin}..{covered} of the data)")
        if begin > covered:
            raise corrupt(f"bytes {covered}..{begin} of the data belong to no tensor")
        covered, previous = end, name
    if data_start + covered != size:
        raise corrupt(f"{size - data_start - covered} bytes after the last tensor belong to "
                      "no tensor")
    return infos


def read_at(f, info: TensorInfo, start: int | None = None,
            stop: int | None = None) -> np.ndarray:
    """Reads one safetensors tensor, or rows start:stop of it, into a new array.

    Args:
      f: the shard `info.shard`, opened "rb".
      info: the tensor's listing (from `read_safetensors_header`).
      start, stop: a range of the first axis (rows are contiguous in the file); None:
        the whole tensor.
    Returns:
      The array, in the stored dtype and shape (rows start:stop only, if given).
    Raises:
      ConvertError if the file ends before the tensor does.
    """
    shape = info.shape
    offset = info.offset
    if start is not None:
        row = math.prod(shape[1:]) * info.dtype.itemsize
        shape = (stop - start, *shape[1:])
        offset += start * row
    out = np.empty(shape, info.dtype)
    f.seek(offset)
    got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != out.nbytes:
        raise ConvertError(f"shard {info.shard.name} is truncated: {info.name} is short by "
                           f"{out.nbytes - got} bytes")
    return out


# --------------------------------------------------------------------------- torch .bin

def torch_load(path: pathlib.Path) -> dict:
    """A PyTorch `.bin` state dict, read with weights_only=True (memory-mapped if possible).

    Returns:
      name -> torch.Tensor.
    Raises:
      ConvertError without torch, for an unreadable file, or for anything but a flat
      dict of named tensors.
    """
    try:
        import torch
    except ImportError:
        raise ConvertError(f"{path.name} is a PyTorch pickle; reading it needs torch "
                           "(pip install torch), or convert a safetensors snapshot") from None
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be memory-mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(f"cannot read shard {path.name} (truncated, corrupt, or holding "
                           f"objects other than tensors): {first[:200]}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ConvertError(f"shard {path.name} is not a flat dict of named tensors")
    return state


def bin_listing(path: pathlib.Path) -> list[TensorInfo]:
    """The tensors of a `.bin` shard (the file is loaded, then dropped)."""
    return bin_infos(path, torch_load(path))


def bin_infos(path: pathlib.Path, state: dict) -> list[TensorInfo]:
    """TensorInfo for each tensor of a state dict loaded from `path` by `torch_load`."""
    return [TensorInfo(name, tuple(t.shape), torch_dtype_to_numpy(t.dtype), path)
            for name, t in state.items()]


def torch_dtype_to_numpy(dtype) -> np.dtype:
    import torch

    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(torch.empty((), dtype=dtype).numpy().dtype)


def torch_to_numpy(t) -> np.ndarray:
    """A CPU tensor as a numpy array (bfloat16 becomes ml_dtypes.bfloat16), copied."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()
