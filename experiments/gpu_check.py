"""One check of a machine with an accelerator: a random LLaDA-8B in bfloat16 (nothing is
downloaded), timed.

  1. one full forward over T = 1024 tokens (batch 1);
  2. one cached call of 32 queries against a K/V cache of those 1024 positions;
  3. one generation of 512 tokens with every sampler that applies to LLaDA (every
     registered one but Dream's own; Fast-dLLM and LocalLeap with the dual cache), from
     a 64-token prompt: tokens/s, model calls;
  4. the int8 variant: the same model's linear layers quantized in place to int8 with
     per-channel scales (asynclane_jax.models.quantize, as `load(..., quantize="int8")`
     gives them), then one more generation with --int8-sampler (AsyncLane): its
     tokens/s, the weights' GiB, and how many of its tokens equal the bfloat16 run's;
  5. the cost model's call shapes (asynclane_jax.costs): a few full and cached calls
     (CALL_SHAPES: canvas 640, rows 1 and 8) timed on the accelerator in bfloat16 and,
     after quantizing, in int8, each printed beside the cost model's projection for
     the chip (`h200`, `v5e`, `v6e` from the device kind; none for another chip);
  6. before the int8 variant, the scanned variant: the same random model built in the scanned layer
     layout (`ModelConfig.scan_layers`: one Block with [L, ...] parameters run by
     lax.scan; the same weights for the same seed), one more generation with
     --int8-sampler: its compile seconds, tokens/s and token agreement with the unrolled
     run. It is built after the bfloat16 samplers and dropped before the int8 variant.
     A random model's next-token distributions are nearly flat, so bfloat16 rounding
     differences flip many near-ties: the agreements are read, not pass/fail (the exact
     checks are the float32 tests).

Each program is compiled first (compile seconds reported apart) and then timed; the
forwards report the median of 3 runs. Generation tokens/s counts tokens before the
first end-of-text (`stats.generated_tokens`, as every benchmark here does); a random
model may write an end-of-text early, so the canvas rate (gen_length / decode seconds)
is given too. A time budget (default 420 s) skips the samplers left when it runs out,
so that the whole check ends within 8 minutes; they are listed as skipped. The int8
and scanned generations are kept --int8-reserve-s (60 s) each of that budget: the
bfloat16 samplers stop starting that much earlier.

The last line printed is one JSON object with everything measured.

Usage: experiments/gpu_check.sh [--preset llada-8b-instruct] [--length 1024]
       [--gen-length 512] [--samplers a,b] [--budget-s 420] [--int8-sampler asynclane]
       [--int8-reserve-s 60] [--shapes-reserve-s 90] [--no-int8] [--no-scanned]
       [--no-shapes]
  CPU smoke run: experiments/gpu_check.sh --preset tiny-llada-test --length 64 --gen-length 64
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Samplers that belong to one family only.
FAMILY_ONLY = {"dream": "dream"}
# The call shapes timed against the cost model: (kind, rows, queries, keys, logits),
# on a canvas of CANVAS columns with a cache. The int8 pass times the first INT8_SHAPES.
CANVAS = 640
CALL_SHAPES = (("full", 1, CANVAS, CANVAS, 32), ("cached", 1, 32, CANVAS, 32),
               ("cached", 1, 160, CANVAS, 160), ("cached", 8, 32, CANVAS, 32))
INT8_SHAPES = 2
# Device kinds (lower case, a substring) -> the cost model's chip.
CHIP_OF_DEVICE = (("h200", "h200"), ("v6", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"))


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn, *args, repeats: int = 3) -> tuple[float, float]:
    """(seconds of the first call, which compiles; median seconds of `repeats` more)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def build_model(preset_name: str, seed: int = 0, scan_layers: bool = False):
    """The preset's random model in bfloat16, initialised on the default device inside
    one jitted program (no host copy of the weights); scan_layers picks the layout (the
    same weights either way for one seed)."""
    from asynclane_jax.models import DiffusionLM, preset

    cfg = preset(preset_name).replace(dtype="bfloat16", param_dtype="bfloat16",
                                      scan_layers=scan_layers)

    @nnx.jit
    def init():
        return DiffusionLM(cfg, rngs=nnx.Rngs(seed))

    model = init()
    jax.block_until_ready(nnx.state(model))
    return model, cfg


