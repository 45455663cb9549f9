"""Compile the whole 8B decode program from abstract parameters and report what it costs.

LLaDA-8B-Instruct in bfloat16 (no weights are allocated: the parameters are
ShapeDtypeStructs), one sampler, batch b, prompt bucket P, gen_length G. The decode is
compiled ahead of time for this machine's backend (on a CPU-only machine, the CPU), and
the compiled program's own `memory_analysis()` is reported: arguments (the weights),
output, and the temporaries the program needs on top (the K/V cache and what the loop
copies of it). Results are printed and appended to experiments/results/compile/compile_8b.json.

With `--tpu v6e:1x1` (needs `jax[tpu]` of the JAX version in use; no TPU is needed) the
real TPU compiler builds the program for one chip of that topology. The CPU backend has
no bfloat16 matmul and upcasts every weight to float32 inside the program, so its
temporaries (about twice the weights) say little about a TPU's; the TPU compile is the
one to read for memory. For a slice of several chips under a sharding plan, and to
know whether it fits, use `asynclane-jax aot` (asynclane_jax/aot.py; the 8B rows are in
experiments/results/compile/memory-8b.md, made by experiments/memory_8b.py).

Usage: python experiments/compile_8b.py [--preset llada-8b-instruct] [--batch 8]
       [--gen-length 256] [--prompt 128] [--sampler fast-dllm] [--option cache=dual]
       [--tpu TOPOLOGY]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

from asynclane_jax.decoding import driver
from asynclane_jax.decoding.api import make_schedule
from asynclane_jax.decoding.registry import parse_options
from asynclane_jax.models import abstract_model, preset

RESULTS = pathlib.Path(__file__).parent / "results" / "compile"


def _tpu_sharding(topology: str):
    """A sharding that places everything on the first chip of a TPU topology."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                        chips_per_host_bounds=(1, 1, 1))
    mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def measure(preset_name: str, batch: int, gen_length: int, prompt: int, sampler: str,
            options: dict, tpu: str | None = None) -> dict:
    """Lowers and compiles the decode; returns timings and the memory analysis."""
    cfg = preset(preset_name)
    graphdef, params = nnx.split(abstract_model(cfg))
    schedule = make_schedule(sampler, gen_length=gen_length, **options)
    fn = jax.jit(functools.partial(driver.decode_for_caller, graphdef, schedule=schedule))
    T = prompt + gen_length
    sharding = _tpu_sharding(tpu) if tpu else None
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    key = jax.random.key(0)
    args = (jax.tree.map(place, params), place(jax.ShapeDtypeStruct((batch, T), jnp.int32)),
            place(jax.ShapeDtypeStruct((batch,), jnp.int32)),
            place(jax.ShapeDtypeStruct((batch,), bool)),
            jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding) if tpu else key)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    cache_bytes = 2 * cfg.n_layers * batch * T * cfg.n_kv_heads * cfg.head_dim * 2
    return {"preset": preset_name, "sampler": sampler, "options": options, "batch": batch,
            "gen_length": gen_length, "prompt": prompt,
            "backend": f"tpu {tpu}" if tpu else jax.default_backend(),
            "machine": platform.machine(), "lower_s": round(t1 - t0, 2),
            "compile_s": round(t2 - t1, 2), "temp_bytes": mem.temp_size_in_bytes,
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "kv_cache_bytes": cache_bytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llada-8b-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--sampler", default="fast-dllm")
    ap.add_argument("--option", action="append", default=None,
                    help="sampler option KEY=VALUE (default: cache=dual)")
    ap.add_argument("--tpu", default=None, metavar="TOPOLOGY",
                    help="compile for one chip of this TPU topology, e.g. v6e:1x1")
    ap.add_argument("--label", default="", help="a note stored with the row")
    args = ap.parse_args()
    options = parse_options(args.option or ["cache=dual"])
    row = measure(args.preset, args.batch, args.gen_length, args.prompt, args.sampler,
                  options, args.tpu)
    row["label"] = args.label
    print(json.dumps(row))
    gib = 2 ** 30
    print(f"{args.preset} {args.sampler} {options} batch {args.batch}: compile "
          f"{row['compile_s']:.1f}s, temporaries {row['temp_bytes'] / gib:.2f} GiB "
          f"(K/V cache {row['kv_cache_bytes'] / gib:.2f} GiB), weights "
          f"{row['argument_bytes'] / gib:.2f} GiB, output {row['output_bytes'] / gib:.3f} GiB")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "compile_8b.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(rows + [row], indent=1) + "\n")


if __name__ == "__main__":
    main()
