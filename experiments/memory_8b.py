"""Per-chip memory of the 8B decodes on TPU slices, from `asynclane-jax aot` (no TPU, no
weights; needs the tpu extra), and the head-placement comparison behind
asynclane_jax.sharding's "whole heads" rule. Results: experiments/results/compile/memory-8b.md.

  python experiments/memory_8b.py rows  --out rows.jsonl [--only v5e] [--limit N]
      runs `asynclane-jax aot ... --json` for each row of ROWS (most important first)
      not yet in the file, one at a time, appending {"command": ..., **report};
  python experiments/memory_8b.py heads --out heads.jsonl
      Dream-7B's width at 2 layers on v5e:2x4: heads whole / split on tensor=8, and a
      4-way tensor axis (data=2,tensor=4); collectives and per-chip memory;
  python experiments/memory_8b.py layers --out layers.jsonl [--limit N]
      the layer layouts side by side: each case of LAYOUT_CASES compiled unrolled (as
      `rows`, no flag) and then with --scan-layers, interleaved, so both see the same
      machine load; one JSON line each, as `rows`;
  python experiments/memory_8b.py layers-table --rows layers.jsonl
      the markdown table of the layout comparison (scanned / unrolled ratios);
  python experiments/memory_8b.py table --rows rows.jsonl --heads heads.jsonl
      markdown tables for the results page, and experiments/results/compile/memory-8b.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results" / "compile"
GIB = 2 ** 30
SAMPLERS = {"asynclane": [], "fast-dllm": ["cache=dual"]}
MODELS = ("llada-8b-instruct", "dream-7b-instruct")


def _rows() -> list[dict]:
    rows = []
    # The slice the issue sizes for: v5e-8, every chip on the tensor axis.
    for batch in (8, 1):
        for model in MODELS:
            for sampler in SAMPLERS:
                rows.append(dict(topology="v5e:2x4", mesh="data=1,tensor=8", model=model,
                                 sampler=sampler, batch=batch))
    # Dream's 28 query heads on a 4-way tensor axis: split whole, no replicated attention.
    rows.append(dict(topology="v5e:2x4", mesh="data=2,tensor=4", model="dream-7b-instruct",
                     sampler="asynclane", batch=8))
    for model in MODELS:  # one v6e chip holds the whole model
        for sampler in SAMPLERS:
            rows.append(dict(topology="v6e:1x1", mesh="tensor", model=model,
                             sampler=sampler, batch=1))
    # v5p-8: four chips (megacore), 95 GiB each. (v4:2x2x1 was tried first: its compile
    # of the 32-layer LLaDA grew past 22 GiB of host memory, more than this machine had.)
    for sampler in SAMPLERS:
        for model in MODELS:
            rows.append(dict(topology="v5p:2x2x1", mesh="data=1,tensor=4", model=model,
                             sampler=sampler, batch=8))
    return rows


ROWS = _rows()


# The layout comparison (`layers`), most important first: each case compiled unrolled
# and scanned, one after the other ("layouts": (True,) compiles only the scanned one,
# for cases whose unrolled sizes are already in the `rows` results).
LAYOUT_CASES = (
    dict(topology="v5e:2x4", mesh="data=1,tensor=8", model="llada-8b-instruct",
         sampler="asynclane", batch=8),
    dict(topology="v5e:2x4", mesh="data=1,tensor=8", model="llada-8b-instruct",
         sampler="fast-dllm", batch=8),
    dict(topology="v6e:1x1", mesh="tensor", model="llada-8b-instruct",
         sampler="asynclane", batch=1, layouts=(True,)),
    dict(topology="v6e:1x1", mesh="tensor", model="dream-7b-instruct",
         sampler="asynclane", batch=1, layouts=(True,)),
    dict(topology="v6e:1x1", mesh="tensor", model="llada-8b-instruct",
         sampler="asynclane", batch=8, gen_length=256, layouts=(True,)),
    dict(topology="v6e:1x1", mesh="tensor", model="llada-8b-instruct",
         sampler="fast-dllm", batch=8, gen_length=256, layouts=(True,)),
    dict(topology="v5e:2x4", mesh="data=1,tensor=8", model="dream-7b-instruct",
         sampler="asynclane", batch=8, layouts=(True,)),
    dict(topology="v5e:2x4", mesh="data=1,tensor=8", model="dream-7b-instruct",
         sampler="fast-dllm", batch=8, layouts=(True,)),
    dict(topology="v6e:1x1", mesh="tensor", model="llada-8b-instruct",
         sampler="asynclane", batch=1),
)


def command(row: dict, gen_length: int = 512, prompt: int = 128) -> list[str]:
    gen_length = row.get("gen_length", gen_length)
    cmd = ["asynclane-jax", "aot", "--preset", row["model"], "--sampler", row["sampler"]]
    for opt in SAMPLERS[row["sampler"]]:
        cmd += ["--option", opt]
    cmd += ["--gen-length", str(gen_length), "--batch", str(row["batch"]), "--prompt",
            str(prompt), "--topology", row["topology"], "--mesh", row["mesh"]]
    if row.get("scan"):
        cmd += ["--scan-layers"]
    return cmd + ["--json"]


def _done(path: pathlib.Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["command"]] = rec
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run(cmd: list[str], out: pathlib.Path, max_rss_gib: float | None = None) -> None:
    """Runs one compile, watching its host memory; appends its report to `out`."""
    text = shlex.join(cmd)
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # nothing here runs on a device
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _rss(proc.pid))
        if max_rss_gib is not None and peak > max_rss_gib * GIB:
            proc.kill()
        time.sleep(1)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        print(f"failed ({proc.returncode}, host memory {peak / GIB:.1f} GiB): {text}\n"
              f"{stderr[-2000:]}", file=sys.stderr, flush=True)
        return
    rec = {"command": text, "rc": proc.returncode, "wall_s": round(wall, 1),
           "host_rss_gib": round(peak / GIB, 2), **json.loads(stdout.strip().splitlines()[-1])}
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{wall:7.1f}s  fits={rec['fits']}  host {peak / GIB:.1f} GiB  {text}", flush=True)


def _run_pending(commands, args) -> None:
    """Runs, in order, the commands whose rows args.out does not hold yet, at most
    args.limit of them (a stopped run picks up where it stopped)."""
    out = pathlib.Path(args.out)
    done = _done(out)
    n = 0
    for cmd in commands:
        if shlex.join(cmd) in done:
            continue
        if args.limit is not None and n >= args.limit:
            return
        _run(cmd, out, args.max_rss_gib)
        n += 1


def cmd_rows(args) -> None:
    _run_pending((command(r) for r in ROWS
                  if not args.only or r["topology"].startswith(args.only)), args)


def cmd_layers(args) -> None:
    _run_pending((command(dict(case, scan=scan)) for case in LAYOUT_CASES
                  for scan in case.get("layouts", (False, True))), args)


def cmd_layers_table(args) -> None:
    from asynclane_jax import aot

    recs = _done(pathlib.Path(args.rows))
    print("| topology, mesh | model | sampler | batch | layers | arguments | temporaries | "
          "code | peak | compile s | collectives | command |")
    print("|---|---|---|--:|---|--:|--:|--:|--:|--:|---|---|")
    ratios = []
    for case in LAYOUT_CASES:
        pair = [recs.get(shlex.join(command(dict(case, scan=s)))) for s in (False, True)]
        for scan, r in zip(("unrolled", "scanned"), pair, strict=True):
            if r is None:
                continue
            opts = " ".join(f"{k}={v}" for k, v in r["options"].items())
            print(f"| {r['topology']}, {r['mesh']} | {r['model']} | {r['sampler']}"
                  f"{' ' + opts if opts else ''} | {r['batch']} | {scan} | "
                  f"{_gib(r['argument_bytes'])} | {_gib(r['temp_bytes'])} | "
                  f"{_gib(r['code_bytes'])} | {_gib(r['peak_bytes'])} | {r['compile_s']:.0f} "
                  f"| {aot.collectives_brief(r['collectives'])} | `{r['command']}` |")
        if all(pair):
            u, s = pair
            def q(k, u=u, s=s):
                return "–" if not u[k] or s[k] is None else f"{s[k] / u[k]:.2f}"
            ratios.append(f"| {case['topology']} | {case['model']} | {case['sampler']} | "
                          f"{case['batch']} | {q('compile_s')} | {q('code_bytes')} | "
                          f"{q('temp_bytes')} | {q('peak_bytes')} |")
    if ratios:
        print("\nScanned / unrolled, same run:\n")
        print("| topology | model | sampler | batch | compile | code | temporaries | peak |")
        print("|---|---|---|--:|--:|--:|--:|--:|")
        print("\n".join(ratios))


# --------------------------------------------------------------------------- heads

HEADS_CASES = (("data=1,tensor=8", "whole"), ("data=1,tensor=8", "split"),
               ("data=2,tensor=4", "whole"))


def cmd_heads_one(args) -> None:
    """One head-placement compile (prints its report as JSON)."""
    from asynclane_jax import aot
    from asynclane_jax.models import preset

    cfg = preset("dream-7b-instruct").replace(n_layers=args.layers)
    report = aot.compile_for_topology(
        cfg, sampler=args.sampler, options=dict(o.split("=", 1) for o in args.option),
        gen_length=512, batch=8, prompt_len=128, topology="v5e:2x4", mesh=args.mesh,
        heads=args.heads)
    row = report.to_dict()
    row["model"] = f"dream-7b-instruct, n_layers={args.layers}"
    print(json.dumps(row))


def cmd_heads(args) -> None:
    out = pathlib.Path(args.out)
    done = _done(out)
    for sampler in args.sampler or ("asynclane", "fast-dllm"):
        for mesh, heads in HEADS_CASES:
            cmd = [sys.executable, __file__, "heads-one", "--mesh", mesh, "--heads", heads,
                   "--sampler", sampler, *sum((["--option", o] for o in SAMPLERS[sampler]),
                                              [])]
            shown = shlex.join(["python", "experiments/memory_8b.py", *cmd[2:]])
            if shown in done:
                continue
            _run_shown(cmd, shown, out)


def _run_shown(cmd, shown, out):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(f"failed: {shown}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return
    rec = {"command": shown, "wall_s": round(wall, 1),
           **json.loads(proc.stdout.strip().splitlines()[-1])}
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{wall:7.1f}s  {shown}", flush=True)


# --------------------------------------------------------------------------- table

def _gib(b):
    return "–" if b is None else f"{b / GIB:.2f}"


def cmd_table(args) -> None:
    from asynclane_jax import aot

    rows = list(_done(pathlib.Path(args.rows)).values()) if args.rows else []
    heads = list(_done(pathlib.Path(args.heads)).values()) if args.heads else []
    order = {shlex.join(command(r)): i for i, r in enumerate(ROWS)}
    rows.sort(key=lambda r: order.get(r["command"], 1e9))
    for topo, mesh in dict.fromkeys((r["topology"], r["mesh"]) for r in rows):
        sel = [r for r in rows if (r["topology"], r["mesh"]) == (topo, mesh)]
        r0 = sel[0]
        print(f"\n### {topo}: {r0['chips']} x {r0['device_kind']}, "
              f"{r0['hbm_bytes'] / GIB:.0f} GiB HBM per chip, mesh {r0['mesh']}\n")
        print("| model | sampler | batch | arguments | output | temporaries | code | peak "
              "| headroom | compile s | collectives | command |")
        print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|")
        for r in sel:
            head = ("–" if r["headroom_bytes"] is None else
                    f"{r['headroom_bytes'] / GIB:.2f} "
                    f"({100 * r['headroom_bytes'] / r['hbm_bytes']:.0f}%)")
            opts = " ".join(f"{k}={v}" for k, v in r["options"].items())
            print(f"| {r['model']} | {r['sampler']}{' ' + opts if opts else ''} | "
                  f"{r['batch']} | {_gib(r['argument_bytes'])} | {_gib(r['output_bytes'])} "
                  f"| {_gib(r['temp_bytes'])} | {_gib(r['code_bytes'])} | "
                  f"{_gib(r['peak_bytes'])} | {head} | {r['compile_s']:.0f} | "
                  f"{aot.collectives_brief(r['collectives'])} | `{r['command']}` |")
    if heads:
        print("\n### Heads (Dream-7B width, 2 layers, batch 8, gen_length 512, v5e:2x4)\n")
        print("| sampler | mesh | heads | AR | AG | A2A | RS | CP | arguments | "
              "temporaries | peak | compile s | command |")
        print("|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
        for r in heads:
            c = r["collectives"]
            print(f"| {r['sampler']} | {r['mesh']} | {r['heads']} | {c['all-reduce']} | "
                  f"{c['all-gather']} | {c['all-to-all']} | {c['reduce-scatter']} | "
                  f"{c['collective-permute']} | {_gib(r['argument_bytes'])} | "
                  f"{_gib(r['temp_bytes'])} | {_gib(r['peak_bytes'])} | "
                  f"{r['compile_s']:.0f} | `{r['command']}` |")
    if args.write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "memory-8b.json").write_text(
            json.dumps({"rows": rows, "heads": heads}, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rows")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="topology prefix, e.g. v5e")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-rss-gib", type=float, default=None,
                   help="stop a compile whose process grows past this much host memory")
    p.set_defaults(func=cmd_rows)
    p = sub.add_parser("layers")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-rss-gib", type=float, default=None)
    p.set_defaults(func=cmd_layers)
    p = sub.add_parser("layers-table")
    p.add_argument("--rows", required=True)
    p.set_defaults(func=cmd_layers_table)
    p = sub.add_parser("heads")
    p.add_argument("--out", required=True)
    p.add_argument("--sampler", action="append", default=None)
    p.set_defaults(func=cmd_heads)
    p = sub.add_parser("heads-one")
    p.add_argument("--mesh", required=True)
    p.add_argument("--heads", required=True)
    p.add_argument("--sampler", default="asynclane")
    p.add_argument("--option", action="append", default=[])
    p.add_argument("--layers", type=int, default=2)
    p.set_defaults(func=cmd_heads_one)
    p = sub.add_parser("table")
    p.add_argument("--rows", default=None)
    p.add_argument("--heads", default=None)
    p.add_argument("--write", action="store_true",
                   help="also write experiments/results/compile/memory-8b.json")
    p.set_defaults(func=cmd_table)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