def ordinary_ids(cfg) -> int:
    """Token ids below this one are ordinary text (no mask, end-of-text or padding)."""
    specials = [cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.eot_token_id]
    return min(i for i in specials if i is not None)


def forward_checks(model, cfg, length: int, queries: int) -> dict:
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, ordinary_ids(cfg), (1, length)), jnp.int32)

    @jax.jit
    def full(params, tokens):
        m = nnx.merge(graphdef, params)
        return m(tokens)

    @jax.jit
    def prefill(params, tokens):
        return nnx.merge(graphdef, params)(tokens, return_kv=True)[1]

    @jax.jit
    def cached(params, q_tokens, positions, write_index, cache):
        m = nnx.merge(graphdef, params)
        return m.forward_cached(q_tokens, positions, write_index, cache)[0]

    first, full_s = timed(full, params, tokens)
    out = {"full_forward": {"tokens": length, "compile_and_run_s": round(first, 3),
                            "s": round(full_s, 4),
                            "tokens_per_s": round(length / full_s, 1)}}
    cache = jax.block_until_ready(prefill(params, tokens))
    start = length - queries
    cols = jnp.arange(start, length, dtype=jnp.int32)[None]
    first, cached_s = timed(cached, params, tokens[:, start:], cols, cols, cache)
    out["cached_call"] = {"queries": queries, "cache_positions": length,
                          "compile_and_run_s": round(first, 3), "s": round(cached_s, 4),
                          "speedup_vs_full": round(full_s / cached_s, 2)}
    return out


def chip_of(device_kind: str) -> str | None:
    kind = device_kind.lower()
    return next((chip for sub, chip in CHIP_OF_DEVICE if sub in kind), None)


def shape_checks(model, cfg, weights: str, chip: str | None, shapes, deadline: float
                 ) -> list[dict]:
    """Each call shape timed here (asynclane_jax.costs.measure, median of 3 after a
    compile) beside its projection on `chip` (asynclane_jax.costs.roofline); a shape is
    skipped once the deadline has passed."""
    from asynclane_jax.costs import call_cost, call_timing
    from asynclane_jax.costs.measure import measure_call
    from asynclane_jax.decoding.stats import CallShape

    out = []
    for kind, rows, queries, keys, logits in shapes:
        shape = CallShape(kind, rows, queries, keys, logits, True, CANVAS)
        row = {"weights": weights, **shape.to_dict()}
        if time.perf_counter() > deadline:
            out.append({**row, "skipped": "time budget spent"})
            continue
        try:
            row["measured_s"] = round(measure_call(model, shape, repeat=3), 5)
        except Exception as e:  # one shape failing must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        if chip is not None:
            t = call_timing(chip, call_cost(cfg, shape, weights))
            row.update(chip=chip, projected_s=round(t.total, 5), bound=t.bound)
            if "measured_s" in row:
                row["measured_over_projected"] = round(row["measured_s"] / t.total, 2)
        log(f"shape {json.dumps(row)}")
        out.append(row)
    return out


def sampler_options(name: str, cfg) -> dict:
    """Each sampler at its defaults, but Fast-dLLM and LocalLeap with the dual cache of
    their published speed; a random model has no tokenizer, so AsyncLane forks at a
    fixed token id instead of the tokenizer's newline tokens."""
    if name == "asynclane":
        return {"delimiters": str(min(198, ordinary_ids(cfg) - 1))}
    if name in ("fast-dllm", "localleap"):
        return {"cache": "dual"}
    return {}


