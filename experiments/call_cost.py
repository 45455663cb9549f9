"""What one model call costs on a shipped model: a full forward over the canvas against
cached calls of Q queries, with all T keys or only the first K (`forward(key_len=K)`).

The samplers' speed follows from these costs: a full forward costs many cached calls,
and a cached call's cost grows with its query count and with the keys it reads. Results
are printed and written to experiments/results/decode/call_cost.{md,json}.

Usage: python experiments/call_cost.py [--model tiny-llada] [--prompt 64]
       [--gen-lengths 128,256,512] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

import asynclane_jax
from asynclane_jax.models.model import KVCache

RESULTS = pathlib.Path(__file__).parent / "results" / "decode"
QUERIES = (8, 36, 64, 160)


def timed(fn, *args, repeat: int) -> float:
    """Median seconds of fn(*args) after a compile call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen-lengths", default="128,256,512")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keys", type=int, default=128,
                    help="generated positions a key_len call reads (block + horizon of "
                    "the visible horizon AsyncLane once had)")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    model, _, cfg = asynclane_jax.load(args.model)
    graphdef, params = nnx.split(model)
    b, P = args.batch, args.prompt

    def full(params, toks, pos):
        m = nnx.merge(graphdef, params)
        cols = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
        cache = KVCache.zeros(m.cfg, *toks.shape)
        return m.forward(toks, pos, cache=cache, write_index=cols, logits_index=cols[:, :32])

    def cached(params, toks, pos, cols, cache, key_len):
        m = nnx.merge(graphdef, params)
        return m.forward(toks, pos, cache=cache, write_index=cols, key_len=key_len)

    rows = []
    for G in (int(g) for g in args.gen_lengths.split(",")):
        T = P + G
        toks = jnp.full((b, T), cfg.mask_token_id, jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(T), (b, T))
        t_full = timed(jax.jit(full), params, toks, pos, repeat=args.repeat)
        _, cache = jax.jit(full)(params, toks, pos)
        row = {"gen_length": G, "T": T, "full_ms": 1e3 * t_full}
        for Q in QUERIES:
            cols = jnp.broadcast_to(P + jnp.arange(Q), (b, Q))
            for label, key_len in (("all", None), ("lead", min(T, P + args.keys))):
                fn = jax.jit(cached, static_argnums=5)
                row[f"q{Q}_{label}_ms"] = 1e3 * timed(fn, params, toks[:, :Q], pos[:, :Q],
                                                      cols, cache, key_len, repeat=args.repeat)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"model": args.model, "prompt": P, "batch": b, "keys": P + args.keys,
            "backend": jax.default_backend(), "machine": platform.machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "call_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    head = ["gen_length", "T", "full forward"] + [
        f"Q={Q}, {'all T keys' if k == 'all' else f'first {P + args.keys} keys'}"
        for Q in QUERIES for k in ("all", "lead")]
    lines = [f"# One model call on `{args.model}`", "",
             f"Median milliseconds per call, batch {b}, prompt {P}, backend "
             f"{meta['backend']} ({meta['machine']}). Full forward: the whole canvas of T "
             "columns. Q=n: a cached call of n queries against all T cached keys, or "
             f"against the first {P + args.keys} only (`forward(key_len=...)`).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["gen_length"]), str(r["T"]), f"{r['full_ms']:.2f}"] + [
            f"{r[f'q{Q}_{k}_ms']:.2f}" for Q in QUERIES for k in ("all", "lead")]
        lines.append("| " + " | ".join(cells) + " |")
    (RESULTS / "call_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
