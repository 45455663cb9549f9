"""Writing a converted folder: `save` (a whole model) and `save_params` (its arrays)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import jax
import numpy as np
from flax import nnx

from asynclane_jax.checkpoint.format import (
    COMMIT_MARKER,
    COMMIT_MARKER_TEXT,
    INT8_OUT_IN_KEY,
    PARAMS_DIR,
    QUANTIZATION_KEY,
    CheckpointError,
    flat_arrays,
    str_keys,
    write_config,
)
from asynclane_jax.checkpoint.integrity import (
    digest_entry,
    remove_tree,
    signals_held,
    write_digests,
)
from asynclane_jax.checkpoint.tokenizer import copy_tokenizer_files
from asynclane_jax.models import quantize as quantize_lib
from asynclane_jax.models.model import DiffusionLM


def params_to_numpy(model: DiffusionLM) -> dict:
    """The parameters as a nested dict of numpy arrays (string keys)."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree.map(np.asarray, str_keys(pure))


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
            str_keys(params), ocdbt_target_data_file_size=0))
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
