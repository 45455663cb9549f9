"""What the model's full forward and cached call cost on tiny-llada-v4b, before and after
the changes of `asynclane_jax/models/model.py` that cut them, each change measured alone,
and what they do to Fast-dLLM's dual-cache decode at gen_length 256 and 512.

The three changes:
  trim       the last layer's attention and MLP run only on the rows whose logits are
             read (`forward(logits_index=...)`), its K/V still written from every row;
  attention  the XLA path's attention (`_xla_attention`): grouped query heads stacked
             along the query axis, the softmax normalized after the value matmul,
             instead of `jax.nn.dot_product_attention(implementation="xla")`;
  rope       RoPE's cos / sin tables computed once per forward, half width.

"before" is model.py as it was at BEFORE (`git show BEFORE:asynclane_jax/models/model.py`,
loaded as its own module; it imports the rest of the package from this tree, whose
model config, sharding and quantize modules the script checks are unchanged since).
"after" is this tree's model.py; "after without X" is it with change X undone by patching
the module (the old attention, the old per-layer RoPE, the last layer over every row),
so the difference is what X saves on its own, the others kept. Every variant holds the
same weights and runs under one jit per shape; rounds alternate the variants so a
drift in the machine's speed reaches all of them alike. A call's figure is the median
over rounds of the mean of `--calls` calls, as wall time and as this process's CPU time
(the machine is shared: CPU time is the steadier of the two).

The decode comparison decodes the first `--problems` held-out v4 problems one at a time
(batch 1, as the testbed evaluation buckets them) with the before and the after model
in turn, alternating which goes first, and sums the driver's `decode_time` (the
compiled loop alone) and the wall time of each `generate`; it counts the generated
tokens that differ between the two.

With --aot it compiles LLaDA-8B's Fast-dLLM dual-cache decode with scanned layers for
a v5e:2x4 slice ahead of time (`asynclane-jax aot`, in a worktree at BEFORE and in this
tree) and adds the memory, code and collectives to the results of an earlier run.

With --tokens it runs only the token checks (TOKEN_CHECKS: each sampler whose tokens
must not move, on the first 100 or 500 held-out v4 problems at gen_length 512, before
and after model in turn) and adds them to the results of an earlier run.

Results: experiments/results/decode/full_forward_cost.{md,json}.

Usage: python experiments/full_forward_cost.py [--before c50297f] [--rounds 20]
       [--calls 5] [--problems 40] [--gen-lengths 256,512]
       python experiments/full_forward_cost.py --tokens
       python experiments/full_forward_cost.py --aot
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import asynclane_jax
from asynclane_jax.decoding import generate
from asynclane_jax.models import model as M
from asynclane_jax.testbed import evaluate, tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "decode"
MODEL = "tiny-llada-v4b"
PROMPT = 28  # the v4 held-out prompts' bucket (their longest prompt)
READ = 32  # columns a full forward's logits are read at: one Fast-dLLM block
UNCHANGED = ("asynclane_jax/models/config.py", "asynclane_jax/models/quantize.py",
             "asynclane_jax/sharding.py")


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def before_module(commit: str):
    """model.py at `commit`, imported as a module of its own."""
    changed = [p for p in UNCHANGED if git("diff", commit, "--", p)]
    if changed:
        sys.exit(f"these files changed since {commit}, so the before model would not be "
                 f"the one of {commit}: {changed}")
    path = pathlib.Path(tempfile.mkdtemp()) / "model_before.py"
    path.write_text(git("show", f"{commit}:asynclane_jax/models/model.py"))
    spec = importlib.util.spec_from_file_location("model_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def as_model(module, model):
    """`model`'s weights in module's DiffusionLM."""
    other = nnx.eval_shape(lambda: module.DiffusionLM(model.cfg, rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model))
    return other


# ------------------------------------------------------------------ undoing one change
def _old_attention(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _old_tables(positions, h, theta):
    """In place of `rope_tables`: the [b, t, 1, h] angles (and None), for `_old_rope`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.concatenate([ang, ang], axis=-1)[:, :, None, :], None


def _old_rope(x, ang, _):
    """The RoPE of before: cos and sin of [h] angles taken where they are used."""
    h = x.shape[-1]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., h // 2:], x32[..., : h // 2]], axis=-1)
    return (x32 * jnp.cos(ang) + rotated * jnp.sin(ang)).astype(x.dtype)


