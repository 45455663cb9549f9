"""A converted folder stays whole and checkable: writes that signals cannot cut in half,
a digest of every stored array (digests.json), and the checks against it.

`load` checks each array against its digest as it is read (`verify=False` or
ASYNCLANE_VERIFY=0 to skip); `verify.verify_folder` (`asynclane-jax verify DIR`) checks
a folder on demand.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import signal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from asynclane_jax.checkpoint.format import DIGESTS_FILE, CheckpointError

DIGESTS_FORMAT = "asynclane-jax-digests"
# sha256 over the concatenated sha256 digests of the array's bytes in chunks of this size
# (one chunk for a smaller array): the chunks of a large array hash in parallel.
DIGEST_ALGORITHM = "sha256-chunks-64MiB"
DIGEST_CHUNK = 64 * 2**20
# Set to 0 to load without checking the digests (as `load(..., verify=False)`).
VERIFY_ENV = "ASYNCLANE_VERIFY"


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


def verify_by_default() -> bool:
    """Whether `load` checks digests when not told (ASYNCLANE_VERIFY, default yes)."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def check_listing(params_dir: pathlib.Path, digests: Mapping[str, dict],
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


def corrupt_message(params_dir: pathlib.Path, names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"{params_dir.parent} is corrupt: parameter{'s' if len(names) > 1 else ''} "
            f"{shown} differ{'' if len(names) > 1 else 's'} from the digest recorded when the "
            f"folder was written ({DIGESTS_FILE}); convert or copy the model again")
