"""Peak host memory of converting and loading at the real widths and vocabularies.

Builds two 2-layer bfloat16 safetensors snapshots at the widths and vocabularies of
LLaDA-8B (d_model 4096, MLP 12,288, vocabulary 126,464) and Dream-v0-7B (hidden 3584,
MLP 18,944, 28 query / 4 key-value heads, vocabulary 152,064): about 1.5 billion
parameters each, most of them in the embedding and the untied output head, so the
largest tensors are the real models' largest tensors. The snapshots are random weights
written a block at a time (`convert_memory.write_snapshot`), so the writer never holds
a model.

Every measurement runs in a fresh subprocess and reports its peak resident set size
(`ru_maxrss`) and its baseline (RSS after importing JAX, orbax and the package and
starting the backend, before any work):

  convert    checkpoints_convert.convert, LLaDA and Dream, bfloat16 and float32 output;
  load       asynclane_jax.load without a mesh (and with dtype="float32" from a bf16
             folder);
  load+mesh  asynclane_jax.load(path, mesh=...) on 8 fake CPU devices
             (XLA_FLAGS=--xla_force_host_platform_device_count=8, set before JAX
             starts), meshes "tensor=8" and "data=2,tensor=4". On one host every fake
             device lives in this process, so its RSS holds all the devices' shards;
             the child reports the bytes of all shards and of the largest device's.
             Code without `load(mesh=)` loads whole and places with
             `sharding.shard_model` (what `generate(mesh=)` did before).

`--code DIR` runs the children against another source tree (e.g. `git archive HEAD`
unpacked in /tmp) to measure "before"; results are stored per `--label` in
experiments/results/checkpoint/load_memory.json and load_memory.md shows every label.

`--compare-restore DIR` instead loads the shipped tiny model and a ~130 MB converted
folder with the tree at DIR and with this tree, alternately, in several cases (dtype
override, digests off, int8, the other layer layout, a mesh), and writes
experiments/results/checkpoint/load_restore.md (+ .json).

Usage:
  python experiments/load_memory.py --label after
  python experiments/load_memory.py --compare-restore /tmp/before
  git archive HEAD | tar -x -C /tmp/head && \\
      python experiments/load_memory.py --label before --code /tmp/head
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import convert_memory as cm  # noqa: E402

REPO = HERE.parent
RESULTS_JSON = HERE / "results" / "checkpoint" / "load_memory.json"
RESULTS_MD = HERE / "results" / "checkpoint" / "load_memory.md"
LAYERS = 2
MESHES = ("tensor=8", "data=2,tensor=4")
EIGHT = "--xla_force_host_platform_device_count=8"

CHILD = textwrap.dedent("""
    import inspect, json, resource, sys, time
    import jax, numpy as np, orbax.checkpoint, tqdm  # the baseline: what the work imports
    import asynclane_jax
    from flax import nnx
    from asynclane_jax import checkpoint, sharding
    from checkpoints_convert import convert
    jax.devices()

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    mode, src, dst, dtype, mesh = sys.argv[1:6]
    dtype = None if dtype == "-" else dtype
    mesh = None if mesh == "-" else mesh
    opts = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}  # verify=, quantize=
    out = {"baseline_mb": rss_mb()}
    t0 = time.time()
    if mode == "convert":
        r = convert.convert(src, dst, dtype=dtype, progress=False)
        out.update(output_bytes=r.output_bytes, params=r.n_params, tensors=r.n_tensors)
    else:
        if mesh is not None and "mesh" not in inspect.signature(checkpoint.load).parameters:
            model, _, cfg = checkpoint.load(src, dtype=dtype)
            sharding.shard_model(model, sharding.plan_for(cfg, mesh))
            out["how"] = "load, then sharding.shard_model"
        elif mesh is not None:
            model, _, cfg = checkpoint.load(src, dtype=dtype, mesh=mesh, **opts)
            out["how"] = "load(mesh=)"
        else:
            model, _, cfg = checkpoint.load(src, dtype=dtype, mesh=mesh, **opts)
            out["how"] = "load"
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        jax.block_until_ready(leaves)
        per_device = {}
        for a in leaves:
            for s in a.addressable_shards:
                per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
        out.update(model_bytes=sum(a.nbytes for a in leaves),
                   largest_tensor_bytes=max(a.nbytes for a in leaves),
                   devices=len(per_device), all_shards_bytes=sum(per_device.values()),
                   largest_device_bytes=max(per_device.values()))
    out["seconds"] = time.time() - t0
    out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
