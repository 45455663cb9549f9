"""Layer stack: the model's unrolled Python loop vs a lax.scan over stacked layer params.

`DiffusionLM.forward` runs its blocks in a Python loop, so the compiled program holds
one copy of the block per layer. The alternative is one `jax.lax.scan` over the layer
parameters stacked along a new leading axis [L, ...], carrying (x, cache). This script
builds that scanned variant of the same forward (same `Block.qkv`, `Block.__call__`,
`KVCache.write` with a traced layer index, same output head) and compares the two side
by side, for the two calls decoding makes (see asynclane_jax/decoding/driver.py):

  cached  Q query columns against the K/V cache (their fresh K/V written first);
  full    the whole canvas, every column's K/V written into the cache, logits read at
          Q planned columns.

In both, the cache is an argument and is donated (decoding carries it in its loop), and
the parameters are arguments of the compiled function (the stacked ones are stacked
outside it, never inside).

  1. Big model (default LLaDA-8B-Instruct, abstract parameters: nothing is allocated),
     in its bf16 and, as a control, in float32 (XLA:CPU has no native bf16 matmul: it
     converts bf16 weights to float32, which dominates the bf16 temp sizes on a CPU):
     lower + compile both calls for both variants on this machine; report the seconds
     and `compiled.memory_analysis()` (temp / argument / output / alias).
  2. Mid-size random model (float32, concrete): the same, plus the median run time of
     each call (compilation excluded) and a check that both variants give the same
     logits and caches.

Results are printed and written to experiments/results/layer_stack.{md,json}.

With `--tpu TOPOLOGY` (e.g. v6e:1x1; needs `jax[tpu]` of the JAX version in use, no TPU
is needed) only part 1 runs, in bfloat16 only: every abstract argument (parameters,
inputs, cache) is placed on the first chip of that topology and the real TPU compiler
builds both calls ahead of time. There is no float32 control (the TPU has native bf16
matmuls) and no mid-size run (nothing to run on). Results go to
experiments/results/layer_stack_tpu.{md,json}.

Usage: python experiments/layer_stack.py [--big-preset llada-8b-instruct] [--skip-big]
         [--big-dtypes bfloat16,float32] [--tpu TOPOLOGY]
         [--batch 8] [--canvas 384] [--queries 32] [--mid-d-model 512] [--mid-layers 8]
         [--mid-vocab 1024] [--mid-batch 4] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asynclane_jax.models import KVCache, abstract_model, init_model, preset
from asynclane_jax.models.config import ModelConfig
from asynclane_jax.models.model import DiffusionLM, query_block_ids

RESULTS = pathlib.Path(__file__).parent / "results"

# What the layer-stack choice in DiffusionLM.forward rests on (written from the results
# of this script; see results/layer_stack.md for the full table).
LAYER_STACK_NOTE = """\
Since written: the scanned stack is a model option, `ModelConfig.scan_layers` (default
off; `load(..., scan_layers=True)`, `convert --scan-layers`, `aot --scan-layers`); on
whole 8B decodes it compiles ~4.7x faster with ~20x less code (results/memory-8b.md,
"Layer layouts"). What follows is this script's original finding.
Keep the unrolled loop, for now: scan's only gain is compile time; on TPU it is ~2x
faster to compile and smaller (not larger) in temporaries, but its TPU run time is
unmeasured and it would change the parameter tree. jax 0.10.2, 2 shared CPU cores:
- Run time (CPU backend only): no difference. Mid-size float32 model (d 512, 8 layers,
  batch 4, T 384), median of 9 interleaved calls: cached 133 ms unrolled vs 143 ms scan
  (min 116 vs 116), full 1070 ms vs 1041 ms; within the run-to-run noise. Logits agree
  to 2.4e-6.
