"""Trains the Early-Bird routers (LBS, LPS) of a shipped testbed model and ships them.

  python experiments/train_eb.py --model tiny-llada [--gen-length N] [--problems 1024]

  The problems come from the model's own task set (the one its folder records); the
  generation length defaults to 256, or 512 for a task set with long answers.

  1. traces without LBS (every block the first 32 masked positions, commit at p >= 0.9
     else top-1) on training-split problems -> LBS data: per generated position its
     entropy, top-1 and the reference token's cross-entropy;
  2. the LBS router, trained on 80% of the problems (loss mean s*CE - mean s, by default
     over the masked positions whose top-1 is not end-of-text, and at a shape sized to
     the testbed's 64-wide models: --lbs-positions, --lbs-shape);
  3. traces with the trained LBS (its variable-length blocks, commits as in 1) -> LPS
     data: the block's masked positions, label "top-1 == the final token";
  4. the LPS router (weighted BCE, negatives x2), tau_psi set on the other 20% at <= 1%
     false positives among the positions below the 0.9 threshold;
  5. the weights written beside the model (<model folder>/routers/), the routers' cost
     per call measured against the model's, held-out accuracy of `eb` on a few problems.

Writes experiments/results/baselines/eb_<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import asynclane_jax as aj
from asynclane_jax import checkpoint
from asynclane_jax.decoding import eb_routers as ER
from asynclane_jax.decoding import generate
from asynclane_jax.decoding.early_bird import EarlyBirdSchedule
from asynclane_jax.testbed import evaluate as ev
from asynclane_jax.testbed import routers as R
from asynclane_jax.testbed import tasks

RESULTS = pathlib.Path(__file__).parent / "results" / "baselines"


def tau_note(t: dict) -> str:
    """What set tau_psi: how many negatives the false-positive bound let pass (none when
    there are fewer than 1 / max_fpr of them: tau_psi is then the highest negative's
    p_psi, and the true-positive rate is the share of positives scoring above that one
    position)."""
    allowed = int(math.floor(t["max_fpr"] * t["n_neg"]))
    if allowed:
        return (f"The bound lets {allowed} of the {t['n_neg']} negatives pass: tau_psi is "
                f"the p_psi of the negative ranked {allowed + 1}.")
    return (f"With {t['n_neg']} negatives the bound ({t['max_fpr']:g}) lets none pass, so "
            "tau_psi is the p_psi of the single highest-scoring negative, and the "
            "true-positive rate is the share of positives scoring above that one position.")


def median_ms(fn, *args, repeats: int = 30) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def router_cost(model, weights: ER.RouterWeights, gen_length: int, prompt_len: int) -> dict:
    """Median ms per call at batch 1: the model's full forward over the canvas, the LBS
    router over the generation region, the LPS router over it (attention restricted to
    a 32-position block)."""
    from flax import nnx

    graphdef, params = nnx.split(model)
    T = prompt_len + gen_length
    tokens = jnp.full((1, T), model.cfg.mask_token_id, jnp.int32)
    idx = jnp.arange(prompt_len, T, dtype=jnp.int32)[None]
    fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, logits_index=idx))
    lbs = jax.jit(lambda e, t: weights.lbs_module()(e, t))
    lps = jax.jit(lambda f, m: weights.lps_module()(f, m))
    ent = jnp.full((1, gen_length), 0.5, jnp.float32)
    top1 = jnp.zeros((1, gen_length), jnp.int32)
    feats = jnp.full((1, gen_length, ER.N_LPS_FEATURES), 0.5, jnp.float32)
    mask = jnp.arange(gen_length)[None] < 32
    return {"forward_ms": median_ms(fwd, params, tokens), "lbs_ms": median_ms(lbs, ent, top1),
            "lps_ms": median_ms(lps, feats, mask)}


def decode_share(model, problems, gen_length: int, weights_folder) -> dict:
    """Seconds per loop iteration of `eb` with its routers and without them (lbs=false,
    lps=false: the same loop, the routers' work left out), batch 1; the routers' share
    of an iteration is 1 - without/with."""
    prompts = ev.prompts_for(problems)
    bucket = max(len(p) for p in prompts)
    out = {}
    for tag, opts in (("with", {"routers": str(weights_folder)}),
                      ("without", {"lbs": False, "lps": False})):
        generate(model, prompts[:1], sampler="eb", gen_length=gen_length, bucket=bucket,
                 **opts)  # compile
        secs = steps = blocks = 0
        for p in prompts:
            r = generate(model, [p], sampler="eb", gen_length=gen_length, bucket=bucket,
                         **opts)
            secs += r.stats.decode_time
            steps += r.stats.steps
            blocks += int(r.stats.row_blocks[0])
        out[tag] = {"s_per_iteration": secs / steps, "iterations_per_problem": steps / len(prompts),
                    "blocks_per_problem": blocks / len(prompts)}
    out["router_share_of_iteration"] = 1 - (out["without"]["s_per_iteration"]
                                            / out["with"]["s_per_iteration"])
    return out


def parse_shape(text: str) -> dict:
    """'d_model=32,ffn=64' -> {'d_model': 32, 'ffn': 64}; only LBSConfig's shape fields."""
    allowed = {"d_feat", "d_model", "n_heads", "ffn", "n_layers"}
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in allowed or not v.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} is not one of {sorted(allowed)}=INT")
        out[k.strip()] = int(v)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--gen-length", type=int, default=None,
                    help="default: 256, or 512 for a model trained on long answers")
    ap.add_argument("--problems", type=int, default=1024, help="training-split problems traced")
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--trace-batch", type=int, default=64)
    ap.add_argument("--lbs-steps", type=int, default=1200)
    ap.add_argument("--lps-steps", type=int, default=1500)
    ap.add_argument("--max-fpr", type=float, default=0.01)
    ap.add_argument("--eval-n", type=int, default=100, help="held-out problems for a check")
    ap.add_argument("--cost-n", type=int, default=20, help="held-out problems, batch 1, "
                    "for the routers' share of an iteration")
    ap.add_argument("--routers-to", default=None,
                    help="folder to write routers/ into (default: the model's own folder)")
    ap.add_argument("--results", default=str(RESULTS), help="folder of the result files")
    ap.add_argument("--lbs-positions", choices=("text", "all"), default="text",
                    help="LBS loss over masked positions whose top-1 is not end-of-text "
                    "(text: the only possible candidates) or over all masked positions "
                    "(all: the paper's)")
    ap.add_argument("--lbs-shape", type=parse_shape, default="d_feat=16,d_model=32,ffn=64",
                    help="LBS router shape, LBSConfig fields as k=v,... ('' for the "
                    "paper's: d_feat 64, d_model 128, ffn 256)")
    ap.add_argument("--trace-cache", default=None,
                    help="folder keeping the first round of traces between runs")
    args = ap.parse_args(argv)

    t_start = time.time()
    log = lambda *a: print(f"[{time.time() - t_start:7.1f}s]", *a, flush=True)
    folder = checkpoint.resolve(args.model)
    model, _, cfg = aj.load(args.model)
    task_set = tasks.model_task_set(args.model)
    G = args.gen_length or tasks.default_gen_length(task_set)
    problems = tasks.split("train", args.problems, task_set)
    n_val = int(round(args.val_frac * len(problems)))
    first_val = len(problems) - n_val
    bar = lambda done, total: log(f"  traced {done}/{total}")

    # 1. traces without LBS.
    t0 = time.time()
    base = EarlyBirdSchedule(gen_length=G, lbs=False, lps=False)
    cached = pathlib.Path(args.trace_cache) / f"traces1_{args.model}_{G}_{len(problems)}.npz" \
        if args.trace_cache else None
    if cached is not None and cached.is_file():
        with np.load(cached) as f:
            tr1 = {k: f[k] for k in f.files}
        trace1_s = float(tr1.pop("seconds"))
    else:
        tr1 = R.decode_traces(model, problems, base, batch=args.trace_batch, progress=bar)
        trace1_s = time.time() - t0
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            np.savez(cached, seconds=trace1_s, **tr1)
    log(f"traces 1: {len(tr1['problem'])} rows, {trace1_s:.0f}s, "
        f"accuracy {tr1['correct'].mean():.3f}, steps/problem {tr1['steps'].mean():.1f}")
    train1 = np.nonzero(tr1["problem"] < first_val)[0]
    val1 = np.nonzero(tr1["problem"] >= first_val)[0]

    # 2. LBS.
    t0 = time.time()
    embedding = np.asarray(model.embed[...])
    lbs_tc = R.RouterTrainConfig(steps=args.lbs_steps, batch=32, lr=1e-3)
    lbs, lbs_hist = R.train_lbs(embedding, tr1, train1, lbs_tc, log=lambda h: log("LBS", h),
                                eos_id=cfg.eos_token_id if args.lbs_positions == "text" else None,
                                shape=args.lbs_shape)
    lbs_s = time.time() - t0
    lbs_val = R.evaluate_lbs(lbs, tr1, val1, eos_id=cfg.eos_token_id)
    log(f"LBS: {lbs_s:.0f}s, validation {lbs_val}")

    # 3. traces with LBS.
    t0 = time.time()
    with_lbs = EarlyBirdSchedule(gen_length=G, lbs=True, lps=False)
    tr2 = R.decode_traces(model, problems, with_lbs, weights=ER.RouterWeights.from_modules(lbs=lbs),
                          batch=args.trace_batch, seed=1, progress=bar)
    trace2_s = time.time() - t0
    log(f"traces 2: {len(tr2['problem'])} rows, {trace2_s:.0f}s, "
        f"accuracy {tr2['correct'].mean():.3f}, steps/problem {tr2['steps'].mean():.1f}")
    train2 = np.nonzero(tr2["problem"] < first_val)[0]
    val2 = np.nonzero(tr2["problem"] >= first_val)[0]

    # 4. LPS and tau_psi.
    t0 = time.time()
    lps_tc = R.RouterTrainConfig(steps=args.lps_steps, batch=64, lr=2e-3)
    lps, lps_hist = R.train_lps(tr2, train2, lps_tc, log=lambda h: log("LPS", h))
    lps_s = time.time() - t0
    val_arrays = R.lps_arrays(tr2, val2)
    p_val = R.lps_probabilities(lps, val_arrays)
    tau = R.choose_tau(p_val, val_arrays["label"], val_arrays["mask"], val_arrays["conf"],
                       threshold=with_lbs.threshold, max_fpr=args.max_fpr)
    m = val_arrays["mask"]
    tau["label_positive_share"] = float(val_arrays["label"][m].mean())
    log(f"LPS: {lps_s:.0f}s, tau {tau}")

    train_minutes = (trace1_s + lbs_s + trace2_s + lps_s) / 60
    meta = {
        "method": "EB-Decode (arXiv 2609.16450) routers",
        "model": args.model, "gen_length": G, "tau_psi": tau["tau_psi"],
        "tau_selection": dict(tau, max_fpr=args.max_fpr, split="validation problems",
                              counted="block positions below threshold 0.9"),
        "train_problems": first_val, "validation_problems": n_val,
        "lbs_train": dict(vars(lbs_tc), history=lbs_hist, validation=lbs_val,
                          positions=args.lbs_positions,
                          shape=dataclasses.asdict(lbs.cfg)),
        "lps_train": dict(vars(lps_tc), history=lps_hist),
        "training_minutes": round(train_minutes, 2),
    }
    weights = ER.RouterWeights.from_modules(lbs=lbs, lps=lps, meta=meta)
    out_dir = ER.save_routers(args.routers_to or folder, weights)
    log(f"saved {out_dir} ({weights.digest}); training minutes {train_minutes:.1f}")

    # 5. cost and a held-out check.
    heldout = tasks.heldout(max(args.eval_n, args.cost_n), task_set)
    P = max(len(p) for p in ev.prompts_for(heldout))
    P = -(-P // 32) * 32
    cost = router_cost(model, weights, G, P)
    cost["lbs_share_when_run"] = cost["lbs_ms"] / (cost["forward_ms"] + cost["lbs_ms"]
                                                   + cost["lps_ms"])
    cost["lps_share"] = cost["lps_ms"] / (cost["forward_ms"] + cost["lps_ms"])
    cost["decode"] = decode_share(model, heldout[:args.cost_n], G, out_dir)
    log(f"cost {cost}")
    check = ev.evaluate(model, sampler="eb", gen_length=G, n=args.eval_n, batch_size=50,
                        routers=str(out_dir), task_set=task_set)
    log(f"held-out eb: accuracy {check['accuracy']:.3f} on {check['n']}, "
        f"calls/token {check['nfe_per_token']:.3f}")

    result = {
        "model": args.model, "task_set": task_set, "gen_length": G,
        "backend": jax.default_backend(),
        "trace_problems": len(problems), "validation_problems": n_val,
        "trace_rows": {"lbs": int(len(tr1["problem"])), "lps": int(len(tr2["problem"]))},
        "trace_accuracy": {"without_lbs": float(tr1["correct"].mean()),
                           "with_lbs": float(tr2["correct"].mean())},
        "trace_steps_per_problem": {"without_lbs": float(tr1["steps"].mean()),
                                    "with_lbs": float(tr2["steps"].mean())},
        "seconds": {"traces_without_lbs": round(trace1_s, 1), "lbs_training": round(lbs_s, 1),
                    "traces_with_lbs": round(trace2_s, 1), "lps_training": round(lps_s, 1)},
        "training_minutes": round(train_minutes, 2),
        "lbs_positions": args.lbs_positions, "lbs_shape": dataclasses.asdict(lbs.cfg),
        "lbs_validation": lbs_val, "tau": tau, "router_cost": cost,
        "heldout_check": {k: check[k] for k in ("n", "accuracy", "nfe_per_token",
                                                 "nfe_per_row", "tps")},
        "router_digest": weights.digest, "router_folder": str(out_dir),
    }
    results = pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"eb_{args.model}.json").write_text(json.dumps(result, indent=1) + "\n")
    (results / f"eb_{args.model}.md").write_text(markdown(result))
    log("done")