def generation_checks(model, cfg, samplers, gen_length: int, prompt_len: int,
                      deadline: float, keep_tokens: bool = False) -> tuple[dict, list[str]]:
    from asynclane_jax.decoding import generate

    prompt = check_prompt(cfg, prompt_len)
    rows, skipped = {}, []
    for name in samplers:
        if time.perf_counter() > deadline:
            skipped.append(name)
            log(f"{name}: skipped (time budget spent)")
            continue
        opts = sampler_options(name, cfg)
        t0 = time.perf_counter()
        try:
            res = generate(model, [prompt], sampler=name, gen_length=gen_length, **opts)
        except Exception as e:  # one sampler failing must not hide the others
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            log(f"{name}: error {rows[name]['error']}")
            continue
        st = res.stats
        n = int(st.generated_tokens[0])
        rows[name] = {
            "options": opts, "gen_length": gen_length, "generated_tokens": n,
            "decode_s": round(st.decode_time, 3), "compile_s": round(st.compile_time, 1),
            "tokens_per_s": round(n / st.decode_time, 1) if st.decode_time else None,
            "canvas_tokens_per_s": round(gen_length / st.decode_time, 1),
            "model_calls": st.nfe, "full_calls": st.nfe_full, "cached_calls": st.nfe_partial,
            "calls_per_token": round(st.nfe / max(1, n), 3), "steps": st.steps,
            "wall_s": round(time.perf_counter() - t0, 1)}
        log(f"{name}: {json.dumps(rows[name])}")
        if keep_tokens:  # for the int8 comparison; dropped before the report
            rows[name]["tokens"] = res.tokens[0].tolist()
    return rows, skipped


def check_prompt(cfg, prompt_len: int) -> list[int]:
    """The one random prompt every generation of the check decodes."""
    rng = np.random.default_rng(1)
    return rng.integers(0, ordinary_ids(cfg), prompt_len).tolist()


def variant_generation(model, cfg, sampler: str, gen_length: int, prompt_len: int,
                       reference_tokens, agreement_key: str) -> dict:
    """One generation of a variant model with `sampler`: its figures, and under
    `agreement_key` the share of its tokens equal to `reference_tokens` (when given);
    an error is reported, not raised."""
    from asynclane_jax.decoding import generate

    opts = sampler_options(sampler, cfg)
    t0 = time.perf_counter()
    try:
        res = generate(model, [check_prompt(cfg, prompt_len)], sampler=sampler,
                       gen_length=gen_length, **opts)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    st = res.stats
    n = int(st.generated_tokens[0])
    out = {
        "options": opts, "gen_length": gen_length, "generated_tokens": n,
        "decode_s": round(st.decode_time, 3), "compile_s": round(st.compile_time, 1),
        "tokens_per_s": round(n / st.decode_time, 1) if st.decode_time else None,
        "canvas_tokens_per_s": round(gen_length / st.decode_time, 1),
        "model_calls": st.nfe, "wall_s": round(time.perf_counter() - t0, 1)}
    if reference_tokens is not None:
        out[agreement_key] = round(
            float(np.mean(np.asarray(reference_tokens) == res.tokens[0])), 4)
    return out


def scanned_check(preset_name: str, sampler: str, gen_length: int, prompt_len: int,
                  unrolled_tokens) -> dict:
    """Builds the same random model in the scanned layout and runs one generation with
    `sampler`; its tokens are compared with the unrolled run's."""
    t0 = time.perf_counter()
    model, cfg = build_model(preset_name, scan_layers=True)
    out = {"sampler": sampler, "build_s": round(time.perf_counter() - t0, 1)}
    out.update(variant_generation(model, cfg, sampler, gen_length, prompt_len,
                                  unrolled_tokens, "token_agreement_with_unrolled"))
    return out


def int8_check(model, cfg, sampler: str, gen_length: int, prompt_len: int,
               bf16_tokens) -> dict:
    """Quantizes the model's linear layers in place (int8, per-channel scales) and runs
    one generation with `sampler`; its tokens are compared with the bfloat16 run's."""
    from asynclane_jax.models import quantize

    t0 = time.perf_counter()
    quantize.quantize_model(model)
    jax.block_until_ready(nnx.state(model))
    out = {"sampler": sampler, "quantize_s": round(time.perf_counter() - t0, 1),
           "params_gib": round(quantize.weight_bytes(nnx.state(model)) / 2**30, 2)}
    out.update(variant_generation(model, cfg, sampler, gen_length, prompt_len,
                                  bf16_tokens, "token_agreement_with_bf16"))
    return out