def _untrimmed_step(step):
    def run(self, index, x, rot, cache, rows, write_index, key_len=None, out_rows=None,
            **kw):
        x, cache = step(self, index, x, rot, cache, rows, write_index, key_len, **kw)
        if out_rows is not None:
            x = jnp.take_along_axis(x, out_rows[:, :, None], axis=1)
        return x, cache
    return run


@contextlib.contextmanager
def without(change: str | None):
    """This tree's model.py with one change undone (None: as it is), while tracing."""
    saved = {}

    def patch(owner, name, value):
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    if change == "attention":
        patch(M, "_xla_attention", _old_attention)
    elif change == "rope":
        patch(M, "rope_tables", _old_tables)
        patch(M, "apply_rope", _old_rope)
    elif change == "trim":
        patch(M.Block, "step", _untrimmed_step(M.Block.step))
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


# ------------------------------------------------------------------ one call's cost
def call_fns(model, cfg, T: int, change: str | None):
    """(full, cached, args): jitted full forward (cache written at every column, logits
    at READ columns) and cached call of READ queries, as the decode makes them, traced
    with `change` undone, and their arguments."""
    gd, params = nnx.split(model)
    rng = np.random.default_rng(T)
    canvas = rng.integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
    canvas[:, PROMPT + 2 * READ:] = cfg.mask_token_id
    cols = jnp.arange(T, dtype=jnp.int32)[None, :]
    key_mask = cols >= 3  # three padding columns, as a left-padded prompt has
    positions = jnp.maximum(cols - 3, 0)
    read = PROMPT + READ + jnp.arange(READ, dtype=jnp.int32)[None, :]

    def full(params, canvas, cache, key_mask, positions, read):
        m = nnx.merge(gd, params)
        return m.forward(canvas, positions, key_mask=key_mask, cache=cache,
                         write_index=jnp.broadcast_to(cols, canvas.shape), logits_index=read)

    def cached(params, canvas, cache, key_mask, positions, read):
        m = nnx.merge(gd, params)
        return m.forward(jnp.take_along_axis(canvas, read, 1),
                         jnp.take_along_axis(positions, read, 1), key_mask=key_mask,
                         cache=cache, write_index=read)

    cache = M.KVCache.zeros(cfg, 1, T)
    args = (params, jnp.asarray(canvas), cache, key_mask, positions, read)
    with without(change):
        full_c = jax.jit(full).lower(*args).compile()
        _, filled = full_c(*args)
        cached_c = jax.jit(cached).lower(params, args[1], filled, *args[3:]).compile()
    return full_c, cached_c, args, (params, args[1], filled, *args[3:])


