"""The cost formula (asynclane_jax.costs.call_cost) against XLA's own cost analysis of
the same model call compiled ahead of time for a TPU chip with libtpu (no TPU, no
weights: abstract parameters). Results: experiments/results/cost/xla_check.{md,json}.

  python experiments/cost_xla_check.py [--quick] [--out experiments/results/cost]
  python experiments/cost_xla_check.py --from-json   (the page again from its JSON)

For each preset (llada-8b-instruct, dream-7b-instruct), weight format (bf16, int8) and
call shape (a full forward over T=640 with the head at 32 columns, cached calls of 32
and 160 queries against 640 keys; rows 1 and 8), one `DiffusionLM.forward` is
compiled for a v5e chip (and, for a subset, a v6e chip) and `compiled.cost_analysis()`
read ("flops", "bytes accessed").

Layers: the model is compiled unrolled at 1 and at 2 layers, the real widths
otherwise, and the count extrapolated to L layers, c(L) = c(1) + (L - 1) (c(2) - c(1)),
which is exact when the layers compile alike. Two checks back it, on one shape: the
real L compiled unrolled (what the extrapolation stands for), and the real L compiled
as a scan over stacked layers (`scan_layers=True`), whose count holds the scan's body
once, not L times (shown).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import subprocess
import sys
import time

import jax
from flax import nnx

from asynclane_jax import aot
from asynclane_jax.costs import call_cost
from asynclane_jax.costs.measure import call_arrays
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models import abstract_model, preset
from asynclane_jax.models import quantize as quantize_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "cost"
PRESETS = ("llada-8b-instruct", "dream-7b-instruct")
WEIGHTS = ("bf16", "int8")
T = 640


def shapes(rows_list=(1, 8)) -> list[CallShape]:
    out = []
    for rows in rows_list:
        out += [CallShape("full", rows, T, T, 32, True, T),
                CallShape("cached", rows, 32, T, 32, True, T),
                CallShape("cached", rows, 160, T, 160, True, T)]
    return out


def xla_cost(cfg, shape: CallShape, weights: str, device) -> dict:
    """XLA's cost analysis of one forward of `shape`, compiled for `device`."""
    model = abstract_model(cfg)
    if weights == "int8":
        model = quantize_lib.abstract_quantized(model, "int8")
    graphdef, params = nnx.split(model)
    arrays = call_arrays(cfg, shape)
    key_len = arrays.pop("key_len")
    cache = arrays.pop("cache")
    where = jax.sharding.SingleDeviceSharding(device)
    params, cache, arrays = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
        (params, cache, arrays))

    def call(params, cache, a):
        return nnx.merge(graphdef, params).forward(
            a["tokens"], a["positions"], key_mask=a["key_mask"], cache=cache,
            write_index=a["write_index"], logits_index=a["logits_index"], key_len=key_len)

    t0 = time.perf_counter()
    # The cache donated, as the decode's loop carries it (written in place, not copied).
    compiled = jax.jit(call, donate_argnums=(1,)).lower(params, cache, arrays).compile()
    seconds = time.perf_counter() - t0
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return {"flops": float(ca["flops"]), "bytes": float(ca["bytes accessed"]),
            "transcendentals": float(ca.get("transcendentals", 0.0)),
            "compile_s": round(seconds, 1)}


def formula(cfg, shape, weights) -> dict:
    c = call_cost(cfg, shape, weights)
    sunk = call_cost(cfg, shape, weights, last_layer="logits")
    return {"flops": c.flops, "flops_last_logits": sunk.flops, "bytes": c.bytes,
            "weight_bytes": c.weight_bytes,
            "kv_bytes": c.bytes_kv_read + c.bytes_kv_write,
            "activation_bytes": c.bytes_act_sharded + c.bytes_act_full,
            "logits_bytes": c.bytes_logits}


