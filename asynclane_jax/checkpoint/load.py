"""Loading a converted folder: `load` (model, tokenizer, config) and `load_model`.

A load is a restore followed by one transform step: `restore.restore_stored` reads the
arrays as the folder stores them (its dtype, layer layout and quantization) straight
into the sharding plan of that layout, handing each to `transform.cast` (the model's
dtype) and `transform.quantize_kernel` (quantize-on-read) as it goes; the layer layout
and the final placement follow (`transform.relayout_params`, `transform.place`).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Mapping

import jax
from flax import nnx

from asynclane_jax.checkpoint import transform as transform_lib
from asynclane_jax.checkpoint.format import (
    INT8_OUT_IN_KEY,
    PARAMS_DIR,
    CheckpointError,
    flat_arrays,
    nest,
    restore_keys,
    stored_quantization,
    str_keys,
)
from asynclane_jax.checkpoint.integrity import read_digests, verify_by_default
from asynclane_jax.checkpoint.registry import read_config, resolve
from asynclane_jax.checkpoint.restore import restore_stored
from asynclane_jax.checkpoint.tokenizer import load_tokenizer
from asynclane_jax.models import quantize as quantize_lib
from asynclane_jax.models.config import ModelConfig, show
from asynclane_jax.models.model import DiffusionLM, abstract_model


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
      quantize: "int8": int8 weights with per-channel scales in the linear layers (and
        a mixture-of-experts model's stacked experts), quantized as they are read (see
        `load_model`); None or "none": as stored.
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
        tensor is cast as soon as it is read (on one device, on the host before it is
        placed; on a mesh, on its devices).
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
        and, in a mixture-of-experts model, the stacked routed experts (one scale per
        expert and output channel; the router stays in its dtype)
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
    verify = verify_by_default() if verify is None else verify
    digests = read_digests(folder) if verify else None
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    model_cfg = cfg if scan_layers is None else cfg.replace(scan_layers=bool(scan_layers))
    # The model: its layout, and int8 if stored so or asked for; the float targets too.
    graphdef, abs_state, target, float_target = _abstract(model_cfg, mesh, stored_mode or mode)
    out_in = (quantize_lib.out_in_layers(nnx.merge(graphdef, abs_state))
              if stored_mode or mode else ())
    if stored_mode is not None:
        _check_int8_layout(folder, data, out_in)
    # What the folder stores (its layout and quantization), in the model's dtype.
    if cfg.scan_layers == model_cfg.scan_layers:
        as_stored = target if stored_mode else float_target
    else:
        as_stored = _abstract(cfg, mesh, stored_mode)[2]
    quantize = (functools.partial(transform_lib.quantize_kernel, out_in=frozenset(out_in),
                                  quantized=quantize_lib.quantized_names(abs_state))
                if stored_mode is None and mode is not None else None)
    params = restore_params(folder / PARAMS_DIR, as_stored, digests=digests, on_read=quantize)
    params = transform_lib.relayout_params(params, model_cfg.n_layers, target,
                                            model_cfg.layer_stacks())
    params = transform_lib.place(params, target)
    nnx.replace_by_pure_dict(abs_state, restore_keys(params, nnx.to_pure_dict(abs_state)))
    return nnx.merge(graphdef, abs_state)


def restore_params(params_dir: pathlib.Path, target: dict, *,
                   digests: Mapping[str, dict] | None = None, on_read=None) -> dict:
    """Restores an orbax checkpoint of arrays into `target`'s shapes, dtypes, shardings:
    each array is restored as stored (`restore.restore_stored`) and cast to its target's
    dtype (`transform.cast`: on one device on the host before it is placed, on a mesh
    on its devices).

    Args:
      params_dir: the checkpoint (a converted folder's params/).
      target: nested dict of jax.ShapeDtypeStruct with a sharding each (string keys).
      digests: the folder's digests.json entries: each array is checked against its
        entry as stored (before any dtype cast); None: no check.
      on_read: called as on_read(name, array) with each array once cast and placed
        (name as in digests.json); what it returns takes the array's place, and a dict it returns
        is put beside it (`transform.merge_read`). None: the arrays as cast.
    Returns:
      The nested dict of jax.Arrays (string keys).
    """
    flat = flat_arrays(target)
    cast = functools.partial(transform_lib.cast, dtypes={k: t.dtype for k, t in flat.items()})
    arrays = restore_stored(params_dir, {k: t.sharding for k, t in flat.items()},
                            shapes={k: t.shape for k, t in flat.items()}, digests=digests,
                            cast=cast, transform=on_read)
    return transform_lib.merge_read(nest(arrays))


def _abstract(cfg: ModelConfig, mesh, quantization: str | None):
    """(graphdef, abstract state, target, float target) of the model `cfg` describes,
    int8 with `quantization`; a target holds a ShapeDtypeStruct with its sharding for
    every parameter (string keys), the float target those of the float model."""
    graphdef, abs_state = nnx.split(abstract_model(cfg))
    float_target = target = _target(cfg, abs_state, mesh)
    if quantization is not None:
        graphdef, abs_state = nnx.split(quantize_lib.abstract_quantized(
            nnx.merge(graphdef, abs_state), quantization))
        target = _target(cfg, abs_state, mesh)
    return graphdef, abs_state, target, float_target


def _target(cfg: ModelConfig, abs_state: nnx.State, mesh) -> dict:
    """ShapeDtypeStructs with their shardings for every parameter (string keys)."""
    shardings = str_keys(nnx.to_pure_dict(_param_shardings(cfg, abs_state, mesh)))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        str_keys(nnx.to_pure_dict(abs_state)), shardings)


def _param_shardings(cfg: ModelConfig, abs_state: nnx.State, mesh) -> nnx.State:
    """The sharding of every parameter: the plan's on a mesh, else the default device."""
    from asynclane_jax import sharding

    try:
        return sharding.param_shardings(cfg, abs_state, mesh)
    except ValueError as e:  # ShardingError and friends: name the model and the mesh
        shown = mesh if isinstance(mesh, str) or not hasattr(mesh, "shape") else dict(mesh.shape)
        raise CheckpointError(f"cannot load {cfg.family} ({cfg.n_heads} heads, vocabulary "
                              f"{cfg.vocab_size}) on mesh {shown!r}: {e}") from e


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