def timed(fn, args, calls: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call, the mean of `calls` calls."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls


def call_costs(variants: dict, cfg, lengths, rounds: int, calls: int) -> list[dict]:
    rows = []
    for T in lengths:
        built = {name: call_fns(m, cfg, T, change) for name, (m, change) in variants.items()}
        outs = {name: (np.asarray(b[0](*b[2])[0]), np.asarray(b[1](*b[3])[0]))
                for name, b in built.items()}
        samples = {(name, kind): [] for name in built for kind in ("full", "cached")}
        for _ in range(rounds):
            for name, (full_c, cached_c, fargs, cargs) in built.items():
                samples[(name, "full")].append(timed(full_c, fargs, calls))
                samples[(name, "cached")].append(timed(cached_c, cargs, calls))
        ref = outs["before"]
        for name in built:
            row = {"T": T, "variant": name,
                   "full_logits_max_abs_diff": float(np.abs(outs[name][0] - ref[0]).max()),
                   "cached_logits_max_abs_diff": float(np.abs(outs[name][1] - ref[1]).max())}
            for kind in ("full", "cached"):
                s = np.asarray(samples[(name, kind)])
                row[f"{kind}_wall_ms"] = 1e3 * float(np.median(s[:, 0]))
                row[f"{kind}_cpu_ms"] = 1e3 * float(np.median(s[:, 1]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ------------------------------------------------------------------ attention alone
def _ours_variant(normalize_first=False, additive_mask=False):
    """`_xla_attention` with one choice changed, for the attention-alone table."""
    def attend(q, k, v, mask):
        b, Q, H, h = q.shape
        K = k.shape[2]
        G = H // K
        qs = q.reshape(b, Q, K, G, h).transpose(0, 2, 3, 1, 4).reshape(b, K, G * Q, h)
        s = jnp.einsum("bkmh,btkh->bkmt", qs, k, preferred_element_type=jnp.float32)
        s = s * jnp.float32(1 / math.sqrt(h))
        if additive_mask:
            s = s + jnp.where(mask, 0.0, M._MASKED).astype(jnp.float32)
        else:
            s = jnp.where(mask, s, M._MASKED)
        e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        if normalize_first:
            o = jnp.einsum("bkmt,btkh->bkmh", e / jnp.sum(e, axis=-1, keepdims=True), v)
        else:
            o = jnp.einsum("bkmt,btkh->bkmh", e, v) / jnp.sum(e, axis=-1, keepdims=True)
        return o.reshape(b, K, G, Q, h).transpose(0, 3, 1, 2, 4).reshape(b, Q, H, h)
    return attend


ATTENTION_VARIANTS = {
    "jax.nn.dot_product_attention (xla)": _old_attention,
    "_xla_attention": M._xla_attention,
    "_xla_attention, weights normalized before the value matmul": _ours_variant(True),
    "_xla_attention, mask added as a bias": _ours_variant(additive_mask=True),
}


def attention_alone(cfg, shapes, rounds: int, calls: int) -> list[dict]:
    """Each attention formulation on random q, k, v of the model's head shapes, with a
    [b, T] key mask, as one jitted call."""
    rows = []
    for T, Q in shapes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(1, Q, cfg.n_heads, cfg.head_dim)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(1, T, cfg.n_kv_heads, cfg.head_dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(1, T, cfg.n_kv_heads, cfg.head_dim)), jnp.float32)
        mask = jnp.asarray(np.arange(T) >= 3)[None, None, None, :]
        fns = {name: jax.jit(f) for name, f in ATTENTION_VARIANTS.items()}
        outs = {name: np.asarray(f(q, k, v, mask)) for name, f in fns.items()}
        ref = outs["jax.nn.dot_product_attention (xla)"]
        samples = {name: [] for name in fns}
        for _ in range(rounds):
            for name, f in fns.items():
                samples[name].append(timed(f, (q, k, v, mask), calls))
        for name in fns:
            s = np.asarray(samples[name])
            row = {"T": T, "Q": Q, "variant": name, "wall_ms": 1e3 * float(np.median(s[:, 0])),
                   "cpu_ms": 1e3 * float(np.median(s[:, 1])),
                   "max_abs_diff": float(np.abs(outs[name] - ref).max())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ------------------------------------------------------------------ the decode
def decode_speed(before, after, tok, n: int, gen_lengths) -> list[dict]:
    problems = tasks.split("heldout", n, "v4")
    prompts = evaluate.prompts_for(problems, tok)
    bucket = max(len(p) for p in prompts)
    rows = []
    for G in gen_lengths:
        kw = dict(sampler="fast-dllm", cache="dual", gen_length=G, tokenizer=tok,
                  bucket=bucket)
        for m in (before, after):  # compile both first
            generate(m, prompts[:1], **kw)
        tally = {k: {"decode_s": 0.0, "wall_s": 0.0, "cpu_s": 0.0} for k in ("before", "after")}
        differ = 0
        for i, p in enumerate(prompts):
            order = [("before", before), ("after", after)]
            tokens = {}
            for name, m in (order if i % 2 == 0 else order[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                res = generate(m, [p], **kw)
                tally[name]["wall_s"] += time.perf_counter() - t0
                tally[name]["cpu_s"] += time.process_time() - c0
                tally[name]["decode_s"] += res.stats.decode_time
                tokens[name] = res.tokens
            differ += int((tokens["before"] != tokens["after"]).sum())
        row = {"gen_length": G, "problems": n, "batch": 1, "tokens_differing": differ,
               **{f"{k}_{name}": v for name, t in tally.items() for k, v in t.items()}}
        for k in ("decode_s", "wall_s", "cpu_s"):
            row[f"speedup_{k[:-2]}"] = row[f"{k}_before"] / row[f"{k}_after"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ------------------------------------------------------------------ tokens
# (model, sampler, options, problems, batch): the samplers whose tokens must not move.
TOKEN_CHECKS = (
    ("tiny-llada-v4b", "fast-dllm", {"cache": "dual"}, 500, 1),
    ("tiny-llada-v4b", "vanilla", {}, 100, 8),
    ("tiny-llada-v4b", "fast-dllm", {"cache": "prefix"}, 100, 8),
    ("tiny-llada-v4b", "fast-dllm", {"cache": "dual"}, 100, 8),
    ("tiny-llada-v4b", "localleap", {"cache": "dual"}, 100, 8),
    ("tiny-llada-v4b", "asynclane", {}, 100, 8),
    ("tiny-llada-v4b", "eb", {}, 100, 8),
    ("tiny-llada-v4b-d2f", "d2f", {}, 100, 8),
    ("tiny-dream-v4", "fast-dllm", {"cache": "dual"}, 100, 8),
    ("tiny-dream-v4", "asynclane", {}, 100, 8),
)


def token_checks(module, gen_length: int) -> list[dict]:
    """Each TOKEN_CHECKS row decoded by the before and the after model (the first n
    held-out v4 problems, in batches as given): the generated tokens and rows that
    differ."""
    rows, loaded = [], {}
    problems = tasks.split("heldout", max(c[3] for c in TOKEN_CHECKS), "v4")
    for name, sampler, options, n, batch in TOKEN_CHECKS:
        if name not in loaded:
            model, tok, _ = asynclane_jax.load(name)
            loaded[name] = (as_model(module, model), model, tok)
        before, after, tok = loaded[name]
        prompts = evaluate.prompts_for(problems[:n], tok)
        bucket = max(len(p) for p in prompts)
        tokens = {}
        for side, m in (("before", before), ("after", after)):
            tokens[side] = np.concatenate([
                generate(m, prompts[i:i + batch], sampler=sampler, gen_length=gen_length,
                         tokenizer=tok, bucket=bucket, **options).tokens
                for i in range(0, n, batch)])
        differ = tokens["before"] != tokens["after"]
        row = {"model": name, "sampler": sampler, "options": options, "problems": n,
               "batch": batch, "gen_length": gen_length,
               "tokens_differing": int(differ.sum()),
               "rows_differing": int(differ.any(axis=1).sum()), "tokens": int(differ.size)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ------------------------------------------------------------------ the 8B, scanned
# The scanned layout runs the last layer after the scan when logits are read at some
# rows only: one more layer body in the program. Its cost on a TPU slice, compiled
# ahead of time (no TPU needed, libtpu is), before and after.
AOT = ["aot", "--preset", "llada-8b-instruct", "--sampler", "fast-dllm", "--option",
       "cache=dual", "--gen-length", "512", "--batch", "8", "--prompt", "128",
       "--topology", "v5e:2x4", "--mesh", "data=1,tensor=8", "--scan-layers", "--json"]


def aot_compare(before: str) -> dict:
    """`asynclane-jax aot` of AOT in a worktree at `before` and in this tree."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "before"
        git("worktree", "add", "--detach", str(tree), before)
        try:
            for side, cwd in (("before", tree), ("after", ROOT)):
                out = subprocess.run([sys.executable, "-m", "asynclane_jax.cli", *AOT],
                                     cwd=cwd, capture_output=True, text=True, check=True)
                rows[side] = json.loads(out.stdout.strip().splitlines()[-1])
                print(side, json.dumps(rows[side]), flush=True)
        finally:
            git("worktree", "remove", "--force", str(tree))
    return {"command": "asynclane-jax " + " ".join(AOT), **rows}


# ------------------------------------------------------------------ report
CHANGES = ("trim", "attention", "rope")


def markdown(meta: dict, calls: list[dict], alone: list[dict], decode: list[dict],
             tokens: dict | None, aot: dict | None = None) -> str:
    out = ["# The full forward's cost on `tiny-llada-v4b`, before and after", "",
           f"Made by `{meta['command']}` at commit {meta['commit']} (before: "
           f"{meta['before']}), backend {meta['backend']} ({meta['machine']}, "
           f"{meta['cpus']} cores, shared with other work). Batch 1, prompt bucket "
           f"{PROMPT}: T = {PROMPT} + gen_length. Full forward: every column encoded, "
           f"its K/V written into the cache, logits read at {READ} columns; cached call: "
           f"{READ} queries against all T cached keys. Milliseconds per call, the median "
           f"over {meta['rounds']} alternating rounds of {meta['calls']} calls; CPU is "
           "this process's CPU time (the steadier figure on a shared machine).", "",
           "## One call", "",
           "| T | variant | full, wall | full, CPU | cached, wall | cached, CPU | "
           "full logits vs before (max abs diff) |",
           "|--:|---|--:|--:|--:|--:|--:|"]
    for r in calls:
        out.append(f"| {r['T']} | {r['variant']} | {r['full_wall_ms']:.2f} | "
                   f"{r['full_cpu_ms']:.2f} | {r['cached_wall_ms']:.2f} | "
                   f"{r['cached_cpu_ms']:.2f} | {r['full_logits_max_abs_diff']:.1e} |")
    out += ["", "What each change saves on its own (after without it, less after; CPU "
            "time), and before / after:", "",
            "| T | trim: full | attention: full | attention: cached | rope: full | "
            "rope: cached | before / after, full | before / after, cached |",
            "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for T in sorted({r["T"] for r in calls}):
        by = {r["variant"]: r for r in calls if r["T"] == T}
        a = by["after"]

        def saved(change, kind, by=by, a=a):
            return by[f"after without {change}"][f"{kind}_cpu_ms"] - a[f"{kind}_cpu_ms"]
        out.append(f"| {T} | {saved('trim', 'full'):.2f} ms | "
                   f"{saved('attention', 'full'):.2f} ms | "
                   f"{saved('attention', 'cached'):.2f} ms | {saved('rope', 'full'):.2f} ms | "
                   f"{saved('rope', 'cached'):.2f} ms | "
                   f"{by['before']['full_cpu_ms'] / a['full_cpu_ms']:.2f}x | "
                   f"{by['before']['cached_cpu_ms'] / a['cached_cpu_ms']:.2f}x |")
    out += ["", "The trim does nothing to a cached call (every query's logits are read).",
            "", "## Attention alone", "",
            f"One layer's attention on random q, k, v of the model's heads ({meta['heads']}), "
            "a [b, T] key mask, batch 1; milliseconds per call as above. "
            "The two variants of `_xla_attention` below it are choices measured and not "
            "kept.", "",
            "| T | queries | formulation | wall | CPU | max abs diff from jax's |",
            "|--:|--:|---|--:|--:|--:|"]
    for r in alone:
        out.append(f"| {r['T']} | {r['Q']} | {r['variant']} | {r['wall_ms']:.3f} | "
                   f"{r['cpu_ms']:.3f} | {r['max_abs_diff']:.1e} |")
    out += ["", "## Fast-dLLM, dual cache, batch 1", "",
            f"The first {decode[0]['problems']} held-out v4 problems, before and after in "
            "turn. decode: the driver's `decode_time` (the compiled loop); wall and CPU: "
            "each whole `generate` call. Seconds summed over the problems.", "",
            "| gen_length | decode before | decode after | speed-up | wall speed-up | "
            "CPU speed-up | generated tokens differing |",
            "|--:|--:|--:|--:|--:|--:|--:|"]
    for r in decode:
        out.append(f"| {r['gen_length']} | {r['decode_s_before']:.2f} | "
                   f"{r['decode_s_after']:.2f} | {r['speedup_decode']:.2f}x | "
                   f"{r['speedup_wall']:.2f}x | {r['speedup_cpu']:.2f}x | "
                   f"{r['tokens_differing']} |")
    if tokens:
        out += ["", "## Generated tokens, before and after", "",
                f"Made by `{tokens['command']}` at commit {tokens['commit']}. The first n "
                "held-out v4 problems, decoded by the before and the after model in "
                f"batches of the size given, gen_length {tokens['rows'][0]['gen_length']}, "
                "each sampler at its defaults but the options named.", "",
                "| model | sampler | options | problems | batch | tokens | tokens differing "
                "| problems differing |", "|---|---|---|--:|--:|--:|--:|--:|"]
        for r in tokens["rows"]:
            opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"
            out.append(f"| {r['model']} | {r['sampler']} | {opts} | {r['problems']} | "
                       f"{r['batch']} | {r['tokens']} | {r['tokens_differing']} | "
                       f"{r['rows_differing']} |")
    if aot:
        gib = 2 ** 30
        out += ["", "## LLaDA-8B, scanned layers, compiled for a TPU slice", "",
                f"Made by `{aot['made_by']}` at commit {aot['commit']}: "
                f"`{aot['command']}` run in a worktree at {aot['before']} and in this tree "
                "(ahead of time, no TPU). The last layer, run after the scan on the read "
                "rows, is a second layer body in the program.", "",
                "| | temporaries GiB | code GiB | peak GiB | all-reduces | all-gathers | "
                "compile s |", "|---|--:|--:|--:|--:|--:|--:|"]
        for side in ("before", "after"):
            r = aot[side]
            out.append(f"| {side} | {r['temp_bytes'] / gib:.3f} | {r['code_bytes'] / gib:.4f} "
                       f"| {r['peak_bytes'] / gib:.3f} | {r['collectives']['all-reduce']} | "
                       f"{r['collectives']['all-gather']} | {r['compile_s']:.0f} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="c50297f", help="the commit of the before model")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--gen-lengths", default="256,512")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--aot", action="store_true",
                    help="only the 8B scanned TPU compile, before and after (AOT), added to "
                         "the results of an earlier run")
    ap.add_argument("--tokens", action="store_true",
                    help="only the token checks (TOKEN_CHECKS, at gen_length 512), added to "
                         "the results of an earlier run")
    args = ap.parse_args()
    command = " ".join(["python experiments/full_forward_cost.py", *sys.argv[1:]])
    dirty = bool(git("status", "--porcelain", "--", "asynclane_jax/models/model.py"))
    commit = git("rev-parse", "--short", "HEAD") + (" (model.py modified)" if dirty else "")
    module = before_module(args.before)
    out_json = RESULTS / "full_forward_cost.json"
    if args.tokens or args.aot:
        data = json.loads(out_json.read_text())
        if args.tokens:
            data["tokens"] = {"command": command, "commit": commit, "before": args.before,
                              "rows": token_checks(module, 512)}
        if args.aot:
            data["aot"] = {"made_by": command, "commit": commit, "before": args.before,
                           **aot_compare(args.before)}
        out_json.write_text(json.dumps(data, indent=1) + "\n")
        (RESULTS / "full_forward_cost.md").write_text(markdown(
            data["meta"], data["calls"], data["attention"], data["decode"],
            data.get("tokens"), data.get("aot")))
        print(f"wrote {out_json}")
        return
    gen_lengths = [int(g) for g in args.gen_lengths.split(",")]
    model, tok, cfg = asynclane_jax.load(MODEL)
    before = as_model(module, model)
    variants = {"before": (before, None), "after": (model, None),
                **{f"after without {c}": (model, c) for c in CHANGES}}
    calls = call_costs(variants, cfg, [PROMPT + g for g in gen_lengths], args.rounds,
                       args.calls)
    alone = attention_alone(cfg, [(T, q) for T in (PROMPT + g for g in gen_lengths)
                                  for q in (T, READ)], args.rounds, args.calls)
    decode = [] if args.skip_decode else decode_speed(before, model, tok, args.problems,
                                                       gen_lengths)
    meta = {"command": command, "commit": commit,
            "before": args.before, "backend": jax.default_backend(),
            "machine": platform.machine(), "cpus": len(os.sched_getaffinity(0)),
            "rounds": args.rounds, "calls": args.calls,
            "model": MODEL, "jax": jax.__version__,
            "heads": f"{cfg.n_heads} query, {cfg.n_kv_heads} K/V heads of {cfg.head_dim}"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(
        {"meta": meta, "calls": calls, "attention": alone, "decode": decode}, indent=1) + "\n")
    if decode:
        (RESULTS / "full_forward_cost.md").write_text(markdown(meta, calls, alone, decode,
                                                               None))
    print(f"wrote {out_json}")


if __name__ == "__main__":
    main()
