"""Does the cost model's method predict this machine? Each bench row's decode time on the
CPU, predicted from the calls it recorded (each call shape of the model timed here,
asynclane_jax.costs.measure) plus the schedule's own work per call (timed with the
model's layers taken out, asynclane_jax.costs.loop), against the decode time the bench
measured: the error per sampler, on both v4 models at 512 and 256, batch 1.

The prediction is made after the bench has run, from measurements of its own (never
fitted to the measured decode times). Results: experiments/results/cost/cpu_check.{md,json},
with the command and the commit that made them.

Usage: python experiments/cost_cpu_check.py [--n 100] [--models tiny-llada-v4b,tiny-dream-v4]
       [--gen-lengths 512,256] [--samplers SPEC,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import sys

from cost_projection import _commit  # experiments/ is the script's own folder

import asynclane_jax
from asynclane_jax.bench import project, runner
from asynclane_jax.testbed import tasks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "experiments" / "results" / "cost" / "cpu_check"
SAMPLERS = ("d2f@{model}-d2f,fast-dllm:cache=dual,localleap:cache=dual,eb,"
            "fast-dllm:cache=dual:early_stop=true,"
            "fast-dllm:cache=dual:cascade=true:early_stop=true:threshold=0.9,"
            "asynclane")
def _dirty() -> str:
    """' (with uncommitted edits to asynclane_jax)' when the package's files differ
    from the commit, else ''."""
    import subprocess

    out = subprocess.run(["git", "status", "--porcelain", "--", "asynclane_jax"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    return " (with uncommitted edits to asynclane_jax)" if out.strip() else ""


AIM = 0.15  # the aim: every sampler within 15%


def check_model(name: str, n: int, gen_lengths: list[int], specs: list[str]) -> list[dict]:
    model, tok, _ = asynclane_jax.load(name)
    task_set = tasks.model_task_set(name)
    rows = runner.run_bench(model, tok, specs, gen_lengths, n, 1, progress=True,
                            model_name=name, task_set=task_set)
    costs = project.CpuCosts(model, tok, task_set)
    costs.prepare(rows)
    out = []
    for r in rows:
        calls_s, loop_s = costs.row_seconds(r)
        out.append({"model": name, "sampler": r["sampler"], "options": r["options"],
                    "gen_length": r["gen_length"], "accuracy": r["accuracy"],
                    "measured_s": r["wall_s"], "calls_s": calls_s, "loop_s": loop_s,
                    "predicted_s": calls_s + loop_s,
                    "error": (calls_s + loop_s) / r["wall_s"] - 1.0,
                    "error_calls_only": calls_s / r["wall_s"] - 1.0,
                    "calls": r["calls"]})
        print(json.dumps({k: v for k, v in out[-1].items() if k != "calls"}), flush=True)
    return out


def markdown(rows: list[dict], command: str, meta: dict) -> str:
    lines = ["# The cost model's method on this CPU: predicted against measured decode time",
             "", "Made by:", "", "```", command, "```", "",
             f"Commit {meta['commit']}, {meta['date']}, {meta['machine']}. "
             f"{meta['n']} held-out problems per row, batch 1, samplers interleaved "
             "(asynclane_jax.bench.runner). `measured s`: the bench's decode time "
             "(compilation excluded). `calls s`: every recorded call priced at its shape's "
             "time measured here, in a jitted loop of calls of that shape, every shape "
             "in interleaved rounds "
             "(asynclane_jax.costs.measure). `loop s`: calls x the schedule's own work "
             "per call, measured with the model's layers taken out "
             "(asynclane_jax.costs.loop). `error`: predicted (calls + loop) over measured, "
             f"minus 1; the aim is within {AIM:.0%} for every sampler. Nothing here is "
             "fitted to the measured times.", "",
             "| model | gen | sampler | accuracy | measured s | calls s | loop s | "
             "error (calls only) | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = "" if abs(r["error"]) <= AIM else " **outside**"
        lines.append(
            f"| {r['model']} | {r['gen_length']} | {r['sampler'].replace('|', chr(92) + '|')} "
            f"| {100 * r['accuracy']:.1f}% | {r['measured_s']:.2f} | {r['calls_s']:.2f} | "
            f"{r['loop_s']:.2f} | {r['error_calls_only']:+.1%} | {r['error']:+.1%}{flag} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += ["", f"Largest error: {worst['error']:+.1%} ({worst['model']}, "
              f"{worst['gen_length']}, `{worst['sampler']}`); "
              f"{sum(abs(r['error']) <= AIM for r in rows)} of {len(rows)} rows within "
              f"{AIM:.0%}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--models", default="tiny-llada-v4b,tiny-dream-v4")
    ap.add_argument("--gen-lengths", default="512,256")
    ap.add_argument("--samplers", default=SAMPLERS,
                    help="comma-separated specs; {model} is the model's name")
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    gen_lengths = [int(g) for g in args.gen_lengths.split(",")]
    rows = []
    for name in args.models.split(","):
        specs = [s for s in args.samplers.format(model=name).split(",") if s]
        rows += check_model(name, args.n, gen_lengths, specs)
    command = "python " + " ".join(shlex.quote(a) for a in
                                   ["experiments/cost_cpu_check.py", *sys.argv[1:]])
    meta = {"commit": _commit() + _dirty(), "n": args.n,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, command, meta)
    args.out.with_suffix(".md").write_text(md)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, **meta, "rows": rows}, indent=1) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
