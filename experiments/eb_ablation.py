"""What each Early-Bird router and setting is worth on a shipped model: accuracy and
model calls of `eb` variants on the same held-out problems (batch 50; tokens/s belongs
to `asynclane-jax bench`, at batch 1).

  python experiments/eb_ablation.py --model tiny-llada [--n 200] [--gen-length 256]

Writes experiments/results/eb_ablation_<model>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import asynclane_jax as aj
from asynclane_jax.testbed import evaluate as ev

RESULTS = pathlib.Path(__file__).parent / "results"

VARIANTS = (
    ("defaults", {}),
    ("lps=false", {"lps": False}),
    ("lbs=false", {"lbs": False}),
    ("lbs=false lps=false (threshold decoding, blocks of 32, no cache)",
     {"lbs": False, "lps": False}),
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)

    model, tokenizer, _ = aj.load(args.model)
    G = args.gen_length
    variants = list(VARIANTS) + [(f"fallback_length={G}", {"fallback_length": G})]
    rows = []
    print(f"{'eb options':<68} accuracy  calls/problem  calls/token")
    for label, opts in variants:
        r = ev.evaluate(model, tokenizer, sampler="eb", gen_length=G, n=args.n,
                        batch_size=50, **opts)
        rows.append({"options": label, **{k: r[k] for k in ("n", "accuracy", "nfe_per_row",
                                                            "nfe_per_token")}})
        print(f"{label:<68} {r['accuracy']:7.1%}  {r['nfe_per_row']:13.1f}  "
              f"{r['nfe_per_token']:11.3f}", flush=True)
    out = pathlib.Path(args.results) / f"eb_ablation_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "gen_length": G, "n": args.n,
                               "split": "heldout", "batch": 50, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