""")


def run_child(code: pathlib.Path, mode: str, src, dst, dtype, mesh,
              opts: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if mesh is not None:
        env["XLA_FLAGS"] = EIGHT
    argv = [sys.executable, "-c", CHILD, mode, str(src), str(dst), dtype or "-", mesh or "-",
            json.dumps(opts or {})]
    proc = subprocess.run(argv, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{mode} {src} dtype={dtype} mesh={mesh} failed:\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def largest_source_tensor(cfg: dict) -> int:
    return max(math.prod(s) for s in cm.tensor_shapes(cfg).values())


def measure(code: pathlib.Path, work: pathlib.Path, families, only: set | None) -> list:
    rows = []

    def want(kind):
        return only is None or kind in only

    for family in families:
        cfg = cm.llada_config(LAYERS, d_model=4096, n_heads=32, mlp_hidden_size=12288) \
            if family == "llada" else cm.dream_config(LAYERS)
        src = work / f"{family}-src"
        print(f"[{family}] writing the snapshot to {src} ...", flush=True)
        t0 = time.time()
        src_bytes = cm.write_snapshot(src, cfg)
        print(f"  {src_bytes / 2**30:.2f} GiB in {time.time() - t0:.0f} s", flush=True)
        largest = largest_source_tensor(cfg)
        bf16 = work / f"{family}-bfloat16"
        for dtype in ("bfloat16", "float32"):
            dst = work / f"{family}-{dtype}"
            if not want("convert") and dtype == "float32":
                continue
            print(f"[{family}] convert -> {dtype} ...", flush=True)
            r = run_child(code, "convert", src, dst, dtype, None)
            r.update(kind="convert", family=family, dtype=dtype, mesh=None,
                     largest_tensor_bytes=largest * (2 if dtype == "bfloat16" else 4))
            if want("convert"):
                rows.append(r)
                print("  ", json.dumps(r), flush=True)
            if dtype == "float32":
                shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        loads = [(None, None), (None, "float32")] if family == "llada" else [(None, None)]
        loads += [(m, None) for m in MESHES]
        for mesh, dtype in loads:
            kind = "load" if mesh is None else "load+mesh"
            if not want(kind):
                continue
            print(f"[{family}] {kind} mesh={mesh} dtype={dtype} ...", flush=True)
            r = run_child(code, "load", bf16, "-", dtype, mesh)
            r.update(kind=kind, family=family, dtype=dtype or "bfloat16", mesh=mesh,
                     stored_dtype="bfloat16")
            rows.append(r)
            print("  ", json.dumps(r), flush=True)
        shutil.rmtree(bf16, ignore_errors=True)
    return rows


READING = """## Reading

**Before.** Loading without a mesh peaked at 2.0x the model above the baseline: orbax's
restore (`StandardCheckpointer` with unsharded targets) read every array at once into
host numpy buffers, beside tensorstore's own read buffers, and the post-restore
`jnp.asarray` made the device copies. Loading onto a mesh went through a whole
single-device model and then `device_put` to the shardings: the model plus every
device's shards. Converting held the output plus the source tensor being transposed
(+1.0 largest tensor for bf16 output), and in float32 orbax split Dream's 2.03 GiB head
(over its 2 GiB OCDBT target file size) into column chunks, which tensorstore fills by
copying the whole array first: +1.0 (float32) largest tensor.

**After.**

* Without a mesh (the one-device reader of the old `checkpoint.py`, since replaced:
  results/checkpoint/load_restore.md): one array at a time, tensorstore
  reads (and casts, for a dtype override) straight into a 64-byte-aligned host buffer
  that `jax.device_put` adopts without copying on the CPU backend (one copy to the
  device elsewhere); the buffer is dropped before the next array. Peak: the model plus
  tensorstore's read buffer of one stored array: +1.0 largest tensor in bf16, +0.5 when
  a bf16 folder is loaded as float32 (the buffer is the bf16 one). Also 2-4x faster.
