"""Weight-only int8 quantization of the model's linear layers, through Qwix.

`quantize_model(model)` turns every `Linear` of a DiffusionLM (attention q/k/v/o, the
MLP's gate/up/down, an untied output head) into int8 weights with one scale per output
channel: kernel [.., in, out] becomes an int8 array of the same shape and `scale`
[.., 1, out] (float32), or both transposed for q / k / v ([.., out, in] and
[.., out, 1]: `int8_matmul` says why), kernel ~ int8 * scale, symmetric, absmax-calibrated
(`qwix.quantize` with every axis but the contracted one channelwise). The layer then
multiplies through `qwix.einsum` with a `qwix.QArray` (int8 values, the scale in the
compute dtype), which dequantizes into the matmul. Activations, the embedding table,
the norms, the biases and the K/V cache stay in the compute dtype.

The int8 arrays are ordinary `nnx.Param`s, so the quantized model splits, merges,
jits, shards by logical axis names (a scale has its kernel's names, the contracted
dimension unnamed) and exists abstractly (`abstract_quantized(abstract_model(cfg))`)
like the float one; they are the compiled decode's arguments, which is what halves
their bytes. The qwix int8 grid is [-128, 127] with scale = absmax / 127.5.
`asynclane_jax.checkpoint.load(..., quantize="int8")` quantizes each kernel as it is
read, so a whole float copy of the weights never sits on a device.

A mixture-of-experts model (LLaDA2): the stacked routed-expert kernels (`Experts`:
gate_proj / up_proj [E, d, m], down_proj [E, m, d]) are quantized on the same grid by
the same function (`int8_weights`), one scale per (expert, output channel): values
[E, in, out] int8 beside `<name>_scale` [E, 1, out] float32 (`scale_name`). The routed
experts' grouped matmuls (`moe.grouped_matmul`) take the int8 values converted to the
compute dtype as the `ragged_dot` operand and multiply each output row by its expert's
scale row: (x @ Wq_e) * s_e, exact since the scale is per output column. The router
(its kernel and `expert_bias`) stays in float32: the routing is computed from the same
numbers as in the float model, so a given input picks the same experts. The shared
expert is an `MLP` of `Linear`s and is quantized as any other.

Why not Qwix's own NNX entry point (`qwix.quantize_model` with a `PtqProvider`): it
quantizes by running one method of the model once while patching `jnp.einsum` and
friends in place, and keeps the result as `WithAux` nodes that only that one
intercepted method understands. Here the model is driven through `forward`,
`__call__` and `forward_cached`, always after `nnx.split`/`nnx.merge` inside `jax.jit`,
and a merged PTQ model fails in `Linear` (`WithAux.astype` on a merged QArray raises
"Unsupported type QArray", tried with qwix 0.1.8); it also cannot quantize one array at
a time while a checkpoint is read. Qwix's array-level pieces (`quantize`, `QArray`,
`einsum`) do exactly the numerics and are used as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from asynclane_jax.models.config import STACK_NAMES, ConfigError, show

# What `quantize=` accepts: None (or "none") for full precision, or one of these.
MODES = ("int8",)
CHOICES = ("none", *MODES)  # the command lines' --quantize values


class QuantizeError(ConfigError):
    """A quantization mode that does not exist."""


def check_mode(mode) -> str | None:
    """The mode a `quantize=` argument names: None for full precision ("none" or
    None), else one of MODES.

    Raises:
      QuantizeError naming the accepted values.
    """
    if mode is None or (isinstance(mode, str) and mode.strip().lower() == "none"):
        return None
    if isinstance(mode, str) and mode.strip().lower() in MODES:
        return mode.strip().lower()
    raise QuantizeError(f"quantize={show(mode)}: expected one of {', '.join(CHOICES)}")


def int8_weights(kernel, out_in: bool = False):
    """(int8 values, float32 scales) of a kernel [..., in, out]: one scale per output
    channel (and per leading index of a stacked kernel), the contracted axis -2 reduced
    (scale shape [..., 1, out]); symmetric absmax, as `qwix.quantize` computes it.
    out_in: both returned with their last two axes swapped (values [..., out, in],
    scale [..., out, 1]), the layout of an `out_in` layer (see `int8_matmul`)."""
    import qwix

    k = jnp.asarray(kernel)
    axes = tuple(a for a in range(k.ndim) if a != k.ndim - 2)
    q = qwix.quantize(k.astype(jnp.float32), jnp.int8, channelwise_axes=axes)
    values, scale = q.qvalue, q.scale.astype(jnp.float32)
    if out_in:
        values, scale = jnp.swapaxes(values, -1, -2), jnp.swapaxes(scale, -1, -2)
    return values, scale


_int8_weights_jit = jax.jit(int8_weights, static_argnames="out_in")


def int8_matmul(x, values, scale, dtype, out_in: bool = False):
    """x [..., in] @ (values [in, out] int8 * scale [1, out]) in the compute dtype,
    through qwix's einsum (dequantized into the matmul).

    out_in: values [out, in] and scale [out, 1] (the contracted axis minor). The layers
    that feed attention (q / k / v) keep their int8 values so: in [in, out] the TPU
    compiler copies each of their stacked kernels into that layout when a decode starts
    (experiments/results/compile/memory-8b.md)."""
    import qwix

    w = qwix.QArray(values, scale.astype(dtype))
    return qwix.einsum("...i,oi->...o" if out_in else "...i,io->...o", x.astype(dtype), w)


def scale_name(key: str) -> str:
    """The key of a quantized array's scale beside it: "scale" for a Linear's "kernel",
    "<key>_scale" for a stacked expert kernel ("gate_proj" -> "gate_proj_scale")."""
    return "scale" if key == "kernel" else f"{key}_scale"


def quantize_model(model, mode: str | None = "int8"):
    """Quantizes every Linear and every stacked experts module of a model in place
    (works on an abstract model inside `nnx.eval_shape` too) and returns it; mode None
    leaves it as it is. A mixture-of-experts router is left as it is."""
    mode = check_mode(mode)
    if mode is None:
        return model
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "quantize_int8") and isinstance(node, nnx.Module):
            node.quantize_int8()
    return model


def quantization_of(model) -> str | None:
    """"int8" when the model's linear layers (or stacked experts) hold int8 weights, else
    None."""
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "quantize_int8") and (
                getattr(node, "scale", None) is not None or
                getattr(node, scale_name("gate_proj"), None) is not None):
            return "int8"
    return None


def abstract_quantized(model, mode: str | None = "int8"):
    """A model (abstract, e.g. `models.abstract_model(cfg)`, or concrete) with
    jax.ShapeDtypeStruct leaves, quantized as mode says (int8 kernels and their scales):
    what `aot` compiles against and what `load` fills. Nothing is allocated."""
    mode = check_mode(mode)
    return nnx.eval_shape(lambda m: quantize_model(m, mode), model)


def quantized_paths(abs_state) -> set[tuple]:
    """Paths (tuples of keys, as in `nnx.to_pure_dict`) of the int8 arrays of a
    quantized model's state: the linear layers' kernels and the stacked expert kernels
    (each an int8 array with its scale beside it, `scale_name`)."""
    pure = nnx.to_pure_dict(abs_state)
    out = set()

    def walk(tree, path):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, path + (k,))
            elif scale_name(str(k)) in tree and jnp.dtype(v.dtype) == jnp.int8:
                out.add(path + (k,))

    walk(pure, ())
    return out


def name_pattern(name: str) -> str:
    """A dotted parameter name without its layer (and any other integer) components
    and without a scanned layout's stack name, the same in both layer layouts:
    "layers.3.mlp.experts.gate_proj" and "layers.moe.mlp.experts.gate_proj" ->
    "layers.mlp.experts.gate_proj"."""
    parts = str(name).split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1] in STACK_NAMES:
        parts = parts[:1] + parts[2:]
    return ".".join(p for p in parts if not p.isdigit())


def quantized_names(abs_state) -> frozenset[str]:
    """The `name_pattern`s of the int8 arrays of a quantized model's state
    (`quantized_paths`): which float arrays of a checkpoint a quantize-on-read turns
    into int8 (the router's float32 kernel is not among them)."""
    return frozenset(name_pattern(".".join(map(str, p))) for p in quantized_paths(abs_state))


def quantize_array(array, value_sharding=None, scale_sharding=None, out_in: bool = False):
    """(int8 values, scales) of one float kernel array [..., in, out] (a stacked expert
    kernel [E, in, out] too: scales [E, 1, out]) already on its
    device(s), quantized there and placed on the given shardings (None: where jit puts
    them); out_in as in `int8_weights`."""
    if value_sharding is None:
        return _int8_weights_jit(array, out_in=out_in)
    return _int8_weights_placed(value_sharding, scale_sharding, out_in)(array)


@functools.lru_cache(maxsize=64)
def _int8_weights_placed(value_sharding, scale_sharding, out_in: bool = False):
    return jax.jit(functools.partial(int8_weights, out_in=out_in),
                   out_shardings=(value_sharding, scale_sharding))


def out_in_layers(model) -> tuple[str, ...]:
    """The names (the last path component, e.g. "q_proj") of a model's linear layers
    whose int8 values are kept [..., out, in] (`Linear.int8_out_in`), sorted."""
    return tuple(sorted({str(path[-1]) for path, node in nnx.iter_graph(model)
                         if path and getattr(node, "int8_out_in", False)
                         and isinstance(node, nnx.Module)}))


def layer_of(name: str) -> str:
    """The layer a dotted parameter name belongs to: "q_proj" for
    "layers.0.attn.q_proj.kernel"."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else ""


def add_flag(parser) -> None:
    """Adds `--quantize {none,int8}` to a command's argument parser (argparse refuses
    any other value with a one-line error naming the choices)."""
    parser.add_argument("--quantize", choices=CHOICES, default="none",
                        help="int8: load the linear layers' weights as int8 with one scale "
                             "per output channel, quantized as they are read (about half "
                             "the bytes of bfloat16); default none")


def weight_bytes(state) -> int:
    """Bytes of every parameter of a (possibly abstract) state, as stored."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(nnx.to_pure_dict(state))))


__all__ = ["CHOICES", "MODES", "QuantizeError", "abstract_quantized", "add_flag", "check_mode",
           "int8_matmul", "int8_weights", "layer_of", "name_pattern", "out_in_layers",
           "quantization_of", "quantize_array", "quantize_model", "quantized_names",
           "quantized_paths", "scale_name", "weight_bytes"]