- CPU compile: LLaDA-8B bf16, batch 8, T 384, Q 32: lower + compile 6.1 s unrolled vs
  1.4 s scan (cached call), 5.7 s vs 1.5 s (full forward). CPU memory: in float32 (bf16
  on a CPU is dominated by XLA:CPU's float32 copies of every weight, ~31 GiB temp in both)
  temp is 68 MiB unrolled vs 784 MiB scan (cached) and 483 vs 979 MiB (full): XLA:CPU
  copies each layer's weights out of the stacked arrays (dynamic-slice fusions of
  [4096, 12288] kernels) where the unrolled program reads them in place.
- TPU compile (v6e:1x1, the real TPU compiler ahead of time, no TPU present; same model
  and shapes, bf16; results/layer_stack_tpu.md): compile 42 s unrolled vs 22 s scan
  (cached), 61 s vs 35 s (full); lowering under 1 s in both. Temp 63 MiB unrolled vs
  0.6 MiB scan (cached), 363 vs 233 MiB (full): the TPU compiler does not copy the layer
  slices, so the CPU's memory argument against scan does not carry over; on TPU scan is
  the smaller one, by at most 130 MiB next to 16.4 GiB of weights and cache. (Another
  benchmark shared the 2 cores during these compiles: the seconds are inflated for both
  variants; read the ~1.7-1.9x ratio, not the absolute values.)
- The whole unrolled 8B decode program (fast-dllm dual cache, batch 8, gen 256) takes
  181 s to compile on TPU with 2.30 GiB temporaries, 1.5 GiB of them the K/V cache
  (results/compile_8b.json). Scan would plausibly cut that compile by a similar factor
  (not measured); temporaries would not grow. That is a one-time cost per compiled
  program (prompt bucket x batch x sampler), which JAX's persistent compilation cache
  also removes across processes, so it does not by itself justify the change.
- Against scan: stacked parameters change the parameter tree (converter, sharding names,
  checkpoints), and a scanned layer loop may cost TPU run time (layer boundaries limit
  cross-layer scheduling and fusion); neither variant has been run on a TPU or a GPU.
Revisit if TPU compile time becomes the bottleneck (many buckets, no persistent cache):
time both variants on a real TPU and switch to scan if its run time is within noise.
"""

MiB = 1024 * 1024


class _Head(nnx.Module):
    """The non-layer parts of a DiffusionLM (shared, not copied): embedding, final norm
    and output head, with the model's own `_logits`."""

    def __init__(self, model: DiffusionLM):
        self.cfg = model.cfg
        self.embed = model.embed
        self.final_norm = model.final_norm
        self.lm_head = model.lm_head

    _logits = DiffusionLM._logits


def stack_layers(model: DiffusionLM, abstract: bool):
    """One block's graphdef and every block's parameters stacked along a new axis 0.

    Args:
      model: the model (concrete, or abstract from `abstract_model`).
      abstract: stack with `jax.eval_shape` (ShapeDtypeStruct leaves, nothing allocated).
    Returns:
      (block graphdef, stacked State with leaves [L, ...]).
    """
    block_def, _ = nnx.split(model.layers[0])
    states = [nnx.state(layer) for layer in model.layers]

    def stack(*trees):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

    return block_def, (jax.eval_shape(stack, *states) if abstract else stack(*states))


def scanned_forward(head: _Head, block_def, stacked, tokens, positions, *, key_mask=None,
                    cache: KVCache | None = None, write_index=None, logits_index=None,
                    block_ids=None, implementation=None):
    """`DiffusionLM.forward` with the layer loop replaced by a lax.scan over `stacked`.

    Same arguments and results as `DiffusionLM.forward`; `head` holds the embedding and
    output head, `block_def` / `stacked` the blocks (see `stack_layers`).
    """
    cfg = head.cfg
    x = jnp.take(head.embed[...], tokens, axis=0).astype(cfg.jnp_dtype)
    q_block, k_block = query_block_ids(block_ids, cache, write_index)
    rows = jnp.arange(tokens.shape[0])[:, None]

    def body(carry, xs):
        x, cache = carry
        layer_state, i = xs
        layer = nnx.merge(block_def, layer_state)
        x, cache = layer.step(i, x, positions, cache, rows, write_index, key_mask=key_mask,
                              q_block=q_block, k_block=k_block, implementation=implementation)
        return (x, cache), None

    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, layer_ids))
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
    return head._logits(x).astype(jnp.float32), cache


