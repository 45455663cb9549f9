"""Ahead-of-time compilation of the whole decode for a TPU slice, without weights and
without a TPU: what a slice must hold per chip, before paying for one.

    asynclane-jax aot --preset llada-8b-instruct --sampler asynclane --gen-length 512 \\
        --batch 8 --topology v5e:2x4 --mesh data=1,tensor=8 [--quantize int8] [--json]

The model is abstract (ShapeDtypeStructs: nothing is allocated), the parameters, canvas
and per-row arrays carry the shardings of `sharding.plan_for` on a mesh laid over the
devices of a TPU topology description, and the TPU compiler (libtpu, installed by the
`tpu` extra: pip install 'asynclane-jax[tpu]') builds the same program `generate` would
run there. The compiled program's own memory analysis gives the per-device sizes.

Topologies are GENERATION:SHAPE: "v5e:2x4", "v6e:1x1" (2-D for v5e and v6e),
"v5p:2x2x1", "v4:2x2x1" (3-D; one JAX device per chip, both TensorCores of a chip
together, as JAX runs v4 and v5p). Slices that fit on one host (v5e/v6e up to 2x4,
v4/v5p up to 2x2x1) are described as one host; larger ones as hosts of 2x2 chips.

A mixture-of-experts model (LLaDA2, `--preset llada2-mini`) compiles the same way: its
stacked expert kernels are split along the expert axis on the mesh's tensor axis
(asynclane_jax.sharding, "Mixture of experts"), the routed experts are grouped matmuls
(`jax.lax.ragged_dot`) in the compiled program, and the report says how many experts
each chip holds. `--quantize int8` quantizes its stacked experts too (one scale per
expert and output channel, split with them; the router stays float:
asynclane_jax.models.quantize). Use a sampler
that follows its block-causal attention (`--sampler d2f`).

The API is `compile_for_topology(...) -> AotReport`; `register` adds the `aot`
subcommand to the asynclane-jax command line (through the `asynclane_jax.commands`
entry points in pyproject.toml).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from typing import Any

from asynclane_jax import compile_cache
from asynclane_jax.decoding.registry import DEFAULT_SAMPLER
from asynclane_jax.errors import UsageError
from asynclane_jax.serve.budget import size_text  # bytes for people (no JAX there)

GIB = 2 ** 30

# HBM per chip (GiB) and how each generation's topology is written.
GENERATIONS: dict[str, dict[str, Any]] = {
    "v4": {"hbm_gib": 32, "ndim": 3, "host": (2, 2, 1), "megacore": True},
    "v5e": {"hbm_gib": 16, "ndim": 2, "host": (2, 4, 1), "megacore": False},
    "v5p": {"hbm_gib": 95, "ndim": 3, "host": (2, 2, 1), "megacore": True},
    "v6e": {"hbm_gib": 32, "ndim": 2, "host": (2, 4, 1), "megacore": False},
}
# Device kinds the compiler's devices report -> generation.
DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
}
# Hosts of a slice larger than one host hold 2x2 chips.
MULTI_HOST_BOUNDS = (2, 2, 1)

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
               "collective-permute")
# An instruction's opcode follows its result shape: `%x = bf16[8,128]{1,0} all-gather(`;
# asynchronous collectives are counted once, at their -start.
_COLLECTIVE_RE = re.compile(r"[\s)}\]](" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_TOPOLOGY_RE = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)*)$")
_INSTALL = "install it with: pip install 'asynclane-jax[tpu]'"


class AotError(UsageError):
    """A topology, mesh or request the ahead-of-time compile cannot use, or a missing
    TPU compiler."""


def tpu_compiler_available() -> bool:
    """Whether libtpu (the TPU compiler) is installed."""
    spec = importlib.util.find_spec("libtpu")
    return spec is not None and spec.origin is not None


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU topology description: its devices (compile-only) and HBM per chip."""

    topology: str
    generation: str
    shape: tuple[int, ...]
    devices: tuple
    device_kind: str
    hbm_bytes: int


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """("v5e", (2, 4)) from "v5e:2x4"; AotError naming the problem otherwise."""
    text = topology.strip().lower()
    m = _TOPOLOGY_RE.match(text)
    if not m:
        raise AotError(f"topology {topology!r}: expected GENERATION:SHAPE such as v5e:2x4, "
                       "v6e:1x1, v5p:2x2x1 or v4:2x2x1")
    gen, shape = m.group(1), tuple(int(d) for d in m.group(2).split("x"))
    if gen not in GENERATIONS:
        raise AotError(f"topology {topology!r}: unknown TPU generation {gen!r}; known: "
                       f"{', '.join(GENERATIONS)}")
    ndim = GENERATIONS[gen]["ndim"]
    if len(shape) != ndim or min(shape) < 1:
        example = "2x4" if ndim == 2 else "2x2x1"
        raise AotError(f"topology {topology!r}: {gen} slices have {ndim} positive "
                       f"dimensions, e.g. {gen}:{example}")
    return gen, shape