def main(argv=None) -> int:
    from asynclane_jax.decoding.registry import samplers as registered

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llada-8b-instruct")
    ap.add_argument("--length", type=int, default=1024, help="tokens of the full forward")
    ap.add_argument("--queries", type=int, default=32, help="queries of the cached call")
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--samplers", default=None, help="comma-separated (default: all that "
                                                     "apply to the preset's family)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="no new sampler starts after this many seconds")
    ap.add_argument("--int8-sampler", default="asynclane",
                    help="the sampler of the int8 generation (default asynclane)")
    ap.add_argument("--int8-reserve-s", type=float, default=60.0,
                    help="seconds of the budget kept for the int8 generation")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 variant")
    ap.add_argument("--no-scanned", action="store_true",
                    help="skip the scanned-layers variant")
    ap.add_argument("--shapes-reserve-s", type=float, default=90.0,
                    help="seconds of the budget kept for the call-shape timings")
    ap.add_argument("--no-shapes", action="store_true",
                    help="skip the call-shape timings against the cost model")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    report = {"preset": args.preset, "backend": jax.default_backend(),
              "device": getattr(dev, "device_kind", str(dev)), "devices": jax.device_count(),
              "jax": jax.__version__, "machine": platform.node()}
    log(f"{report['backend']} {report['device']}: building a random {args.preset} "
        "in bfloat16")
    t0 = time.perf_counter()
    model, cfg = build_model(args.preset)
    report["build_s"] = round(time.perf_counter() - t0, 1)
    report["params_gib"] = round(sum(x.size * x.dtype.itemsize for x in
                                     jax.tree.leaves(nnx.state(model))) / 2**30, 2)
    log(f"built in {report['build_s']} s ({report['params_gib']} GiB)")
    report.update(forward_checks(model, cfg, args.length, args.queries))
    log(f"full forward {report['full_forward']}; cached call {report['cached_call']}")
    chip = chip_of(report["device"])
    shapes_reserve = 0.0 if args.no_shapes else args.shapes_reserve_s
    if not args.no_shapes:
        report["shapes"] = shape_checks(model, cfg, "bf16", chip, CALL_SHAPES,
                                        deadline=t_start + args.budget_s)
        shapes_reserve *= INT8_SHAPES / len(CALL_SHAPES)  # what the int8 pass needs
    if args.samplers:
        samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    else:
        samplers = [s for s in registered() if FAMILY_ONLY.get(s, cfg.family) == cfg.family]
    reserve = (args.int8_reserve_s * ((not args.no_int8) + (not args.no_scanned))
               + (0.0 if args.no_int8 else shapes_reserve))
    report["generation"], report["skipped"] = generation_checks(
        model, cfg, samplers, args.gen_length, args.prompt_length,
        deadline=t_start + args.budget_s - reserve, keep_tokens=True)
    bf16 = report["generation"].get(args.int8_sampler, {}).pop("tokens", None)
    if not args.no_scanned:
        log(f"scanned: building the same model with scanned layers, then {args.int8_sampler}")
        report["scanned"] = scanned_check(args.preset, args.int8_sampler, args.gen_length,
                                          args.prompt_length, bf16)
        log(f"scanned: {json.dumps(report['scanned'])}")
        gc.collect()  # the scanned copy goes before the int8 variant
    if not args.no_int8:
        log(f"int8: quantizing the linear layers, then {args.int8_sampler}")
        report["int8"] = int8_check(model, cfg, args.int8_sampler, args.gen_length,
                                    args.prompt_length, bf16)
        log(f"int8: {json.dumps(report['int8'])}")
        if not args.no_shapes:
            report["shapes"] += shape_checks(model, cfg, "int8", chip,
                                             CALL_SHAPES[:INT8_SHAPES],
                                             deadline=t_start + args.budget_s + 30.0)
    for row in report["generation"].values():
        row.pop("tokens", None)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
