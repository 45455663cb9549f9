"""The host time of a `generate` call: its wall time minus its decode time.

`generate` times the compiled decode itself (`stats.decode_time`); the rest of a call is
the host's: the schedule built and bound, the canvas, the model's graph split into a
graphdef and its state, the program looked up, the arguments placed, the results read
back and the stats made. For a model, gen_length and batch sizes, this times whole
`generate` calls on held-out prompts of the model's task set (compiled first), two
ways interleaved round by round:

* `remembered`: as shipped: the model's `nnx.split` remembered while the model is
  unchanged (`asynclane_jax.decoding.api.split_model`), the mesh read from that state;
* `split per call`: as before f55bd61: `nnx.split` and a second walk of the model for
  its mesh on every call (patched in for this script only).

Per batch size and way: the median over rounds of the mean wall, decode and host
milliseconds per call, and what one call of `nnx.split`, of the model's mesh lookup and
of a pytree flatten of the model cost alone. Results:
experiments/results/decode/generate_host_time.md (--out).

Usage: python experiments/generate_host_time.py [--model tiny-llada] [--gen-length 128]
       [--batches 1,8] [--calls 24] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shlex
import statistics
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results" / "decode"


@contextlib.contextmanager
def split_per_call():
    """`generate` as before f55bd61: a split and a mesh walk on every call."""
    from flax import nnx

    from asynclane_jax.decoding import api

    saved = api.split_model, api.sharding_plan
    api.split_model = nnx.split
    api.sharding_plan = lambda model, mesh, params=None: saved[1](model, mesh)
    try:
        yield
    finally:
        api.split_model, api.sharding_plan = saved


def time_alone(fn, n: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--calls", type=int, default=24, help="generate calls per way and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "generate_host_time"),
                    help="results stem (.md)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches) or args.calls < 1 or args.rounds < 1:
        ap.error("--batches, --calls and --rounds must be positive")

    import jax
    from flax import nnx

    import asynclane_jax
    from asynclane_jax import sharding
    from asynclane_jax.testbed import tasks

    model, tok, _ = asynclane_jax.load(args.model)
    texts = [p.prompt for p in tasks.heldout(args.calls * max(batches),
                                             tasks.model_task_set(args.model))]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                              add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for t in texts]
    ways = {"remembered": contextlib.nullcontext, "split per call": split_per_call}
    times = {(w, b): [] for w in ways for b in batches}
    for b in batches:  # compile each batch size's program first
        asynclane_jax.generate(model, ids[:b], gen_length=args.gen_length, tokenizer=tok)
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for b in batches:
            for way in order:
                wall = dec = 0.0
                with ways[way]():
                    for k in range(args.calls):
                        t0 = time.perf_counter()
                        res = asynclane_jax.generate(model, ids[k * b:(k + 1) * b],
                                                     gen_length=args.gen_length, tokenizer=tok)
                        wall += time.perf_counter() - t0
                        dec += res.stats.decode_time
                times[(way, b)].append((1000 * wall / args.calls, 1000 * dec / args.calls))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    alone = {"nnx.split(model)": time_alone(lambda: nnx.split(model)),
             "the mesh from a walk of the model (sharding.mesh_of)":
                 time_alone(lambda: sharding.mesh_of(model)),
             "jax.tree_util.tree_flatten(model)":
                 time_alone(lambda: jax.tree_util.tree_flatten(model))}

    lines = ["# The host time of a `generate` call", "",
             "Command: `" + shlex.join(["python", "experiments/generate_host_time.py",
                                        *sys.argv[1:]]) + "`", "",
             f"Model `{args.model}`, the default sampler, gen_length {args.gen_length}, "
             f"backend {jax.default_backend()}; {args.calls} calls per batch size, way and "
             f"round, {args.rounds} rounds, the two ways interleaved (their order "
             "alternating). Milliseconds per `generate` call, the median over rounds of "
             "each round's mean; host = wall - decode (`stats.decode_time`).", "",
             "| batch | way | wall ms | decode ms | host ms |", "|---|---|--:|--:|--:|"]
    for b in batches:
        for way in ways:
            w = statistics.median(x[0] for x in times[(way, b)])
            d = statistics.median(x[1] for x in times[(way, b)])
            lines.append(f"| {b} | {way} | {w:.2f} | {d:.2f} | {w - d:.2f} |")
    lines += ["", "Alone, per call (ms; 50 calls after one):", "",
              "| step | ms |", "|---|--:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in alone.items()]
    lines += ["", "`remembered`: the split kept while the model's pytree structure and "
              "leaves are the same objects (`api.split_model`; a flatten of the model "
              "tells), the mesh read from its state. `split per call`: a split and a "
              "walk of the model for its mesh on every call, as before."]
    out = pathlib.Path(args.out).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