def markdown(r: dict) -> str:
    c, t, d = r["router_cost"], r["tau"], r["router_cost"]["decode"]
    lv = r["lbs_validation"]
    lines = [
        f"# Early-Bird routers on `{r['model']}`",
        "",
        f"Backend {r['backend']}; generation length {r['gen_length']}; "
        f"{r['trace_problems']} training-split problems traced "
        f"({r['validation_problems']} held back for validation). "
        "Written by experiments/train_eb.py.",
        "",
        "## Training cost (minutes on this machine)",
        "",
        "| traces without LBS | LBS training | traces with LBS | LPS training | total |",
        "|---|---|---|---|---|",
        "| " + " | ".join(f"{r['seconds'][k] / 60:.1f}" for k in
                         ("traces_without_lbs", "lbs_training", "traces_with_lbs",
                          "lps_training")) + f" | {r['training_minutes']:.1f} |",
        "",
        f"Trace decodes: accuracy {r['trace_accuracy']['without_lbs']:.3f} without LBS, "
        f"{r['trace_accuracy']['with_lbs']:.3f} with it; steps per problem "
        f"{r['trace_steps_per_problem']['without_lbs']:.1f} and "
        f"{r['trace_steps_per_problem']['with_lbs']:.1f}.",
        "",
        "## LBS (validation)",
        "",
        f"Shape: d_feat {r['lbs_shape']['d_feat']}, d_model {r['lbs_shape']['d_model']}, "
        f"{r['lbs_shape']['n_layers']} layers of {r['lbs_shape']['n_heads']} heads and FFN "
        f"{r['lbs_shape']['ffn']} (the paper's: 64, 128, 2 x 4, 256). Loss taken over "
        + ("the masked positions whose top-1 is not end-of-text (the candidates)."
           if r["lbs_positions"] == "text" else "all masked positions (the paper's).")
        + " The figures below count all masked positions, then the candidates alone.",
        "",
        f"Loss {lv['loss']:.3f} (oracle {lv['oracle_loss']:.3f}: select exactly the positions "
        f"with CE < 1). Selected (p > 0.5) {lv['selected_share']:.1%} of masked positions, "
        f"ready (CE < 1) {lv['ready_share']:.1%}; precision {lv['precision']:.3f}, recall "
        f"{lv['recall']:.3f}. Among masked positions whose top-1 is not end-of-text (the "
        f"only possible candidates; {lv['text_share']:.1%} of masked positions): selected "
        f"{lv['selected_share_text']:.1%}, ready {lv['ready_share_text']:.1%}, precision "
        f"{lv['precision_text']:.3f}, recall {lv['recall_text']:.3f}.",
        "",
        "## LPS and tau_psi (validation)",
        "",
        f"Counted: block positions below the 0.9 threshold ({t['n_pos']} positive, "
        f"{t['n_neg']} negative). tau_psi = {t['tau_psi']:.4f}: false-positive rate "
        f"{t['fpr']:.4f}, true-positive rate {t['tpr']:.3f}, precision {t['precision']:.3f}; "
        f"it commits {t['extra_commits']:.1%} of those positions beyond the threshold rule. "
        + tau_note(t),
        "",
        "## Router cost (batch 1, median ms per call)",
        "",
        "| model forward | LBS | LPS | LBS share when it runs | LPS share |",
        "|---|---|---|---|---|",
        f"| {c['forward_ms']:.2f} | {c['lbs_ms']:.2f} | {c['lps_ms']:.2f} | "
        f"{c['lbs_share_when_run']:.1%} | {c['lps_share']:.1%} |",
        "",
        f"In the decode loop ({r['router_cost']['decode']['with']['iterations_per_problem']:.1f} "
        f"iterations and {d['with']['blocks_per_problem']:.1f} LBS runs per problem): "
        f"{1e3 * d['with']['s_per_iteration']:.2f} ms per iteration with the routers, "
        f"{1e3 * d['without']['s_per_iteration']:.2f} ms without (lbs=false lps=false); "
        f"the routers' share of an iteration: {d['router_share_of_iteration']:.1%}.",
        "",
        f"Held-out check: `eb` accuracy {r['heldout_check']['accuracy']:.3f} on "
        f"{r['heldout_check']['n']} problems, {r['heldout_check']['nfe_per_token']:.3f} "
        "calls per token.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
