"""From the arrays as stored to the model's: the one step after `restore` that casts
dtypes, quantizes float kernels to int8, changes the layer layout and places each
parameter where the model's sharding plan puts it.

Per array: `cast` to the model's dtype (the restore applies it on the host before an
array is placed on one device, on its devices on a mesh), then `quantize_kernel` for
`quantize="int8"` on float weights, on the array's device. Per tree, after the restore:
the layer layout (`relayout_params`: stacked <-> per-layer, exact) and the final
placement (`place`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from asynclane_jax.models import quantize as quantize_lib

# The alignment of a host buffer that the CPU backend adopts without copying it.
HOST_ALIGN = 64


def aligned_empty(shape: tuple, dtype, align: int = HOST_ALIGN) -> np.ndarray:
    """An uninitialised host array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def cast(name: str, array, *, dtypes: Mapping[str, np.dtype]):
    """`array` in `dtypes[name]` (round to nearest even). A host numpy array is cast on
    the host into an aligned buffer (so that placing it on the CPU backend does not copy
    it again); a jax.Array on its device(s)."""
    want = np.dtype(dtypes[name])
    if array.dtype == want:
        return array
    if isinstance(array, np.ndarray):
        out = aligned_empty(array.shape, want)
        np.copyto(out, array, casting="unsafe")
        return out
    return array.astype(want)


def quantize_kernel(name: str, array: jax.Array, *, out_in: frozenset,
                    quantized: frozenset | None = None):
    """An array the int8 model holds as int8 (its `quantize.name_pattern` in `quantized`,
    `quantize.quantized_names` of the quantized abstract state: the linear layers'
    kernels and the stacked expert kernels, not a router's kernel; None: every
    `...kernel`) as {key: int8 values, scale key: scales} (`quantize.scale_name`),
    transposed for the layers named in `out_in`; any other array as it is."""
    if not (name.endswith("kernel") if quantized is None
            else quantize_lib.name_pattern(name) in quantized):
        return array
    values, scale = quantize_lib.quantize_array(
        array, out_in=quantize_lib.layer_of(name) in out_in)
    key = name.rsplit(".", 1)[-1]
    return {key: values, quantize_lib.scale_name(key): scale}


def merge_read(tree):
    """Puts what a transform returned as a dict in a leaf's place beside it: {"kernel":
    {"kernel": v, "scale": s}} -> {"kernel": v, "scale": s}, and {"gate_proj":
    {"gate_proj": v, "gate_proj_scale": s}} -> {"gate_proj": v, "gate_proj_scale": s}."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and set(v) == {k, quantize_lib.scale_name(str(k))}:
            out.update(v)
        else:
            out[k] = merge_read(v)
    return out


def relayout_params(params: dict, n_layers: int, target: dict, stacks=None) -> dict:
    """Parameters (string keys, arrays on their devices) in the layer layout of
    `target` (ShapeDtypeStructs with shardings, as `load_model` builds; its stacks
    `stacks`, `ModelConfig.layer_stacks()`), each result placed by its target's
    sharding. Exact; consumes `params`' layers (one layer tensor in both layouts at a
    time)."""
    from asynclane_jax.models.model import layer_layout, stack_layer_params, unstack_layer_params

    want = layer_layout(target)
    if layer_layout(params) == want:
        return params
    layers = params.pop("layers")
    params = {k: v for k, v in params.items()}
    if want == "stacked":
        out = stack_layer_params({"layers": layers}, n_layers, stacks)["layers"]
    else:
        out = unstack_layer_params({"layers": layers}, n_layers, stacks,
                                   str_keys=True)["layers"]
    del layers
    params["layers"] = jax.tree.map(lambda a, t: jax.device_put(a, t.sharding),
                                    out, target["layers"])
    return params


def place(params: dict, target: dict) -> dict:
    """Each array on its target's sharding (a copy only where it is elsewhere, e.g. an
    int8 scale computed beside its kernel)."""
    return jax.tree.map(
        lambda a, t: a if a.sharding == t.sharding else jax.device_put(a, t.sharding),
        params, target)