def one_row(name: str, topology: str, device, shape: CallShape, weights: str) -> dict:
    cfg = preset(name)
    L = cfg.n_layers
    x1 = xla_cost(cfg.replace(n_layers=1), shape, weights, device)
    x2 = xla_cost(cfg.replace(n_layers=2), shape, weights, device)
    f1, f2 = formula(cfg.replace(n_layers=1), shape, weights), formula(
        cfg.replace(n_layers=2), shape, weights)
    xla = {k: x1[k] + (L - 1) * (x2[k] - x1[k]) for k in ("flops", "bytes",
                                                          "transcendentals")}
    row = {"preset": name, "topology": topology, "weights": weights,
           "shape": shape.to_dict(), "layers": L, "xla": xla,
           "formula": formula(cfg, shape, weights),
           # One layer's and the rest's share, each side (c(2) - c(1) and 2 c(1) - c(2)).
           "xla_layer": {k: x2[k] - x1[k] for k in ("flops", "bytes")},
           "xla_outside": {k: 2 * x1[k] - x2[k] for k in ("flops", "bytes")},
           "formula_layer": {k: f2[k] - f1[k] for k in ("flops", "bytes")},
           "formula_outside": {k: 2 * f1[k] - f2[k] for k in ("flops", "bytes")},
           "compile_s": [x1["compile_s"], x2["compile_s"]]}
    row["ratio"] = {k: row["xla"][k] / row["formula"][k] for k in ("flops", "bytes")}
    row["ratio"]["flops_last_logits"] = row["xla"]["flops"] / row["formula"][
        "flops_last_logits"]
    return row


def layer_checks(name: str, topology: str, device, shape: CallShape) -> dict:
    """The real L compiled unrolled and scanned, against the 1-/2-layer extrapolation."""
    cfg = preset(name)
    direct = xla_cost(cfg, shape, "bf16", device)
    scanned = xla_cost(dataclasses.replace(cfg, scan_layers=True), shape, "bf16", device)
    return {"preset": name, "topology": topology, "shape": shape.to_dict(),
            "unrolled": direct, "scanned": scanned}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _fmt(x: float) -> str:
    return f"{x:.3e}"


def _shape_text(s: dict) -> str:
    return f"{s['kind']} r{s['rows']} q{s['queries']} k{s['keys']} n{s['logits']}"


def markdown(result: dict) -> str:
    rows = result["rows"]
    meta = result["meta"]
    lines = ["# The cost formula against XLA's cost analysis (TPU, ahead of time)", "",
             f"Made by `{meta['command']}` at commit {meta['commit']} (jax "
             f"{meta['jax']}, libtpu {meta['libtpu']}), on this project's CPU machine: "
             "each call compiled for the chip with libtpu, no TPU, no weights."
             + (f" The page and its findings were written again from the JSON at commit "
                f"{meta['page_written_at']} (`--from-json`)." if meta.get("page_written_at")
                else ""), "",
             "`formula` is `asynclane_jax.costs.call_cost`; `XLA` is "
             "`compiled.cost_analysis()` of the same `DiffusionLM.forward` (the cache "
             "donated, as the decode carries it), compiled at 1 and 2 layers and "
             "extrapolated to L (see the script's docstring and the layer check below). "
             "Shapes: kind, rows, queries, keys, logits columns; canvas 640.", "",
             "The second FLOPs ratio is against `call_cost(..., last_layer=\"logits\")`, "
             "the program whose last layer runs past its q / k / v projections at the "
             "logits columns only (the two are equal where every query's logits are "
             "read).", "",
             "| preset | chip | weights | shape | FLOPs formula | FLOPs XLA | XLA / formula "
             "| XLA / formula, last layer at the logits "
             "| bytes formula | bytes XLA | XLA / formula | per layer: bytes XLA / formula |",
             "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['topology']} | {r['weights']} | {_shape_text(r['shape'])} "
            f"| {_fmt(r['formula']['flops'])} | {_fmt(r['xla']['flops'])} "
            f"| {r['ratio']['flops']:.4f} | {r['ratio']['flops_last_logits']:.4f} "
            f"| {_fmt(r['formula']['bytes'])} "
            f"| {_fmt(r['xla']['bytes'])} | {r['ratio']['bytes']:.2f} "
            f"| {r['xla_layer']['bytes'] / r['formula_layer']['bytes']:.2f} |")
    lines += ["", "## The layer check", "",
              "One shape compiled with every layer, unrolled and as a scan over stacked "
              "layers, against the 1-/2-layer extrapolation of the same call:", "",
              "| preset | chip | shape | count | extrapolated | unrolled, L layers "
              "| scanned, L layers | compile s (unrolled / scanned) |",
              "|---|---|---|---|--:|--:|--:|--:|"]
    for c in result["layer_checks"]:
        match = next(r for r in rows if r["preset"] == c["preset"] and r["topology"]
                     == c["topology"] and r["weights"] == "bf16" and r["shape"] == c["shape"])
        for k in ("flops", "bytes"):
            lines.append(f"| {c['preset']} | {c['topology']} | {_shape_text(c['shape'])} "
                         f"| {k} | {_fmt(match['xla'][k])} | {_fmt(c['unrolled'][k])} "
                         f"| {_fmt(c['scanned'][k])} | {c['unrolled']['compile_s']} / "
                         f"{c['scanned']['compile_s']} |")
    lines += ["", "## Where they differ and why", "", findings(result), ""]
    return "\n".join(lines)


