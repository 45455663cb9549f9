"""int8 weight-only quantization against full precision on the tiny models, per sampler.

    python experiments/quantize_tiny.py --n 200 --gen-length 128 \\
        --out experiments/results/checkpoint/quantize_tiny.json

For each model (tiny-llada, tiny-dream) and sampler, the first n held-out problems are
decoded twice with the same prompts, seed and options: once by the model as stored
(float32) and once by `load(..., quantize="int8")` (int8 linear layers, one scale per
output channel; asynclane_jax.models.quantize). Reported per sampler:

  rows_identical  the fraction of rows whose generated tokens are all the same;
  token_agreement the fraction of generated positions holding the same token;
  accuracy        exact-match accuracy of each (testbed.tasks.check), and the difference;
  kl              mean KL(full || int8) of the next-token distributions, in nats, at the
                  generated positions of the full-precision decode's final canvas with
                  every other generated position masked again (a half-denoised canvas),
                  with the argmax agreement at those positions.

Writes JSON (with the command) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import asynclane_jax
from asynclane_jax.testbed import tasks
from asynclane_jax.testbed.evaluate import prompts_for

SAMPLERS = ("vanilla", "fast-dllm", "asynclane")


def decode(model, tok, prompts, sampler, gen_length, batch):
    rows, times = [], 0.0
    bucket = max(len(p) for p in prompts)
    for s in range(0, len(prompts), batch):
        res = asynclane_jax.generate(model, prompts[s:s + batch], sampler=sampler,
                                     gen_length=gen_length, tokenizer=tok, bucket=bucket)
        rows.append(res.tokens)
        times += res.stats.decode_time
    return np.concatenate(rows), bucket, times


def logit_kl(full, int8, prompts, tokens, bucket, cfg, batch):
    """Mean KL(full || int8) and argmax agreement at re-masked generated positions."""
    kls, agree, count = 0.0, 0, 0
    for s in range(0, len(prompts), batch):
        ps, gen = prompts[s:s + batch], tokens[s:s + batch]
        canvas = np.full((len(ps), bucket + gen.shape[1]), cfg.mask_token_id, np.int32)
        key_mask = np.ones_like(canvas, bool)
        for i, p in enumerate(ps):
            canvas[i, :bucket - len(p)] = cfg.pad_token_id
            canvas[i, bucket - len(p):bucket] = p
            key_mask[i, :bucket - len(p)] = False
        masked = np.zeros(gen.shape, bool)
        masked[:, ::2] = True  # every other generated position masked again
        canvas[:, bucket:] = np.where(masked, cfg.mask_token_id, gen)
        positions = np.maximum(0, np.cumsum(key_mask, axis=1) - 1).astype(np.int32)
        args = dict(positions=jnp.asarray(positions), key_mask=jnp.asarray(key_mask))
        # Dream's logits at column i predict token i + 1 (its logit shift).
        cols = slice(bucket - 1, -1) if cfg.logit_shift else slice(bucket, None)
        a = jax.nn.log_softmax(full(jnp.asarray(canvas), **args)[:, cols])
        b = jax.nn.log_softmax(int8(jnp.asarray(canvas), **args)[:, cols])
        kl = (jnp.exp(a) * (a - b)).sum(-1)
        m = jnp.asarray(masked)
        kls += float((kl * m).sum())
        agree += int(((a.argmax(-1) == b.argmax(-1)) & m).sum())
        count += int(m.sum())
    return kls / count, agree / count


def run_model(name, samplers, n, gen_length, batch):
    full, tok, cfg = asynclane_jax.load(name)
    int8, _, _ = asynclane_jax.load(name, quantize="int8")
    problems = tasks.split("heldout", n)
    prompts = prompts_for(problems, tok)
    rows = []
    for sampler in samplers:
        t0 = time.perf_counter()
        a, bucket, ta = decode(full, tok, prompts, sampler, gen_length, batch)
        b, _, tb = decode(int8, tok, prompts, sampler, gen_length, batch)
        ok_a = [tasks.check(p, r) for p, r in zip(problems, a)]
        ok_b = [tasks.check(p, r) for p, r in zip(problems, b)]
        kl, top1 = logit_kl(full, int8, prompts, a, bucket, cfg, batch)
        row = {"model": name, "sampler": sampler, "n": n, "gen_length": gen_length,
               "rows_identical": float(np.mean(np.all(a == b, axis=1))),
               "token_agreement": float(np.mean(a == b)),
               "accuracy_full": float(np.mean(ok_a)), "accuracy_int8": float(np.mean(ok_b)),
               "accuracy_diff_points": 100 * (float(np.mean(ok_b)) - float(np.mean(ok_a))),
               "kl": kl, "argmax_agreement": top1,
               "decode_s_full": ta, "decode_s_int8": tb,
               "wall_s": time.perf_counter() - t0}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows, meta) -> str:
    head = ("| model | sampler | rows | rows identical | token agreement | accuracy full | "
            "accuracy int8 | diff (points) | KL (nats) | argmax agreement |\n"
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|\n")
    body = "".join(
        f"| {r['model']} | {r['sampler']} | {r['n']} | {100 * r['rows_identical']:.1f}% | "
        f"{100 * r['token_agreement']:.2f}% | {100 * r['accuracy_full']:.1f}% | "
        f"{100 * r['accuracy_int8']:.1f}% | {r['accuracy_diff_points']:+.1f} | "
        f"{r['kl']:.2e} | {100 * r['argmax_agreement']:.2f}% |\n" for r in rows)
    return (f"# int8 weight-only against full precision on the tiny models\n\n"
            f"Command: `{meta['command']}` ({meta['machine']}, jax {meta['jax']}).\n"
            f"Held-out problems, gen_length {meta['gen_length']}, each sampler at its "
            f"defaults; definitions in experiments/quantize_tiny.py.\n\n" + head + body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-llada,tiny-dream")
    p.add_argument("--samplers", default=",".join(SAMPLERS))
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--out", default="experiments/results/checkpoint/quantize_tiny.json")
    args = p.parse_args(argv)
    meta = {"command": "python experiments/quantize_tiny.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "machine": f"{platform.machine()}, {jax.default_backend()}",
            "jax": jax.__version__, "gen_length": args.gen_length, "n": args.n}
    rows = []
    for name in args.models.split(","):
        rows += run_model(name.strip(), [s.strip() for s in args.samplers.split(",")],
                          args.n, args.gen_length, args.batch)
        out = pathlib.Path(args.out)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