def _host_bounds(gen: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    shape3 = (*shape, 1) if len(shape) == 2 else shape
    host = GENERATIONS[gen]["host"]
    if all(s <= h for s, h in zip(shape3, host)):
        return shape3  # one host holds the whole slice
    return MULTI_HOST_BOUNDS


def tpu_slice(topology: str, hbm_gib: float | None = None) -> Slice:
    """The compile-only devices of a TPU topology (needs libtpu, no TPU).

    Args:
      topology: "v5e:2x4", "v6e:1x1", "v5p:2x2x1", "v4:2x2x1", ...
      hbm_gib: HBM per chip to check against, instead of the generation's.
    Raises:
      AotError: unknown or malformed topology, or libtpu missing.
    """
    gen, shape = parse_topology(topology)
    if not tpu_compiler_available():
        raise AotError(f"the TPU compiler (libtpu) is not installed; {_INSTALL}")
    from jax.experimental import topologies

    # A compile-only topology uses no TPU, so there is nothing to guard with libtpu's
    # one-process lockfile (/tmp/libtpu_lockfile); without this a second process that
    # loads libtpu (another `aot`, a test run) fails. Set it to 0 to keep the lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs: dict[str, Any] = {"chips_per_host_bounds": _host_bounds(gen, shape)}
    if GENERATIONS[gen]["megacore"]:
        kwargs["chip_config_name"] = "megacore"
    name = f"{gen}:{'x'.join(map(str, shape))}"
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs)
    except RuntimeError as e:  # JaxRuntimeError is one
        if "not installed" in str(e):
            raise AotError(f"the TPU compiler (libtpu) is not usable: {e}; {_INSTALL}") \
                from None
        if "lockfile" in str(e):
            raise AotError(f"libtpu is in use by another process ({_first_line(e)}); "
                           "with no TPU attached, ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets "
                           "several processes compile") from None
        raise AotError(f"topology {topology!r}: {_first_line(e)}") from None
    devices = tuple(desc.devices)
    kind = devices[0].device_kind
    hbm = GENERATIONS[DEVICE_KINDS.get(kind, gen)]["hbm_gib"] if hbm_gib is None else hbm_gib
    if not hbm > 0:
        raise AotError(f"hbm_gib={hbm_gib!r}: must be positive")
    return Slice(topology=name, generation=gen, shape=shape, devices=devices,
                 device_kind=kind, hbm_bytes=int(hbm * GIB))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective instructions in a compiled HLO module's text, by kind (asynchronous
    ones once; a loop's body is counted once, not once per iteration)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for m in _COLLECTIVE_RE.finditer(hlo_text):
        counts[m.group(1)] += 1
    return counts


_SHORT = {"all-reduce": "AR", "all-gather": "AG", "all-to-all": "A2A",
          "reduce-scatter": "RS", "collective-permute": "CP"}


def collectives_brief(counts: dict[str, int]) -> str:
    """`count_collectives`' counts as a table cell: "AR 3 AG 1" (kinds with none left
    out), "none" when there are none."""
    return " ".join(f"{_SHORT.get(k, k)} {v}" for k, v in counts.items() if v) or "none"