def findings(result: dict) -> str:
    rows = result["rows"]
    fl = [r["ratio"]["flops"] for r in rows]
    by = [r["ratio"]["bytes"] for r in rows]
    lay = [r["xla_layer"]["bytes"] / r["formula_layer"]["bytes"] for r in rows]
    bf = [r["ratio"]["flops"] for r in rows if r["weights"] == "bf16"] or [float("nan")]
    i8 = [r["ratio"]["flops"] for r in rows if r["weights"] == "int8"] or [float("nan")]
    narrow = [r for r in rows if r["shape"]["logits"] < r["shape"]["queries"]]
    last_text = ""
    if narrow:
        off_all = max(abs(r["ratio"]["flops"] - 1) for r in narrow)
        off_sunk = max(abs(r["ratio"]["flops_last_logits"] - 1) for r in narrow)
        which = ("every query (`last_layer=\"all\"`, the default)" if off_all <= off_sunk
                 else "the logits columns only (`last_layer=\"logits\"`)")
        last_text = (
            " In the calls that read fewer logits columns than they query, XLA's count "
            f"matches the last layer's attention, o and MLP run at {which}: within "
            f"{min(off_all, off_sunk):.4f} of it, {max(off_all, off_sunk):.4f} from the "
            "other. Whether XLA moves the logits gather above the last layer depends on "
            "the attention's implementation, hence the option.")
    checks = result["layer_checks"]
    scan_text = ""
    if checks:
        c = checks[0]
        match = next(r for r in rows if r["preset"] == c["preset"] and r["topology"]
                     == c["topology"] and r["weights"] == "bf16" and r["shape"] == c["shape"])
        fl_ratio = c["unrolled"]["flops"] / match["xla"]["flops"]
        by_ratio = c["unrolled"]["bytes"] / match["xla"]["bytes"]
        scan_text = (
            " The layer check (LLaDA, one row, 32 queries, bf16): the real program "
            f"compiled unrolled counts {fl_ratio:.4f} of the extrapolated FLOPs, so "
            "the extrapolation stands for it there; its bytes are "
            f"{by_ratio:.2f} of the extrapolated bytes: the compiler does not lay "
            "out the whole program as 31 copies of the second layer (its prefetches "
            "and copies differ), so the bytes columns above understate XLA's count for "
            "the whole program, by that factor in this case. The "
            "scanned program counts "
            f"{c['scanned']['flops'] / match['xla']['flops']:.3f} of the extrapolated "
            "FLOPs: the scan's body once, not L times, so a scanned program's cost "
            "analysis must be multiplied by hand; the script compiles the layers "
            "unrolled at 1 and 2 layers instead, far faster than L unrolled layers "
            "(compile times in the table).")
    i8_bytes = []  # XLA's bytes with int8 weights over its bytes with bf16 ones
    for r in rows:
        if r["weights"] == "int8":
            twin = next((b for b in rows if b["weights"] == "bf16" and b["preset"]
                         == r["preset"] and b["topology"] == r["topology"]
                         and b["shape"] == r["shape"]), None)
            if twin:
                i8_bytes.append(r["xla"]["bytes"] / twin["xla"]["bytes"])
    i8_text = ""
    if i8_bytes:
        i8_text = (
            f" XLA's count with int8 weights is {min(i8_bytes):.2f} to "
            f"{max(i8_bytes):.2f} of its count with bf16 ones, where the formula's "
            "is about half for the calls the weights dominate: the int8 kernels are "
            "read as int8 (no bfloat16 copy of a kernel appears in the int8 program "
            "read), but the compiler brings each into on-chip "
            "memory in slices (slice-start / slice-done, then a custom call joining "
            "them), and each of those steps is counted again.")
    return (
        f"FLOPs: XLA / formula lies between {min(fl):.4f} and {max(fl):.4f} "
        f"(bf16 weights {min(bf):.4f} to {max(bf):.4f}, int8 {min(i8):.4f} to "
        f"{max(i8):.4f}). The formula counts the matmuls only; XLA also counts the "
        "elementwise work (RMSNorm, RoPE, the softmax, SiLU, the residual adds). With "
        "int8 weights it also counts a few operations per weight element (the int8 "
        "values converted for the matmul inside its fusion): a fixed count per "
        "weight, so its share falls as the rows x queries a kernel multiplies grow, "
        "and is largest for the batch-1 call of 32 queries. The roofline prices "
        "that conversion as free (it runs on the vector unit beside the matmul)."
        + last_text +
        f" Bytes: XLA / formula lies between {min(by):.2f} and {max(by):.2f} (per "
        f"layer, c(2) - c(1), {min(lay):.2f} to {max(lay):.2f}; the rest, 2 c(1) - "
        "c(2), is kept in the JSON only: it mixes the compiler's different choices "
        "for the 1- and 2-layer programs and comes out negative in places). XLA's "
        "`bytes accessed` is the sum, over the compiled "
        "program's instructions, of each one's operands and outputs, not the HBM "
        "traffic the roofline wants. Reading three compiled one-layer programs "
        "instruction by instruction (LLaDA's cached call at 1 row in bf16 and int8, "
        "its full forward at 8 rows in bf16) shows where the excess comes from. The "
        "compiler prefetches weights into on-chip memory (copy-start / copy-done of "
        "the MLP's bf16 kernels), and each prefetch counts the kernel's bytes again "
        "as its operand and its output. XLA's attention writes its float32 scores "
        "and softmax ([rows, heads, queries, keys]) to memory and reads them back, "
        "where the formula assumes a fused attention that keeps them on chip: real "
        "traffic, which grows with rows x queries x keys (the full forwards at 8 rows "
        "have the largest ratios). RoPE and the norms run in float32, with float32 "
        "copies of q and k." + i8_text + scan_text + " What this check cannot say: "
        "how close the compiled kernels come to the chip's peaks; the roofline "
        "assumes they reach them.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--commit", default=None,
                    help="the commit the code was taken from, when it runs outside the "
                         "repository (default: git rev-parse HEAD)")
    ap.add_argument("--from-json", action="store_true",
                    help="rewrite xla_check.md (and the findings) from xla_check.json in "
                         "--out, compiling nothing")
    ap.add_argument("--quick", action="store_true",
                    help="one preset, one weight format, rows 1 only, v5e only, no layer "
                         "check (a smoke run; does not write the results)")
    args = ap.parse_args(argv)
    import importlib.metadata as md

    out = pathlib.Path(args.out)
    if args.from_json:
        result = json.loads((out / "xla_check.json").read_text())
        result["findings"] = findings(result)
        result["meta"]["page_written_at"] = args.commit or _commit()
        (out / "xla_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "xla_check.md").write_text(markdown(result))
        print(f"rewrote {out / 'xla_check.md'} from {out / 'xla_check.json'}")
        return 0
    plan = []  # (preset, topology, shape, weights)
    if args.quick:
        plan = [("llada-8b-instruct", "v5e:1x1", s, "bf16") for s in shapes((1,))]
    else:
        for name in PRESETS:
            for weights in WEIGHTS:
                plan += [(name, "v5e:1x1", s, weights) for s in shapes()]
        # v6e: the same program for another chip generation, at rows 8.
        plan += [("llada-8b-instruct", "v6e:1x1", s, w) for w in WEIGHTS
                 for s in shapes((8,))]
    devices = {}
    rows = []
    for i, (name, topology, shape, weights) in enumerate(plan):
        if topology not in devices:
            devices[topology] = aot.tpu_slice(topology).devices[0]
        row = one_row(name, topology, devices[topology], shape, weights)
        rows.append(row)
        print(f"[{i + 1}/{len(plan)}] {name} {topology} {weights} "
              f"{_shape_text(row['shape'])}: flops x{row['ratio']['flops']:.4f} "
              f"bytes x{row['ratio']['bytes']:.2f} (compile {row['compile_s']} s)",
              flush=True)
    checks = []
    if not args.quick:
        shape = CallShape("cached", 1, 32, T, 32, True, T)
        checks.append(layer_checks("llada-8b-instruct", "v5e:1x1", devices["v5e:1x1"],
                                   shape))
        print("layer check:", json.dumps(checks[-1]), flush=True)
    result = {"meta": {"command": "python experiments/cost_xla_check.py"
                                  + "".join(" " + shlex.quote(a) for a in (argv or [])),
                       "commit": args.commit or _commit(), "jax": jax.__version__,
                       "libtpu": md.version("libtpu") if aot.tpu_compiler_available()
                       else None},
              "rows": rows, "layer_checks": checks}
    result["findings"] = findings(result)
    if args.quick:
        print(result["findings"])
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "xla_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "xla_check.md").write_text(markdown(result))
    print(f"wrote {out / 'xla_check.md'} and {out / 'xla_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
