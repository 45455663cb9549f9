"""How a LLaDA2-style model uses its experts: the share of routed (token, expert) pairs
each expert gets, layer by layer, over the canvases the model decodes.

For each of the first N held-out problems, the model decodes the prompt with `llada2`
(its own sampler) and the finished canvas (prompt and answer up to its first
end-of-text, the rest dropped) goes through one forward pass with block-causal
attention, as in the last call of a decode. Every mixture-of-experts layer's routing
(`moe.route`, recorded as the forward runs) is counted over the canvas's tokens. Per
layer: each expert's share of the pairs, the largest share against the uniform 1/E, the
experts that get under a quarter of the uniform share, the routing entropy (in bits,
against log2 E), and each group's share (the group limit picks groups before experts).

No training changes: it measures, it does not balance. Results:
experiments/results/testbed/expert_use_<model>.{md,json} (`--out` to change).

Usage: python experiments/expert_use.py [--model tiny-llada2-v4b] [--n 500] [--gen-length 512]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import numpy as np
from cost_projection import _commit  # the repository's HEAD, as the projections record it

ROOT = pathlib.Path(__file__).resolve().parents[1]


def route_counts(model, canvases) -> np.ndarray:
    """[L_moe, E] routed (token, expert) pairs per expert-layer over the canvases (each
    a list of token ids), one forward pass each with the model's block layout."""
    import jax.numpy as jnp

    from asynclane_jax.decoding.schedule import LLADA2_BLOCK_LENGTH
    from asynclane_jax.models import moe

    cfg = model.cfg
    layers = [i for i in range(cfg.n_layers) if cfg.moe_layer(i)]
    counts = np.zeros((len(layers), cfg.n_experts), np.int64)
    seen: list[np.ndarray] = []
    original = moe.route

    def recording(*args, **kwargs):
        experts, weights = original(*args, **kwargs)
        seen.append(np.asarray(experts))
        return experts, weights

    moe.route = recording
    try:
        for canvas in canvases:
            seen.clear()
            tokens = jnp.asarray(canvas, jnp.int32)[None]
            blocks = jnp.arange(len(canvas), dtype=jnp.int32)[None] // LLADA2_BLOCK_LENGTH
            model(tokens, block_ids=blocks)
            if len(seen) != len(layers):
                raise RuntimeError(f"recorded {len(seen)} routings, expected {len(layers)}: "
                                   "is the forward compiled (the recording needs it eager)?")
            for row, experts in zip(counts, seen):
                row += np.bincount(experts.ravel(), minlength=cfg.n_experts)
    finally:
        moe.route = original
    return counts


def summarise(counts: np.ndarray, n_groups: int) -> list[dict]:
    """Per layer: shares, max share over uniform, starved experts, entropy, group shares."""
    out = []
    n_experts = counts.shape[1]
    for row in counts:
        share = row / row.sum()
        nz = share[share > 0]
        out.append({
            "pairs": int(row.sum()),
            "share": [round(float(s), 4) for s in share],
            "max_over_uniform": round(float(share.max() * n_experts), 3),
            "min_over_uniform": round(float(share.min() * n_experts), 3),
            "starved": int(np.sum(share < 0.25 / n_experts)),
            "entropy_bits": round(float(-(nz * np.log2(nz)).sum()), 3),
            "group_share": [round(float(s), 4)
                            for s in share.reshape(n_groups, -1).sum(axis=1)],
        })
    return out


def write_md(path: pathlib.Path, result: dict) -> None:
    cfg = result["config"]
    E, k = cfg["n_experts"], cfg["n_experts_per_tok"]
    lines = [
        f"# Expert use of `{result['model']}`", "",
        "Made by:", "", "```", result["command"], "```", "",
        f"At commit {result['commit']}. {result['n']} held-out problems decoded by "
        f"`llada2` at gen_length {result['gen_length']} ({result['correct']} right); "
        f"each finished canvas (prompt and answer up to its first end-of-text, "
        f"{result['tokens']} tokens in all) through one block-causal forward pass. "
        f"{E} routed experts, top-{k}, {cfg['n_expert_groups']} groups of "
        f"{E // cfg['n_expert_groups']} (the best {cfg['n_topk_groups']} allowed). "
        f"Uniform use is 1/{E} = {1 / E:.4f} of a layer's pairs per expert; the "
        f"entropy of uniform use is {np.log2(E):.3f} bits.", "",
        "| layer | pairs | expert shares | max / uniform | min / uniform | experts under "
        "1/4 of uniform | entropy (bits) | group shares |",
        "|--:|--:|---|--:|--:|--:|--:|---|",
    ]
    for layer, s in zip(result["moe_layers"], result["layers"]):
        lines.append(
            f"| {layer} | {s['pairs']:,} | {' '.join(f'{x:.3f}' for x in s['share'])} | "
            f"{s['max_over_uniform']:.2f} | {s['min_over_uniform']:.2f} | {s['starved']} | "
            f"{s['entropy_bits']:.3f} | {' '.join(f'{x:.3f}' for x in s['group_share'])} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llada2-v4b")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--out", default=None, help="results path without extension")
    args = ap.parse_args(argv)

    import asynclane_jax as aj
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import evaluate, tasks

    model, tok, cfg = aj.load(args.model)
    if not getattr(cfg, "is_moe", False):
        ap.error(f"{args.model} is not a mixture-of-experts model")
    evaluate.check_n(args.n)
    problems = tasks.split("heldout", args.n)
    prompts = evaluate.prompts_for(problems, tok)
    stops = set(cfg.stop_token_ids)
    canvases, correct = [], 0
    for start in range(0, args.n, args.batch_size):
        batch = prompts[start:start + args.batch_size]
        res = generate(model, batch, sampler="llada2", gen_length=args.gen_length,
                       tokenizer=tok, bucket=max(len(p) for p in prompts))
        for p, problem, row in zip(batch, problems[start:], res.tokens):
            row = [int(t) for t in row]
            end = next((j for j, t in enumerate(row) if t in stops), len(row))
            canvases.append(list(p) + row[:end + 1])
            correct += bool(tasks.check(problem, row))
        print(f"decoded {len(canvases)} / {args.n}", file=sys.stderr, flush=True)
    counts = route_counts(model, canvases)
    out = pathlib.Path(args.out) if args.out else (
        ROOT / "experiments" / "results" / "testbed" / f"expert_use_{args.model}")
    result = {
        "model": args.model, "n": args.n, "gen_length": args.gen_length,
        "correct": correct, "tokens": int(sum(len(c) for c in canvases)),
        "command": "python experiments/expert_use.py " + shlex.join(argv or sys.argv[1:]),
        "commit": _commit(), "config": cfg.to_dict(),
        "moe_layers": [i for i in range(cfg.n_layers) if cfg.moe_layer(i)],
        "counts": counts.tolist(), "layers": summarise(counts, cfg.n_expert_groups),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out.with_suffix(".json"))
    write_md(out.with_suffix(".md"), result)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
