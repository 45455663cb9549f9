"""Checking a converted folder on demand (`asynclane-jax verify DIR`), and recording
the digests of a folder written before they were."""

from __future__ import annotations

import os

from asynclane_jax.checkpoint.format import DIGESTS_FILE, PARAMS_DIR, CheckpointError
from asynclane_jax.checkpoint.integrity import (
    check_listing,
    corrupt_message,
    digest_entry,
    read_digests,
    write_digests,
)
from asynclane_jax.checkpoint.registry import read_config, resolve
from asynclane_jax.checkpoint.restore import (
    check_shapes,
    mismatched_arrays,
    model_shapes,
    read_stored,
    stored_arrays,
)
from asynclane_jax.models.model import abstract_model


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
    stored = stored_arrays(params_dir)
    check_shapes(params_dir, stored, model_shapes(abstract_model(cfg)))
    check_listing(params_dir, digests, stored)
    bad = mismatched_arrays(params_dir, digests)
    if bad:
        raise CheckpointError(corrupt_message(params_dir, bad))
    return len(digests)


def record_digests(folder: str | os.PathLike) -> int:
    """Writes digests.json for a folder that has none, from its arrays as they are now
    (for folders written before digests were recorded, e.g. the shipped models): the
    same `digest_entry` the converter records. Returns the number of arrays.
    """
    folder = resolve(folder)
    read_config(folder)
    params_dir = folder / PARAMS_DIR
    entries = {}
    for name, array in read_stored(params_dir, sorted(stored_arrays(params_dir))):
        if isinstance(array, CheckpointError):
            raise array
        entries[name] = digest_entry(array)
    write_digests(folder, entries)
    return len(entries)