* With a mesh (`checkpoint.restore_params`): orbax restores into the plan's
  NamedShardings (`ShardingPlan.param_shardings`), reading per device only its shard,
  with the restore's byte limiter sized from the checkpoint's metadata to the largest
  array, so one array is in flight at a time (by default orbax reads them all at
  once). Peak: every device's shards plus 1.1-1.3 largest tensors: tensorstore reads
  an array's whole chunk to cut any shard out of it (each array is one chunk), plus
  the shard buffer. On one host with fake devices every shard of every device is in
  this process; a real host holds its own devices' shards in device memory, and its
  host memory holds about one array in flight. The largest device holds 351-778 MiB of
  the 2.8-3.0 GiB models. The orbax byte limit alone, without the mesh, left the
  unsharded load at 1.7-1.9x (row *tried* below): orbax keeps its numpy buffer, the
  tensorstore buffer and the device copy of the array in flight alive together.
* Converting: each safetensors tensor is read 64 MiB of rows at a time straight into
  its transposed output (`convert.read_output`), and `save_params` writes every array
  as one chunk (`ocdbt_target_data_file_size=0`), so the write never copies: 1.02-1.05x
  the output, +0.07-0.15 largest tensor (the block and fixed overhead), in bf16 and
  float32, LLaDA and Dream. A LoRA-merged tensor or a `.bin` source is still converted
  whole (+1 tensor).
