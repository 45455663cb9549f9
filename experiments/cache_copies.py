"""How many K/V caches a compiled decode holds: temporaries against the cache's bytes.

Compiles (lower + compile on the CPU, no weights) the decode of a small LLaDA-shaped
model whose K/V cache dominates its memory (few layers, many K/V heads, a long canvas)
for AsyncLane and Fast-dLLM (cache=dual), and reports `memory_analysis()`'s temporaries
in units of the cache (k and v together), and the instructions of the optimized HLO
that yield a whole k or v cache array, by opcode (copies, selects, conditionals,
dynamic-update-slices, ...).

    python experiments/cache_copies.py --out experiments/results/cache_copies.json
    python experiments/cache_copies.py --toy --out experiments/results/cache_copies.json

`--toy` compiles the pattern alone: a while_loop carrying one [8, 4, 320, 4, 128] array
that each iteration updates by a scan over its first axis (a scatter per step, as the
scanned layers write the cache), the scan called directly, or from both branches of a
lax.cond, or a plain scatter from both branches.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
import types

import jax
import jax.numpy as jnp
from flax import nnx

from asynclane_jax.decoding import driver
from asynclane_jax.decoding.api import make_schedule
from asynclane_jax.models import ModelConfig, abstract_model

CASES = {
    "asynclane": ("asynclane", {}),
    "fast-dllm": ("fast-dllm", {"cache": "dual"}),
    # No visible horizon: no key bound, so no bounded / whole-canvas branch pair inside
    # the full and cached calls, and no first_plan call before the loop.
    "asynclane-horizon0": ("asynclane", {"horizon": 0}),
}


def small_config(layers: int, kv_heads: int, head_dim: int, scan: bool) -> ModelConfig:
    """LLaDA-shaped, K/V-heavy: every head a K/V head, small MLP and vocabulary.
    float32: the CPU backend widens bfloat16 arrays to float32 around its ops, which
    would add converted copies of the cache that a TPU does not make."""
    return ModelConfig(
        family="llada", vocab_size=128, d_model=kv_heads * head_dim, n_layers=layers,
        n_heads=kv_heads, n_kv_heads=kv_heads, head_dim=head_dim, mlp_hidden=64,
        rope_theta=10000.0, norm_eps=1e-5, mask_token_id=127, eos_token_id=126,
        pad_token_id=126, max_seq_len=4096, dtype="float32", param_dtype="float32",
        scan_layers=scan)


def measure(cfg: ModelConfig, sampler: str, options: dict, *, batch: int, prompt: int,
            gen: int, topology: str | None = None) -> dict:
    schedule = make_schedule(sampler, gen_length=gen, **options).bind(None, cfg)
    graphdef, params = nnx.split(abstract_model(cfg))
    T = prompt + gen
    canvas = jax.ShapeDtypeStruct((batch, T), jnp.int32)
    pad = jax.ShapeDtypeStruct((batch,), jnp.int32)
    live = jax.ShapeDtypeStruct((batch,), bool)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    t0 = time.perf_counter()
    if topology:  # the TPU compiler, ahead of time, without a TPU
        from asynclane_jax import aot

        report = aot.compile_for_topology(cfg, sampler=sampler, options=options,
                                          gen_length=gen, batch=batch, prompt_len=prompt,
                                          topology=topology, mesh="tensor", keep_hlo=True)
        if report.temp_bytes is None:
            raise SystemExit(f"{topology}: {report.reason}")
        mem = types.SimpleNamespace(temp_size_in_bytes=report.temp_bytes,
                                    argument_size_in_bytes=report.argument_bytes)
        hlo = report.hlo_text
    else:
        compiled = driver.lower_decode(graphdef, params, canvas, pad, live, rng,
                                       schedule.operands(), schedule=schedule).compile()
        mem = compiled.memory_analysis()
        hlo = compiled.as_text()
    secs = time.perf_counter() - t0
    shape = (cfg.n_layers, batch, T, cfg.n_kv_heads, cfg.head_dim)
    dt = {"bfloat16": "bf16", "float32": "f32"}[cfg.dtype]
    one = f"{dt}[{','.join(map(str, shape))}]"
    cache_bytes = 2 * jnp.dtype(cfg.dtype).itemsize
    for d in shape:
        cache_bytes *= d
    # Instructions (outside fusion bodies too) whose result is a whole k or v array.
    ops = collections.Counter()
    pat = re.compile(r"=\s*" + re.escape(one) + r"(?:\{[^}]*\})?\s+([a-z\-]+)\(")
    for line in hlo.splitlines():
        m = pat.search(line)
        if m:
            ops[m.group(1)] += 1
    return dict(sampler=sampler, options=options, layers=cfg.n_layers,
                kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, scan_layers=cfg.scan_layers,
                batch=batch, prompt=prompt, gen=gen, topology=topology or "cpu",
                cache_bytes=int(cache_bytes),
                temp_bytes=int(mem.temp_size_in_bytes),
                argument_bytes=int(mem.argument_size_in_bytes),
                temp_over_cache=round(mem.temp_size_in_bytes / cache_bytes, 2),
                cache_array=one, cache_shaped_ops=dict(sorted(ops.items())),
                compile_s=round(secs, 1)), hlo


def toy(topology: str | None = None) -> list[dict]:
    if topology:  # a bfloat16 array too large for the chip's on-chip memory
        from asynclane_jax import aot

        shape, dtype = (16, 8, 640, 16, 128), jnp.bfloat16
        where = jax.sharding.SingleDeviceSharding(aot.tpu_slice(topology).devices[0])
    else:
        shape, dtype, where = (8, 4, 320, 4, 128), jnp.float32, None
    one = jnp.dtype(dtype).itemsize
    for d in shape:
        one *= d

    def scanned(c, i, x):
        def body(c, layer):
            c = c.at[layer, :, i].set(x[layer])
            return c, jnp.sum(c[layer, :, :4].astype(jnp.float32))
        c, y = jax.lax.scan(body, c, jnp.arange(shape[0]))
        return c, y.sum()

    def scatter(c, i, x):
        return c.at[:, :, i].set(x), jnp.sum(c[0, :, :4].astype(jnp.float32))

    variants = {
        "scan, no cond": scanned,
        "scan in both branches of a cond": lambda c, i, x: jax.lax.cond(
            i % 2 == 0, scanned, lambda c, i, x: scanned(c, i + 1, x), c, i, x),
        "scatter in both branches of a cond": lambda c, i, x: jax.lax.cond(
            i % 2 == 0, scatter, lambda c, i, x: scatter(c, i + 1, x), c, i, x),
        # the driver's replacement for lax.cond: two while_loops of at most one trip
        "scan in driver.branch": lambda c, i, x: tuple(reversed(driver.branch(
            i % 2 == 0, lambda c: tuple(reversed(scanned(c, i, x))),
            lambda c: tuple(reversed(scanned(c, i + 1, x))), c,
            jnp.zeros((), jnp.float32)))),
    }
    rows = []
    for name, f in variants.items():
        def prog(c, x, f=f):
            def body(s):
                c, i, t = s
                c, y = f(c, i, x)
                return c, i + 1, t + y
            return jax.lax.while_loop(lambda s: s[1] < 10, body, (c, 0, 0.0))
        compiled = jax.jit(prog, donate_argnums=0).lower(
            jax.ShapeDtypeStruct(shape, dtype, sharding=where),
            jax.ShapeDtypeStruct(shape[:2] + shape[3:], dtype, sharding=where)).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        pat = r"\[" + ",".join(map(str, shape)) + r"\]\{[^}]*\} copy\("
        rows.append(dict(toy=name, topology=topology or "cpu", array=list(shape),
                         array_bytes=int(one), temp_bytes=int(temp),
                         temp_over_array=round(temp / one, 3),
                         whole_array_copies=len(re.findall(pat, compiled.as_text()))))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--unrolled", action="store_true", help="unrolled layers (default scan)")
    p.add_argument("--sampler", action="append", choices=sorted(CASES))
    p.add_argument("--label", default="", help="a tag stored with each row")
    p.add_argument("--save-hlo", default=None, metavar="PREFIX")
    p.add_argument("--out", default=None, help="append rows to this JSON list")
    p.add_argument("--topology", default=None,
                   help="compile for a TPU slice (e.g. v5e:1x1) in bfloat16, not the CPU")
    p.add_argument("--toy", action="store_true", help="the pattern alone (see above)")
    args = p.parse_args(argv)
    cfg = small_config(args.layers, args.kv_heads, args.head_dim, not args.unrolled)
    if args.topology:
        cfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    rows = []
    if args.toy:
        for row in toy(args.topology):
            row["command"] = "python experiments/cache_copies.py " + " ".join(
                argv or sys.argv[1:])
            print(json.dumps(row))
            rows.append(row)
    for name in [] if args.toy else args.sampler or sorted(CASES):
        sampler, options = CASES[name]
        row, hlo = measure(cfg, sampler, options, batch=args.batch, prompt=args.prompt,
                           gen=args.gen, topology=args.topology)
        row["label"] = args.label
        row["command"] = "python experiments/cache_copies.py " + " ".join(argv or sys.argv[1:])
        if args.save_hlo:
            with open(f"{args.save_hlo}-{name}.txt", "w") as f:
                f.write(hlo)
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        try:
            with open(args.out) as f:
                old = json.load(f)
        except FileNotFoundError:
            old = []
        with open(args.out, "w") as f:
            json.dump(old + rows, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
