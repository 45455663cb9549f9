"""What the samplers of the v4 benches would do on the chips users run: every bench row's
recorded model calls priced on TPU v5e (int8 weights), TPU v6e and an NVIDIA H200 by the
cost model (asynclane_jax.costs, docs/costs.md), beside the CPU's measured figures.

Input: bench JSON files whose rows carry their calls by shape (`asynclane-jax bench` or
experiments/bench_samplers.py since the calls were recorded). Each chip's rows are
compared as the bench compares the CPU's (asynclane_jax.bench.compare: (a) published,
(b) early stop, (c) equal footing), with the projected tokens/s in place of the measured
ones, so `vs (c)` is an asynclane row's speed over the fastest equal-footing baseline
of its own footing on that chip. Results: experiments/results/cost/projected_v4.{md,json}
(`--out` to change), with the command and the commit that made them.

Usage: python experiments/cost_projection.py BENCH.json [BENCH.json ...]
       [--chips v5e:int8,v6e,h200] [--out experiments/results/cost/projected_v4]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import shlex
import subprocess
import sys

from asynclane_jax.bench import compare, project

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "experiments" / "results" / "cost" / "projected_v4"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _rel(path: pathlib.Path) -> str:
    """The path from the repository root when it lies inside, else as it is."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def project_file(path: pathlib.Path, chips) -> dict:
    """One bench file's rows with `projected` filled and, per chip, the comparisons
    computed from the projected tokens/s."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    missing = [r["sampler"] for r in rows if not r.get("calls")]
    if missing:
        raise SystemExit(f"{path}: rows without recorded calls (made before the calls "
                         f"were recorded?): {missing}")
    family = project.family_of_name(data["meta"]["model"])  # llada2, dream or llada
    cfg = project.project_model_config(None, family)
    project.add_projections(rows, chips, cfg)
    compare.add_speedups(rows)  # the CPU's own comparison
    per_chip = {}
    for row in rows:
        row["by_kind"] = by_kind(row, chips, cfg)
    for chip, weights in chips:
        label = project.label(chip, weights)
        copies = [dict(copy.deepcopy(r), tps=r["projected"][label], tps_family={})
                  for r in rows]
        compare.add_speedups(copies)
        per_chip[label] = [c["speedup_vs_fastest_equal_footing"] for c in copies]
    return {"file": _rel(path),
            "meta": data["meta"], "rows": rows, "vs_c": per_chip,
            "project_model": project.DEFAULT_PROJECT_MODELS[family]}


def by_kind(row: dict, chips, cfg) -> dict:
    """{chip label: {"full"|"cached": [calls, rows served, projected seconds]}}: where a
    row's projected time goes, full forwards against cached calls."""
    from asynclane_jax.costs import roofline

    out = {}
    for chip, weights in chips:
        if chip == "cpu":
            continue
        split = {}
        for c in row["calls"]:
            counts = project.row_counts({"calls": [c]})
            seconds = roofline.decode_time(chip, cfg, counts, weights=weights)
            calls, served, total = split.get(c["kind"], (0, 0, 0.0))
            split[c["kind"]] = [calls + int(c["calls"]), served + int(c["row_calls"]),
                                total + seconds]
        out[project.label(chip, weights)] = split
    return out


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(results: list[dict], labels: list[str], command: str) -> str:
    lines = ["# Projected tokens/s of the v4 benches on users' chips", "",
             "Made by:", "", "```", command, "```", "",
             f"Commit {_commit()}, "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}."
             " **Projections, not measurements** (except the `cpu` columns): each row's "
             "model calls, as the tiny testbed model made them on the CPU (same calls, same "
             "canvas, same batch), priced as the same calls of the 8B LLaDA preset "
             "(`llada-8b-instruct`), the 7B Dream preset (`dream-7b-instruct`) or, for "
             "a LLaDA2-style model, `llada2-mini` on the chip's roofline "
             "(`asynclane_jax.costs`, docs/costs.md): v5e with int8 weights "
             "(the bfloat16 8B does not fit one v5e's 16 GiB), v6e and H200 with bfloat16. "
             "`cpu tok/s` is what the bench measured on this 2-core CPU (other jobs shared "
             "it during these runs: read its ratios, which are interleaved, more than its "
             "absolute figures). `vs (c)`: tokens/s over the fastest equal-footing "
             "baseline of the row's own footing at that length and batch, on that chip "
             "(asynclane rows only; bench.compare). Accuracy is the tiny model's, "
             "measured.", ""]
    head = ["sampler", "accuracy", "calls/token", "cpu tok/s", "vs (c) cpu"]
    for lab in labels:
        head += [f"{lab} tok/s*", f"vs (c) {lab}"]
    for res in results:
        meta = res["meta"]
        for g in sorted({r["gen_length"] for r in res["rows"]}, reverse=True):
            lines += ["", f"## {meta['model']}, gen_length {g}, batch {meta['batch']}, "
                      f"{meta['n']} problems (projected with {res['project_model']}; "
                      f"from `{res['file']}`)", "",
                      "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for i, r in enumerate(res["rows"]):
                if r["gen_length"] != g:
                    continue
                cells = [r["sampler"].replace("|", "\\|"),
                         f"{100 * r['accuracy']:.1f}%", f"{r['nfe_per_token']:.3f}",
                         f"{r['tps']:.0f}", _x(r.get("speedup_vs_fastest_equal_footing"))]
                for lab in labels:
                    cells += [f"{r['projected'][lab]:.0f}", _x(res["vs_c"][lab][i])]
                lines.append("| " + " | ".join(cells) + " |")
            chip_labels = [lab for lab in labels if lab != "cpu"]
            if meta["batch"] > 1 and chip_labels:
                lab = "v6e" if "v6e" in chip_labels else chip_labels[0]
                lines += ["", f"Where the projected {lab} time goes: calls made (rows they "
                          "served), seconds.", "",
                          "| sampler | full forwards | cached calls |", "|---|---|---|"]
                for r in res["rows"]:
                    if r["gen_length"] != g:
                        continue
                    split = r["by_kind"][lab]
                    cells = []
                    for kind in ("full", "cached"):
                        calls, served, sec = split.get(kind, (0, 0, 0.0))
                        cells.append(f"{calls} ({served}), {sec:.1f} s")
                    lines.append(f"| {r['sampler']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench", nargs="+", type=pathlib.Path)
    ap.add_argument("--chips", default="v5e:int8,v6e,h200")
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    chips = project.parse_chips(args.chips)
    if any(c == "cpu" for c, _ in chips):
        ap.error("--chips: cpu is measured by the bench itself (bench --project cpu)")
    labels = [project.label(c, w) for c, w in chips]
    results = [project_file(p.resolve(), chips) for p in args.bench]
    command = "python " + " ".join(shlex.quote(a) for a in [
        "experiments/cost_projection.py",
        *(_rel(p) for p in args.bench),
        *sys.argv[1 + len(args.bench):]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(results, labels, command)
    args.out.with_suffix(".md").write_text(md)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "commit": _commit(), "chips": labels,
         "results": results}, indent=1) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
