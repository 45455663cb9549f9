"""Samplers side by side on a shipped testbed model: accuracy, tokens/s, model calls.

Runs `asynclane-jax bench` (asynclane_jax.bench.cli): every sampler on the same held-out
problems in one process, interleaved batch by batch, at several generation lengths;
Fast-dLLM and LocalLeap at the faster of prefix and dual cache; tokens/s counts tokens
before the first end-of-text over decoding time (compilation excluded). Results go to
experiments/results/bench/bench_<model>.json (rewritten after each generation length), .md and
.png (the plot when matplotlib is installed); with --batch B other than 1 the names end
in _batchB, and with --tag T in _T (a run of a few specs that must not overwrite the
full bench). The command that made them is kept in the JSON's meta and at the top of the .md
(asynclane_jax.bench.report.to_markdown).

The default specs (bench.spec.DEFAULT_SAMPLERS) hold the three comparisons: the baselines
as published, with early stop, and on AsyncLane's footing (bench.compare's docstring).

Usage: python experiments/bench_samplers.py [--model tiny-llada] [--n 50] [--batch 1]
       [--gen-lengths 128,256,512] [--samplers SPEC,SPEC,...] [--tag T]
       [--project v5e,v6e,h200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import shlex
import sys

from asynclane_jax.bench import cli, report, runner, spec

RESULTS = pathlib.Path(__file__).parent / "results" / "bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen-lengths", default=",".join(map(str, spec.DEFAULT_GEN_LENGTHS)))
    ap.add_argument("--samplers", default=None, help="default: the bench command's")
    ap.add_argument("--tag", default=None, help="results named bench_<model>[_batchB]_<tag>")
    ap.add_argument("--project", default=None, metavar="CHIPS",
                    help="also project each row on these chips (the bench's --project)")
    args = ap.parse_args()

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"bench_{pathlib.Path(args.model).name}"
    if args.batch != 1:
        stem = stem.with_name(f"{stem.name}_batch{args.batch}")
    if args.tag:
        if not args.tag.replace("-", "").replace("_", "").isalnum():
            ap.error(f"--tag {args.tag!r}: letters, digits, - and _ only")
        stem = stem.with_name(f"{stem.name}_{args.tag}")
    argv = ["--model", args.model, "--n", str(args.n), "--batch", str(args.batch),
            "--gen-lengths", args.gen_lengths, "--json", f"{stem}.json"]
    if args.samplers:
        argv += ["--samplers", args.samplers]
    if args.project:
        argv += ["--project", args.project]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", f"{stem}.png"]
    rc = cli.main(argv)
    if rc != 0:
        return rc
    data = json.loads(pathlib.Path(f"{stem}.json").read_text())
    data["meta"]["command"] = shlex.join(["python", "experiments/bench_samplers.py",
                                          *sys.argv[1:]])
    runner.write_json(f"{stem}.json", data["meta"], data["rows"])
    md = report.to_markdown(data["rows"], data["meta"])
    pathlib.Path(f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