@dataclasses.dataclass
class AotReport:
    """What the compiled decode needs per device of a TPU slice.

    Sizes are per device (per chip), from the compiled program's `memory_analysis()`:
      argument_bytes: the inputs, i.e. this device's shard of the weights (and canvas);
      output_bytes: the result (canvas and per-row statistics);
      alias_bytes: output bytes that share an input's buffer (counted once);
      temp_bytes: everything the program allocates while it runs (K/V cache, the loop's
        state, activations, logits);
      code_bytes: the program itself (TPU programs are loaded into HBM).
    param_bytes is every parameter's bytes as stored (with quantize "int8", the int8
    kernels and their scales: the program's arguments are those arrays themselves).
    peak_bytes = argument + output - alias + temp + code: all of it is live at once in the
    worst case (the weights and the program for the whole run, the temporaries at their
    high point), so it errs on the safe side. It does not include what the TPU runtime
    keeps for itself (the compiler offers a program 15.75 of a v5e chip's 16 GiB), one
    reason to ask for headroom rather than an exact fit.
    `compiler_peak_bytes` is the compiler's own peak figure
    (memory_analysis().peak_memory_in_bytes), for reference.

    When the TPU compiler itself refuses the program for lack of HBM, the sizes are None
    and `reason` carries the compiler's message.
    """

    model: str
    sampler: str
    options: dict
    gen_length: int
    prompt_len: int
    batch: int
    rows: int
    dtype: str
    quantize: str
    topology: str
    device_kind: str
    chips: int
    mesh: str
    heads: str
    scan_layers: bool
    hbm_bytes: int
    param_bytes: int
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    code_bytes: int | None
    peak_bytes: int | None
    compiler_peak_bytes: int | None
    headroom_bytes: int | None
    fits: bool
    reason: str
    collectives: dict[str, int]
    lower_s: float
    compile_s: float
    hlo_text: str | None = dataclasses.field(default=None, repr=False)
    # A mixture-of-experts model: its routed experts per layer, and how many of them
    # each chip holds (the plan's `expert` axis); None for a dense model.
    experts: int | None = None
    experts_per_chip: int | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("hlo_text")
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        """A few lines for people."""
        g = size_text
        opts = " ".join(f"{k}={v}" for k, v in self.options.items())
        lines = [f"{self.model} {self.sampler}{' ' + opts if opts else ''}: gen_length "
                 f"{self.gen_length}, prompt {self.prompt_len}, batch {self.batch}"
                 f"{f' (padded to {self.rows} rows)' if self.rows != self.batch else ''}, "
                 f"{self.dtype}"
                 f"{'' if self.quantize == 'none' else ', ' + self.quantize + ' weights'}",
                 f"on {self.topology}: {self.chips} x {self.device_kind}, "
                 f"{g(self.hbm_bytes)} HBM each; mesh {self.mesh}, heads {self.heads}, "
                 f"layers {'scanned' if self.scan_layers else 'unrolled'}"]
        if self.experts:
            lines.append(f"experts: {self.experts} routed per layer, "
                         f"{self.experts_per_chip} on each chip")
        if self.peak_bytes is not None:
            lines.append(f"per device: arguments {g(self.argument_bytes)}, output "
                         f"{g(self.output_bytes)}, temporaries {g(self.temp_bytes)}, code "
                         f"{g(self.code_bytes)}; peak {g(self.peak_bytes)} of "
                         f"{g(self.hbm_bytes)} (headroom {g(self.headroom_bytes)}, "
                         f"{100 * self.headroom_bytes / self.hbm_bytes:.0f}%)")
        lines.append("collectives in the program: " + ", ".join(
            f"{k} {v}" for k, v in self.collectives.items()))
        lines.append(f"lowered in {self.lower_s:.1f} s, compiled in {self.compile_s:.1f} s")
        lines.append("fits." if self.fits else f"does not fit: {self.reason}")
        return "\n".join(lines)