def make_variants(model: DiffusionLM, abstract: bool) -> dict:
    """Both variants as (function, params): function(params, tokens, positions, key_mask,
    cache, write_index, logits_index) -> (logits, cache)."""
    graphdef, state = nnx.split(model)

    def unrolled(params, tokens, positions, key_mask, cache, write_index, logits_index):
        return nnx.merge(graphdef, params).forward(
            tokens, positions, key_mask=key_mask, cache=cache, write_index=write_index,
            logits_index=logits_index)

    head_def, head_state = nnx.split(_Head(model))
    block_def, stacked = stack_layers(model, abstract)

    def scanned(params, tokens, positions, key_mask, cache, write_index, logits_index):
        head_p, stacked_p = params
        return scanned_forward(nnx.merge(head_def, head_p), block_def, stacked_p, tokens,
                               positions, key_mask=key_mask, cache=cache,
                               write_index=write_index, logits_index=logits_index)

    return {"unrolled": (unrolled, state), "scan": (scanned, (head_state, stacked))}


def call_args(cfg: ModelConfig, batch: int, canvas: int, queries: int, *,
              abstract: bool, seed: int = 0) -> dict:
    """Inputs of the cached call and of the full forward (without params).

    Abstract: ShapeDtypeStruct leaves. Concrete: random tokens, left padding on half the
    rows, distinct random query columns (one slot per row set to T, i.e. dropped), and a
    zero cache (the full forward fills it before the cached call is run).
    Returns:
      {"cached": tuple, "full": tuple} of (tokens, positions, key_mask, cache,
      write_index, logits_index).
    """
    b, T, Q = batch, canvas, queries
    shape = (cfg.n_layers, b, T, cfg.n_kv_heads, cfg.head_dim)
    if abstract:
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        cache = KVCache(jax.ShapeDtypeStruct(shape, cfg.jnp_dtype),
                        jax.ShapeDtypeStruct(shape, cfg.jnp_dtype))
        key_mask = jax.ShapeDtypeStruct((b, T), jnp.bool_)
        return {"cached": (i32(b, Q), i32(b, Q), key_mask, cache, i32(b, Q), None),
                "full": (i32(b, T), i32(b, T), key_mask, cache, i32(b, T), i32(b, Q))}
    rng = np.random.default_rng(seed)
    pad = np.where(np.arange(b) % 2 == 1, rng.integers(1, T // 4, size=b), 0)
    cols = np.arange(T)[None, :]
    key_mask = cols >= pad[:, None]
    positions = np.maximum(cols - pad[:, None], 0).astype(np.int32)
    canvas_tokens = rng.integers(0, cfg.vocab_size, size=(b, T)).astype(np.int32)
    q_cols = np.stack([np.sort(rng.choice(np.arange(p, T), size=Q, replace=False))
                       for p in pad]).astype(np.int32)
    write = q_cols.copy()
    write[:, -1] = T  # an unused query slot: its K/V is dropped
    take = lambda a: np.take_along_axis(a, q_cols, axis=1)
    cache = KVCache.zeros(cfg, b, T)
    j = jnp.asarray
    return {"cached": (j(take(canvas_tokens)), j(take(positions)), j(key_mask), cache,
                       j(write), None),
            "full": (j(canvas_tokens), j(positions), j(key_mask), cache,
                     j(np.broadcast_to(cols, (b, T)).astype(np.int32)), j(q_cols))}


def compile_fn(fn, params, args) -> tuple:
    """Lowers and compiles fn(params, *args) with the cache (args[3]) donated.

    Returns:
      (compiled, stats dict: lower_s, compile_s and memory_analysis sizes in bytes).
    """
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=4).lower(params, *args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    stats = {"lower_s": t1 - t0, "compile_s": t2 - t1}
    for name in ("temp", "argument", "output", "alias", "generated_code"):
        stats[f"{name}_bytes"] = int(getattr(mem, f"{name}_size_in_bytes", -1)) if mem else -1
    return compiled, stats


def copy_tree(tree):
    """A fresh copy of every array (donated buffers cannot be reused)."""
    return jax.tree.map(jnp.copy, tree)


def run_times(calls: dict, repeats: int) -> dict:
    """Seconds of each compiled call, the variants interleaved (A B A B ...) so that load
    from other processes on the machine falls on both alike.

    Args:
      calls: name -> (compiled, params, args); each call's returned cache is chained into
        its next call (as decoding does with a donated cache).
      repeats: timed runs per call, after one warm-up run each.
    Returns:
      name -> list of seconds.
    """
    state = {n: [c, p, list(a)] for n, (c, p, a) in calls.items()}
    for _, _, a in state.values():
        a[3] = copy_tree(a[3])
    times = {n: [] for n in calls}
    for rep in range(repeats + 1):  # the first round warms up
        for name, (compiled, params, a) in state.items():
            t0 = time.perf_counter()
            _, a[3] = jax.block_until_ready(compiled(params, *a))
            if rep:
                times[name].append(time.perf_counter() - t0)
    return times


def tpu_sharding(topology: str):
    """A sharding that places everything on the first chip of a TPU topology (no TPU
    needed: the devices are the topology's descriptions, for ahead-of-time compiles)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                        chips_per_host_bounds=(1, 1, 1))
    mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def place(tree, sharding):
    """Every ShapeDtypeStruct leaf of tree given `sharding` (None leaves stay None)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def measure_big(cfg: ModelConfig, args) -> list[dict]:
    """Compile-only comparison on the abstract big model (cfg's dtypes); with args.tpu,
    compiled for one chip of that TPU topology."""
    model = abstract_model(cfg)
    variants = make_variants(model, abstract=True)
    inputs = call_args(cfg, args.batch, args.canvas, args.queries, abstract=True)
    label = f"{args.big_preset} {cfg.dtype} b{args.batch}"
    if args.tpu:
        sharding = tpu_sharding(args.tpu)
        variants = {n: (fn, place(params, sharding)) for n, (fn, params) in variants.items()}
        inputs = {c: place(a, sharding) for c, a in inputs.items()}
        label += f" tpu {args.tpu}"
    rows = []
    for call in ("cached", "full"):
        for name, (fn, params) in variants.items():
            _, stats = compile_fn(fn, params, inputs[call])
            row = {"model": label, "call": call, "variant": name, **stats}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def measure_mid(cfg: ModelConfig, args) -> list[dict]:
    """Compile, time and cross-check both variants on a concrete mid-size model."""
    model = init_model(cfg, 0)
    variants = make_variants(model, abstract=False)
    inputs = call_args(cfg, args.mid_batch, args.canvas, args.queries, abstract=False)
    compiled = {(c, n): compile_fn(fn, params, inputs[c])
                for c in ("full", "cached") for n, (fn, params) in variants.items()}
    # Cross-check: the full forward from a zero cache, then the cached call from the
    # cache it wrote (the unrolled one), in both variants.
    outs = {}
    for name, (_, params) in variants.items():
        full = inputs["full"]
        outs["full", name] = compiled["full", name][0](params, *full[:3], copy_tree(full[3]),
                                                       *full[4:])
    filled = outs["full", "unrolled"][1]
    cached_in = (*inputs["cached"][:3], filled, *inputs["cached"][4:])
    for name, (_, params) in variants.items():
        outs["cached", name] = compiled["cached", name][0](
            params, *cached_in[:3], copy_tree(filled), *cached_in[4:])
    label = (f"mid d{cfg.d_model} L{cfg.n_layers} V{cfg.vocab_size} f32 b{args.mid_batch}")
    rows = []
    for call, call_inputs in (("cached", cached_in), ("full", inputs["full"])):
        ref_logits, ref_cache = outs[call, "unrolled"]
        times = run_times({n: (compiled[call, n][0], params, call_inputs)
                           for n, (_, params) in variants.items()}, args.repeats)
        for name in variants:
            logits, cache = outs[call, name]
            diff = float(jnp.max(jnp.abs(logits - ref_logits)))
            cache_diff = max(float(jnp.max(jnp.abs(a - r)))
                             for a, r in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)))
            same = bool(np.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
                        and cache_diff <= 1e-4)
            row = {"model": label, "call": call, "variant": name, **compiled[call, name][1],
                   "run_s": float(np.median(times[name])), "run_min_s": min(times[name]),
                   "run_all_s": times[name],
                   "max_abs_logit_diff": diff, "max_abs_cache_diff": cache_diff,
                   "allclose": same}
            print(json.dumps(row), flush=True)
            rows.append(row)
    assert all(r["allclose"] for r in rows), "scan and unrolled variants disagree"
    return rows