"""


def _key(r):
    return r["kind"], r["family"], r["dtype"], r["mesh"]


def _order(r):
    return (("convert", "load", "load+mesh").index(r["kind"]), r["family"] != "llada",
            r["dtype"] != "bfloat16", r["mesh"] or "")


def _mib(b):
    return f"{b / 2**20:,.0f}"


def table(rows: list) -> list[str]:
    lines = ["| what | family | dtype | mesh | baseline MiB | peak MiB | peak - baseline "
             "MiB | size MiB | largest tensor MiB | (peak - baseline) / size | excess over "
             "size, in largest tensors | largest device's shards MiB | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "convert":
            size = r["output_bytes"]
        else:  # what the devices hold: the model, or every device's shards together
            size = r["all_shards_bytes"]
        extra = r["peak_mb"] - r["baseline_mb"]
        excess = (extra - size / 2**20) / (r["largest_tensor_bytes"] / 2**20)
        dev = _mib(r["largest_device_bytes"]) if r.get("devices", 1) > 1 else ""
        lines.append(
            f"| {r['kind']} | {r['family']} | {r['dtype']} | {r['mesh'] or ''} | "
            f"{r['baseline_mb']:,.0f} | {r['peak_mb']:,.0f} | {extra:,.0f} | {_mib(size)} | "
            f"{_mib(r['largest_tensor_bytes'])} | {extra / (size / 2**20):.2f} | "
            f"{excess:+.2f} | {dev} | {r['seconds']:.1f} |")
    return lines


def write_report(results: dict) -> None:
    lines = [
        "# Peak host memory of converting and loading (real widths, 2 layers)",
        "",
        f"Generated by `python experiments/load_memory.py`; {platform.machine()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, CPU backend.",
        "",
        "Two 2-layer snapshots at the real widths and vocabularies (LLaDA-8B: d_model "
        "4096, MLP 12,288, vocabulary 126,464; Dream-v0-7B: hidden 3584, MLP 18,944, "
        "vocabulary 152,064, untied heads) of random bfloat16 weights in 400 MiB "
        "safetensors shards: about 1.5 billion parameters each, the largest tensors being "
        "the real models' embedding and output head (LLaDA 988 MiB, Dream 1,039 MiB in "
        "bfloat16). Each row is one fresh process: baseline is its RSS after the imports "
        "and backend start, peak its `ru_maxrss`.",
        "",
        "*size* is what the work must hold in the end: for convert, the output parameters; "
        "for load, the parameters on the devices, all devices together (with a mesh on one "
        "host every fake device is in this process, so a replicated parameter counts once "
        "per device holding it). The target is peak - baseline <= 1.1 x size + one "
        "largest tensor, i.e. the *excess over size, in largest tensors* column at most "
        "about 1 (+0.1 x size). *largest device's shards* is what one device (one "
        "accelerator's memory, on a real mesh) holds.",
        "",
    ]
    for label in sorted(results, key=lambda k: (k != "before", k)):
        entry = results[label]
        lines += [f"## {label}", "", f"Code: {entry['code']}. Commands:", "",
                  *(f"    {c}" for c in entry["commands"]), "", *table(entry["rows"]), ""]
    lines += [READING]
    RESULTS_MD.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- old vs new restore

RESTORE_JSON = HERE / "results" / "checkpoint" / "load_restore.json"
RESTORE_MD = HERE / "results" / "checkpoint" / "load_restore.md"
# A LLaDA-shaped bfloat16 model of about 130 MB: 4 layers, d_model 256, LLaDA's vocabulary.
SMALL = dict(layers=4, d_model=256, n_heads=4, mlp_hidden_size=1024, vocab=126464)
# (label, options for load): each is loaded by both trees.
RESTORE_CASES = (("as stored", None, None, {}), ("dtype float32", "float32", None, {}),
                 ("verify off", None, None, {"verify": False}),
                 ("quantize int8", None, None, {"quantize": "int8"}),
                 ("scan_layers flipped", None, None, {"scan_layers": "flip"}),
                 ("mesh tensor=8", None, "tensor=8", {}))


def _git(code: pathlib.Path, *argv) -> str:
    return subprocess.run(["git", "-C", str(code), *argv], capture_output=True,
                          text=True).stdout.strip()


def compare_restore(before: pathlib.Path, work: pathlib.Path, repeats: int) -> dict:
    """Loads the tiny shipped model and a ~130 MB converted folder with the tree at
    `before` and this tree, alternately, `repeats` times each; medians per case."""
    cfg = cm.llada_config(SMALL["layers"], d_model=SMALL["d_model"], n_heads=SMALL["n_heads"],
                          mlp_hidden_size=SMALL["mlp_hidden_size"], vocab=SMALL["vocab"])
    src, small = work / "small-src", work / "small-bfloat16"
    cm.write_snapshot(src, cfg)
    run_child(REPO, "convert", src, small, "bfloat16", None)
    shutil.rmtree(src, ignore_errors=True)
    stored_scan = json.loads((small / "config.json").read_text())["model"].get("scan_layers")
    rows = []
    for model, folder in (("tiny-llada", "tiny-llada"), ("small-130MB", small)):
        for label, dtype, mesh, opts in RESTORE_CASES:
            opts = dict(opts)
            if opts.get("scan_layers") == "flip":
                scan = stored_scan if model == "small-130MB" else json.loads(
                    (REPO / "asynclane_jax/testbed/models/tiny-llada/config.json").read_text()
                )["model"].get("scan_layers")
                opts["scan_layers"] = not scan
            runs = {"before": [], "after": []}
            for _ in range(repeats):
                for which, code in (("before", before), ("after", REPO)):
                    runs[which].append(run_child(code, "load", folder, "-", dtype, mesh, opts))
            row = {"model": model, "case": label, "dtype": dtype, "mesh": mesh, "options": opts,
                   "model_bytes": runs["after"][0]["model_bytes"],
                   "largest_tensor_bytes": runs["after"][0]["largest_tensor_bytes"]}
            for which, rs in runs.items():
                row[which] = {"peak_minus_baseline_mb": statistics.median(
                                  [r["peak_mb"] - r["baseline_mb"] for r in rs]),
                              "seconds": statistics.median([r["seconds"] for r in rs]),
                              "runs": rs}
            rows.append(row)
            print(model, label, {w: (round(row[w]["peak_minus_baseline_mb"], 1),
                                     round(row[w]["seconds"], 2)) for w in runs}, flush=True)
    return {"before": {"code": str(before), "commit": _git(before, "rev-parse", "HEAD")},
            "after": {"code": "this tree", "commit": _git(REPO, "rev-parse", "HEAD"),
                      "dirty": bool(_git(REPO, "status", "--porcelain", "--",
                                         "asynclane_jax"))},
            "repeats": repeats, "command": "python experiments/load_memory.py "
            + shlex.join(sys.argv[1:]), "rows": rows}


def write_restore_report(result: dict) -> None:
    lines = [
        "# Loading: the hand-built tensorstore reader (before) against orbax's public "
        "partial restore (after)", "",
        f"Generated by `{result['command']}`; {platform.machine()}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, CPU backend.", "",
        f"* before: `{result['before']['code']}` at commit {result['before']['commit']} "
        "(`checkpoint._restore_one_device` / `_ArrayReader` on one device, orbax's "
        "restore on a mesh)",
        f"* after: this tree at commit {result['after']['commit']}"
        + (" (with uncommitted changes under asynclane_jax/)" if result["after"]["dirty"]
           else "") + " (`checkpoint.restore.restore_stored`, then "
        "`checkpoint.transform`)", "",
        f"Each cell is the median of {result['repeats']} fresh processes, run alternately "
        "(before, after, before, ...): peak RSS (`ru_maxrss`) minus the RSS after imports "
        "and backend start, and the seconds `asynclane_jax.load` took. tiny-llada is the "
        "shipped model; small-130MB is a 4-layer LLaDA-shaped bfloat16 folder (d_model "
        "256, vocabulary 126,464: most of it the embedding and the output head) "
        "converted by `checkpoints_convert`. Digests are checked "
        "(the default) unless the case says *verify off*; *mesh* runs on 8 fake CPU "
        "devices.", "",
        "| model | case | model MiB | largest tensor MiB | before: peak - baseline MiB | "
        "after: peak - baseline MiB | before s | after s |",
        "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['model']} | {r['case']} | {_mib(r['model_bytes'])} | "
                     f"{r['largest_tensor_bytes'] / 2**20:,.1f} | "
                     f"{b['peak_minus_baseline_mb']:,.1f} | {a['peak_minus_baseline_mb']:,.1f} | "
                     f"{b['seconds']:.2f} | {a['seconds']:.2f} |")
    RESTORE_MD.parent.mkdir(parents=True, exist_ok=True)
    RESTORE_MD.write_text("\n".join(lines) + "\n")
    RESTORE_JSON.write_text(json.dumps(result, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--code", default=str(REPO), help="source tree the children import")
    ap.add_argument("--workdir", default=None, help="for the big files (default: in /tmp)")
    ap.add_argument("--families", default="llada,dream")
    ap.add_argument("--only", default=None,
                    help="comma-separated subset of convert,load,load+mesh")
    ap.add_argument("--code-note", default=None, help="what --code is, for the report")
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--compare-restore", default=None, metavar="DIR",
                    help="instead: load the tiny model and a ~130 MB folder with the tree "
                         "at DIR and this tree alternately; writes "
                         "results/checkpoint/load_restore.md")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.compare_restore:
        work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="load_restore-", dir="/tmp"))
        try:
            result = compare_restore(pathlib.Path(args.compare_restore).resolve(), work,
                                     args.repeats)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not args.no_save:
            write_restore_report(result)
        return 0
    code = pathlib.Path(args.code).resolve()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="load_memory-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = measure(code, work, args.families.split(","),
                       set(args.only.split(",")) if args.only else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(table(rows)))
    if args.no_save:
        return 0
    results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.is_file() else {}
    entry = results.setdefault(args.label, {"rows": [], "commands": []})
    entry["code"] = args.code_note or ("this tree" if code == REPO else str(code))
    command = "python experiments/load_memory.py " + shlex.join(sys.argv[1:])
    entry["commands"] = [c for c in entry["commands"] if c != command] + [command]
    new = {_key(r) for r in rows}  # a rerun replaces its own rows, keeps the others
    entry["rows"] = sorted([r for r in entry["rows"] if _key(r) not in new] + rows,
                           key=_order)
    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_JSON.write_text(json.dumps(results, indent=1) + "\n")
    write_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