def _config(model, dtype):
    from asynclane_jax.models import ModelConfig, preset

    if isinstance(model, ModelConfig):
        cfg, name = model, f"{model.family} config"
    elif isinstance(model, str):
        cfg, name = preset(model), model
    else:
        raise AotError(f"model: expected a preset name or a ModelConfig, got "
                       f"{type(model).__name__}")
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    return cfg, name


def _mesh(spec, tpu: Slice):
    from asynclane_jax import sharding

    n = len(tpu.devices)
    try:
        sharding.parse_mesh_spec(spec, n)
    except sharding.ShardingError as e:
        text = sharding.MESH_PRESETS.get(spec.strip(), spec)
        sizes = [int(s) for s in re.findall(r"=\s*(-?\d+)", text)]
        if sizes and min(sizes) > 0 and math.prod(sizes) != n:
            raise AotError(f"mesh {spec!r} has {math.prod(sizes)} devices, but topology "
                           f"{tpu.topology} has {n} chip{'s' if n > 1 else ''}; make the "
                           f"axis sizes multiply to {n}, or use -1 for one axis") from None
        raise AotError(str(e)) from None
    return sharding.make_mesh(spec, devices=list(tpu.devices))


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


def compile_for_topology(model, *, sampler: str = DEFAULT_SAMPLER, gen_length: int = 128,
                         batch: int = 1, prompt_len: int = 128, topology: str,
                         mesh: str = "tensor", options: dict | None = None,
                         heads: str = "whole", dtype: str | None = None,
                         hbm_gib: float | None = None, keep_hlo: bool = False,
                         scan_layers: bool | None = None,
                         quantize: str | None = None) -> AotReport:
    """Compiles the whole decode for a TPU slice without weights or a TPU.

    Args:
      model: a preset name ("llada-8b-instruct") or a ModelConfig.
      sampler: a registered sampler name; options: its options (e.g. {"cache": "dual"}).
      gen_length: tokens generated per row.
      batch: rows; padded as `generate` pads them (1, 2, 4, 8, then multiples of 8, and a
        multiple of the mesh's batch axes).
      prompt_len: prompt tokens, rounded up to `generate`'s prompt bucket.
      topology: "v5e:2x4", "v6e:1x1", "v5p:2x2x1", "v4:2x2x1", ...
      mesh: a mesh spec over the topology's chips ("data=1,tensor=8", "tensor", ...).
      heads: the sharding plan's head policy ("whole" or "split", see
        asynclane_jax.sharding.rules_for).
      dtype: parameter and compute dtype (default: the config's).
      hbm_gib: HBM per chip to check against (default: the generation's).
      keep_hlo: keep the compiled HLO text in the report (`hlo_text`).
      quantize: "int8": the linear layers' weights as int8 arrays with per-channel
        scales (asynclane_jax.models.quantize), as `load(..., quantize="int8")` gives
        them (a mixture-of-experts model's stacked routed experts too, one scale per
        expert and output channel); None or "none": in the dtype.
      scan_layers: the layer layout (`ModelConfig.scan_layers`); None: the config's.
    Returns:
      AotReport (per-device sizes, collectives, compile time, whether it fits).
    Raises:
      AotError: bad topology or mesh, libtpu missing; SamplerError / ConfigError for a
      bad sampler, option or preset.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from asynclane_jax import sharding
    from asynclane_jax.decoding import driver
    from asynclane_jax.decoding.api import batch_rows, make_schedule, prompt_bucket
    from asynclane_jax.decoding.schedule import SamplerError
    from asynclane_jax.models import abstract_model
    from asynclane_jax.models import quantize as quantize_lib

    mode = quantize_lib.check_mode(quantize)
    cfg, name = _config(model, dtype)
    if scan_layers is not None:
        cfg = cfg.replace(scan_layers=bool(scan_layers))
    options = dict(options or {})
    if batch < 1 or gen_length < 1 or prompt_len < 1:
        raise AotError("batch, gen_length and prompt_len must be positive")
    schedule = make_schedule(sampler, gen_length=gen_length, **options)
    if getattr(schedule, "delimiter_ids", ()) is None and getattr(schedule, "max_lanes", 1) != 1:
        # No tokenizer here to find AsyncLane's newline tokens: one stand-in id (the
        # end-of-text) forks instead. The ids are constants of the program, so the
        # compiled size and memory are those of the real decode.
        schedule = dataclasses.replace(schedule, delimiters=str(cfg.eos_token_id))
    schedule = schedule.bind(None, cfg)
    tpu = tpu_slice(topology, hbm_gib)
    try:
        plan = sharding.plan_for(cfg, _mesh(mesh, tpu), heads=heads)
    except sharding.ShardingError as e:
        raise AotError(str(e)) from None
    try:
        P = prompt_bucket(prompt_len, gen_length, cfg)
    except SamplerError as e:
        raise AotError(str(e)) from None
    rows = batch_rows(batch, plan=plan)

    graphdef, params = nnx.split(quantize_lib.abstract_quantized(abstract_model(cfg), mode))
    operands = schedule.operands()
    key = jax.eval_shape(lambda: jax.random.key(0))
    shapes = (params, jax.ShapeDtypeStruct((rows, P + gen_length), jnp.int32),
              jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), bool),
              key, operands)
    where = sharding.decode_shardings(plan, params, rows, P + gen_length, operands)
    params, canvas, pad_len, live, rng, operands = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, where)

    # The traced options (thresholds) as per-row arguments, as `generate` and the server
    # compile them: one program for every value.
    traced = driver.traced_arrays(schedule, rows)
    if traced is not None:
        rep = None if plan is None else plan.replicated()
        traced = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep)
                  for n, v in traced.items()}
    t0 = time.perf_counter()
    lowered = driver.lower_decode(graphdef, params, canvas, pad_len, live, rng, operands,
                                  traced, schedule=schedule.structure(), plan=plan)
    t1 = time.perf_counter()
    compiled, failure = None, ""
    try:
        with compile_cache.off():  # a topology's program cannot be read back from it
            compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses what does not fit in HBM
        if not _out_of_memory(e):
            raise
        failure = f"the TPU compiler ran out of HBM: {_oom_message(e)}"
    t2 = time.perf_counter()

    sizes: dict[str, Any] = dict.fromkeys(
        ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes",
         "peak_bytes", "compiler_peak_bytes", "headroom_bytes"))
    collectives = dict.fromkeys(COLLECTIVES, 0)
    hlo = None
    if compiled is not None:
        mem = compiled.memory_analysis()
        sizes.update(argument_bytes=mem.argument_size_in_bytes,
                     output_bytes=mem.output_size_in_bytes,
                     alias_bytes=mem.alias_size_in_bytes,
                     temp_bytes=mem.temp_size_in_bytes,
                     code_bytes=mem.generated_code_size_in_bytes,
                     compiler_peak_bytes=getattr(mem, "peak_memory_in_bytes", None))
        peak = (sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"]
                + sizes["temp_bytes"] + sizes["code_bytes"])
        sizes.update(peak_bytes=peak, headroom_bytes=tpu.hbm_bytes - peak)
        hlo = compiled.as_text()
        collectives = count_collectives(hlo)
        if peak > tpu.hbm_bytes:
            failure = (f"needs {size_text(peak)} per chip, {tpu.device_kind} chips have "
                       f"{size_text(tpu.hbm_bytes)} (over by "
                       f"{size_text(peak - tpu.hbm_bytes)})")

    return AotReport(
        model=name, sampler=sampler, options=options, gen_length=gen_length,
        prompt_len=P, batch=batch, rows=rows, dtype=cfg.param_dtype,
        quantize=mode or "none",
        topology=tpu.topology, device_kind=tpu.device_kind, chips=len(tpu.devices),
        mesh=sharding.describe(plan.mesh), heads=heads, scan_layers=cfg.scan_layers,
        hbm_bytes=tpu.hbm_bytes,
        param_bytes=quantize_lib.weight_bytes(params),
        **sizes, fits=not failure, reason=failure, collectives=collectives,
        lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
        hlo_text=hlo if keep_hlo else None, **_experts(cfg, plan))


def _experts(cfg, plan) -> dict:
    """The report's experts fields: routed experts per layer and per chip."""
    if not cfg.is_moe:
        return {}
    split = math.prod(plan.mesh.shape[a] for a in plan.expert_axes(cfg.n_experts))
    return {"experts": cfg.n_experts, "experts_per_chip": cfg.n_experts // split}


def _oom_message(e: BaseException) -> str:
    """The compiler's own account of an HBM overflow, on one line."""
    text = str(e)
    m = re.search(r"(Ran out of memory in memory space hbm[^\n]*)", text)
    line = m.group(1) if m else _first_line(e)
    return re.sub(r"\s+", " ", line).strip()


# --------------------------------------------------------------------------- command


def register(subparsers) -> None:
    """Adds the `aot` subcommand to the asynclane-jax command line."""
    from asynclane_jax.models.config import DTYPES, PRESETS
    from asynclane_jax.models.quantize import CHOICES as QUANTIZE_CHOICES

    p = subparsers.add_parser(
        "aot", help="compile the decode for a TPU slice (no weights, no TPU): per-chip "
                    "memory and whether it fits",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named config")
    p.add_argument("--model", help="a converted folder or shipped model name (its config)")
    p.add_argument("--sampler", default=DEFAULT_SAMPLER)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a sampler option, e.g. cache=dual (repeat for more)")
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--topology", required=True,
                   help="TPU slice: v5e:2x4, v6e:1x1, v5p:2x2x1, v4:2x2x1, ...")
    p.add_argument("--mesh", default="tensor",
                   help="mesh over the slice's chips, e.g. data=1,tensor=8 (default: "
                        "every chip on the tensor axis)")
    p.add_argument("--heads", choices=("whole", "split"), default="whole",
                   help="attention heads the tensor axis does not divide: replicate "
                        "attention (whole, default) or cut inside heads (split)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="parameter and compute dtype (default bfloat16)")
    p.add_argument("--hbm-gib", type=float, default=None,
                   help="HBM per chip to check against (default: the generation's: "
                        + ", ".join(f"{k} {v['hbm_gib']}" for k, v in GENERATIONS.items())
                        + ")")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the layers as one scan over stacked parameters "
                        "(--no-scan-layers: unrolled; default: the config's)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="int8: the linear layers' weights as int8 with per-channel scales "
                        "(default none)")
    p.add_argument("--save-hlo", default=None, metavar="PATH",
                   help="write the compiled program's HLO text here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    """The `aot` command: 0 when the decode fits, 1 when it does not (and why)."""
    from asynclane_jax.decoding.registry import parse_options

    if (args.preset is None) == (args.model is None):
        raise AotError("give exactly one of --preset NAME or --model PATH")
    if args.preset:
        model = args.preset
    else:
        from asynclane_jax.checkpoint import read_config

        model = read_config(args.model)[0]
    for pair in args.option:
        if "=" not in pair:
            raise AotError(f"--option {pair!r}: expected KEY=VALUE")
    report = compile_for_topology(
        model, sampler=args.sampler, gen_length=args.gen_length, batch=args.batch,
        prompt_len=args.prompt, topology=args.topology, mesh=args.mesh,
        options=parse_options(args.option), heads=args.heads, dtype=args.dtype,
        hbm_gib=args.hbm_gib, keep_hlo=bool(args.save_hlo), scan_layers=args.scan_layers,
        quantize=args.quantize)
    if args.model:
        report.model = str(args.model)
    if args.save_hlo and report.hlo_text is not None:
        with open(args.save_hlo, "w") as f:
            f.write(report.hlo_text)
    print(report.to_json() if args.json else report.summary())
    if not report.fits:
        print(f"asynclane-jax aot: does not fit on {report.topology}: {report.reason}",
              file=sys.stderr)
        return 1
    return 0


__all__ = ["AotError", "AotReport", "COLLECTIVES", "GENERATIONS", "Slice",
           "collectives_brief", "compile_for_topology", "count_collectives",
           "parse_topology", "register",
           "tpu_compiler_available", "tpu_slice"]