def table(rows: list[dict]) -> list[str]:
    """Markdown table of the measured rows."""
    lines = ["| model | call | variant | lower s | compile s | temp MiB | argument MiB | "
             "output MiB | alias MiB | run ms (min) | max abs logit diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = f"{1e3 * r['run_s']:.1f} ({1e3 * r['run_min_s']:.1f})" if "run_s" in r else ""
        diff = f"{r['max_abs_logit_diff']:.1e}" if "max_abs_logit_diff" in r else ""
        lines.append(
            f"| {r['model']} | {r['call']} | {r['variant']} | {r['lower_s']:.2f} | "
            f"{r['compile_s']:.2f} | {r['temp_bytes'] / MiB:,.1f} | "
            f"{r['argument_bytes'] / MiB:,.1f} | {r['output_bytes'] / MiB:,.1f} | "
            f"{r['alias_bytes'] / MiB:,.1f} | {run} | {diff} |")
    return lines


def write_results(stem: str, meta: dict, intro: list[str], rows: list[dict]) -> None:
    """Writes experiments/results/<stem>.json ({"meta", "rows"}) and <stem>.md (the intro
    lines, the table, and where the conclusion lives); prints the markdown."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                     indent=2) + "\n")
    lines = [*intro, "", *table(rows), "",
             "The conclusion drawn from these numbers is `LAYER_STACK_NOTE` in "
             "experiments/layer_stack.py.", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _machine() -> dict:
    return {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "jax": jax.__version__}


def write_tpu(rows: list[dict], args) -> None:
    """Writes the TPU compile rows to experiments/results/layer_stack_tpu.{md,json}."""
    meta = {"backend": f"tpu {args.tpu} (ahead of time, first chip; no TPU present)",
            **_machine(), "big_preset": args.big_preset, "big_dtypes": ["bfloat16"],
            "batch": args.batch, "canvas": args.canvas, "queries": args.queries}
    write_results("layer_stack_tpu", meta, [
        "# Layer stack on TPU: unrolled Python loop vs lax.scan, ahead-of-time compile",
        "",
        "The big-model part of experiments/layer_stack.py (see results/layer_stack.md for "
        "the variants and calls) compiled with the real TPU compiler for the first chip of "
        f"topology `{args.tpu}` (`jax.experimental.topologies.get_topology_desc`; no TPU "
        "present, nothing is run). Every abstract argument (parameters, inputs, donated "
        "K/V cache) carries a single-chip `NamedSharding`; "
        "`jax.jit(f, donate_argnums=cache).lower(...).compile()`, sizes from "
        "`compiled.memory_analysis()`.",
        "",
        f"- Model: `{args.big_preset}` in bfloat16, abstract parameters, batch {args.batch}, "
        f"T = {args.canvas}, Q = {args.queries}. No float32 control and no run times.",
        f"- Compiled on: {meta['platform']}, {meta['cpu']}, jax {meta['jax']}.",
    ], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big-preset", default="llada-8b-instruct")
    ap.add_argument("--skip-big", action="store_true", help="skip the abstract big model")
    ap.add_argument("--big-dtypes", default="bfloat16,float32",
                    help="comma-separated dtypes (params and compute) of the big model")
    ap.add_argument("--batch", type=int, default=8, help="batch of the big model")
    ap.add_argument("--canvas", type=int, default=384, help="canvas length T")
    ap.add_argument("--queries", type=int, default=32, help="query columns Q")
    ap.add_argument("--mid-d-model", type=int, default=512)
    ap.add_argument("--mid-layers", type=int, default=8)
    ap.add_argument("--mid-vocab", type=int, default=1024)
    ap.add_argument("--mid-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tpu", default=None, metavar="TOPOLOGY",
                    help="compile the big model (bf16 only) for one chip of this TPU "
                         "topology, e.g. v6e:1x1; skips the mid-size run")
    args = ap.parse_args()
    if args.tpu:
        args.skip_big = False
        args.big_dtypes = "bfloat16"

    rows = []
    big = preset(args.big_preset)
    if not args.skip_big:
        for dtype in args.big_dtypes.split(","):
            rows += measure_big(big.replace(dtype=dtype, param_dtype=dtype), args)
    if args.tpu:
        write_tpu(rows, args)
        return
    heads = max(1, args.mid_d_model // 64)
    mid = preset("tiny-llada-test").replace(
        vocab_size=args.mid_vocab, d_model=args.mid_d_model, n_layers=args.mid_layers,
        n_heads=heads, n_kv_heads=heads, head_dim=args.mid_d_model // heads,
        mlp_hidden=3 * args.mid_d_model, mask_token_id=args.mid_vocab - 1,
        eos_token_id=args.mid_vocab - 2, pad_token_id=args.mid_vocab - 2,
        max_seq_len=max(args.canvas, 256))
    rows += measure_mid(mid, args)

    meta = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            **_machine(), "big_preset": None if args.skip_big else args.big_preset,
            "big_dtypes": args.big_dtypes.split(","),
            "batch": args.batch, "mid_batch": args.mid_batch, "canvas": args.canvas,
            "queries": args.queries, "repeats": args.repeats, "mid_config": mid.to_dict()}
    write_results("layer_stack", meta, [
        "# Layer stack: unrolled Python loop vs lax.scan over stacked layer parameters",
        "",
        "Same forward in both variants (`Block.qkv`, `Block.__call__`, `KVCache.write`; the "
        "scan carries (x, cache) with a traced layer index over parameters stacked [L, ...] "
        "outside the compiled function). Two calls: `cached` = Q query columns against a "
        f"donated K/V cache of T = {args.canvas} columns; `full` = the whole canvas, writing "
        f"every column's K/V into the donated cache, logits read at Q = {args.queries} "
        "columns (as decoding does).",
        "",
        f"- Big model: `{meta['big_preset']}` in {' and '.join(meta['big_dtypes'])}, abstract "
        f"parameters, batch {args.batch}: lowered and compiled only "
        "(`jax.jit(f).lower(...).compile()`), sizes from `compiled.memory_analysis()`. "
        "XLA:CPU converts bf16 weights to float32 for its matmuls, so the bf16 temp sizes "
        "here are mostly those copies (a CPU artifact); the float32 rows show the "
        "activations and the scan's per-layer weight slices without it.",
        f"- Mid model: random float32 {mid.d_model} wide, {mid.n_layers} layers, vocab "
        f"{mid.vocab_size}, batch {args.mid_batch}: also run; run ms = median (min) "
        f"of {args.repeats} calls after a warm-up, the two variants interleaved, compilation "
        "excluded; logits and caches "
        "checked allclose (rtol = atol = 1e-4) against the unrolled variant.",
        f"- Machine: backend `{meta['backend']}` ({', '.join(meta['devices'])}), "
        f"{meta['platform']}, {meta['cpu']}, jax {meta['jax']}. CPU compile times and "
        "buffer sizes, not a GPU's.",
    ], rows)


if __name__ == "__main__":
    main()
