"""Training Early-Bird's two routers (EB-Decode, arXiv 2609.16450): losses, decode
traces of the frozen model, optax training loops and the choice of tau_psi. The router
modules, their features, save and load are `asynclane_jax.decoding.eb_routers`.

Losses. LBS (the paper's): mean sigmoid(O_i) * CE_i minus mean sigmoid(O_i) over masked
positions, CE_i the frozen model's cross-entropy of the reference token: selecting a
position pays its CE and earns 1, so the optimum selects exactly the positions with
CE < 1 (probability of the right token > 1/e). LPS: weighted binary cross-entropy,
negatives counted twice (a wrong early commit costs more than a late one).

Traces (`decode_traces`): the frozen model decodes training-split problems with the
`eb` schedule through the decode driver's own step (`driver.build_loop`'s `tap`, with
`EarlyBirdSchedule.decide` in place of its update) under a conservative rule (no LPS:
commit at probability >= 0.9, else the top-1), one full forward per step, batch by
batch. Each step records, per generated position, the LBS inputs (normalised entropy,
top-1 id, masked), the cross-entropy of the reference token (response, then
end-of-text), and for the block's masked positions the LPS features and the step's
top-1. After the decode, a position's LPS label is whether that top-1 equals the final
token. Two rounds: without LBS (every block is the fallback of 32 positions: the block
decoding the LBS learns to improve on) for LBS data, then with the trained LBS for LPS
data, so LPS sees the variable-length blocks it will decide in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from asynclane_jax.decoding import driver
from asynclane_jax.decoding.api import build_canvas
from asynclane_jax.decoding.eb_routers import (
    LBSConfig,
    LBSRouter,
    LPSConfig,
    LPSRouter,
    RouterError,
    RouterWeights,
)
from asynclane_jax.testbed import tasks
from asynclane_jax.testbed import tokenizer as tok

# ----------------------------------------------------------------------------- losses

def lbs_loss(logits_o, ce, masked):
    """mean sigmoid(O) * CE - mean sigmoid(O) over masked positions (the paper's)."""
    m = masked.astype(jnp.float32)
    s = jax.nn.sigmoid(logits_o)
    n = jnp.maximum(jnp.sum(m), 1.0)
    return jnp.sum(s * ce * m) / n - jnp.sum(s * m) / n


def lps_loss(logits_psi, labels, mask, negative_weight: float = 2.0):
    """Binary cross-entropy over the block's masked positions, negatives weighted."""
    m = mask.astype(jnp.float32)
    y = labels.astype(jnp.float32)
    bce = optax.sigmoid_binary_cross_entropy(logits_psi, y)
    w = m * jnp.where(labels, 1.0, negative_weight)
    return jnp.sum(w * bce) / jnp.maximum(jnp.sum(m), 1.0)


# ----------------------------------------------------------------------------- traces

def reference_tokens(problems, gen_length: int) -> np.ndarray:
    """[n, G] the reference generation of each problem: response, then end-of-text."""
    eos = tok.special_ids()["eos_token_id"]
    out = np.full((len(problems), gen_length), eos, np.int32)
    for i, p in enumerate(problems):
        resp = tok.encode(p.response)[:gen_length]
        out[i, :len(resp)] = resp
    return out


def decode_traces(model, problems, schedule, *, weights: RouterWeights | None = None,
                  batch: int = 64, seed: int = 0, progress=None) -> dict:
    """Decodes problems with the `eb` schedule and records what the routers read.

    Each iteration is the decode driver's own step (`driver.build_loop` with a `tap`):
    the same call, positions, key mask and output targets as `generate`.

    Args:
      model: the frozen DiffusionLM.
      problems: testbed Problems (training split).
      schedule: an EarlyBirdSchedule (its lbs/lps switches say which routers run).
      weights: RouterWeights for the routers the schedule runs (None: none run).
      batch: rows per decode.
      seed: PRNG seed.
      progress: optional callback(done_rows, total_rows).
    Returns:
      dict of numpy arrays, one entry per recorded (row, step) that served the row:
        problem [N] int, step [N] int;
        lbs_entropy [N, G] float16, lbs_top1 [N, G] int16, masked [N, G] bool,
        ce [N, G] float16 (the reference token's cross-entropy);
        lps_features [N, G, 5] float16, block_masked [N, G] bool, conf [N, G]
        float16, label [N, G] bool (the step's top-1 equals the final token);
      and per problem: correct [n] bool (the decode's answer is right), steps [n].
    """
    if weights is not None:
        schedule = schedule.with_weights(weights)
    operands = schedule.operands()
    G = schedule.gen_length
    graphdef, params = nnx.split(model)
    prompts = [tok.prompt_ids(p.prompt) for p in problems]
    bucket = max(len(p) for p in prompts)
    refs = reference_tokens(problems, G)
    keys = ("lbs_entropy", "lbs_top1", "masked", "ce", "lps_features", "block_masked",
            "conf", "x0")
    small = {"lbs_entropy": np.float16, "ce": np.float16, "conf": np.float16,
             "lps_features": np.float16, "lbs_top1": np.int16, "x0": np.int16}
    records: dict[str, list] = {k: [] for k in (*keys, "problem", "step", "final")}
    correct = np.zeros(len(problems), bool)
    steps = np.zeros(len(problems), np.int32)

    def loop(params, canvas, pad_len, rng, operands, ref=None):
        def tap(ctx, canvas, state, out, key):
            canvas, state, info = schedule.decide(ctx, canvas, state, out, key)
            rec = {k: info[k] for k in keys if k != "ce"}
            rec["ce"] = optax.softmax_cross_entropy_with_integer_labels(info["logits"], ref)
            rec["serve"] = out.serve
            return canvas, state, rec

        live = jnp.ones(canvas.shape[:1], bool)
        return driver.build_loop(graphdef, params, canvas, pad_len, live, rng, operands,
                                 schedule=schedule, tap=tap)

    init = jax.jit(lambda *a: loop(*a)[0])
    step = jax.jit(lambda st, *a: loop(*a)[1](st))
    running = jax.jit(lambda st, *a: loop(*a)[2](st))

    rng = jax.random.key(seed)
    for start in range(0, len(problems), batch):
        canvas, pad_len, P = build_canvas(prompts[start:start + batch], G, model.cfg, bucket)
        args = (params, jnp.asarray(canvas), jnp.asarray(pad_len), rng, operands)
        ref = jnp.asarray(refs[start:start + batch])
        st = init(*args)
        rows = []
        while bool(running(st, *args)):
            it = int(st.step)
            st, rec = step(st, *args, ref)
            rows.append((it, np.asarray(rec.pop("serve")), rec))
        final = np.asarray(st.canvas)[:, P:]
        for it, live, rec in rows:
            idx = np.nonzero(live)[0]
            rec = jax.device_get(rec)
            for k in keys:
                records[k].append(rec[k][idx].astype(small.get(k, rec[k].dtype)))
            records["problem"].append(start + idx)
            records["step"].append(np.full(len(idx), it))
            records["final"].append(final[idx].astype(np.int16))
            steps[start + idx] += 1
        for i, p in enumerate(problems[start:start + batch]):
            correct[start + i] = tasks.check(p, final[i])
        if progress is not None:
            progress(min(start + batch, len(problems)), len(problems))
    out = {k: np.concatenate(v) for k, v in records.items()}
    out["label"] = out.pop("x0") == out.pop("final")
    out["correct"], out["steps"] = correct, steps
    return out


# ----------------------------------------------------------------------------- training

@dataclasses.dataclass
class RouterTrainConfig:
    """Settings of one router training (saved with the weights)."""

    steps: int = 1500
    batch: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    negative_weight: float = 2.0  # LPS: a negative counts this many times
    seed: int = 0


def _optimizer(tc: RouterTrainConfig):
    warmup = min(tc.warmup_steps, tc.steps // 10)
    lr = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(tc.steps, warmup + 1),
                                            end_value=0.05 * tc.lr)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(lr, weight_decay=tc.weight_decay))


def _fit(module, loss_fn, arrays: dict, tc: RouterTrainConfig, *, log=None,
         log_every: int = 250) -> list[dict]:
    """Trains a module's Params (not its frozen variables) on minibatches drawn from
    `arrays` (dict of [N, ...] numpy arrays) with AdamW; loss_fn(module, batch)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    tx = _optimizer(tc)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(tc.seed)
    n = len(next(iter(arrays.values())))
    history, running, t0 = [], [], time.time()
    for i in range(tc.steps):
        idx = rng.integers(0, n, tc.batch)
        params, opt_state, loss = step(params, opt_state,
                                       {k: jnp.asarray(v[idx]) for k, v in arrays.items()})
        running.append(float(loss))
        if (i + 1) % log_every == 0 or i + 1 == tc.steps:
            history.append({"step": i + 1, "loss": float(np.mean(running)),
                            "seconds": round(time.time() - t0, 1)})
            running = []
            if log is not None:
                log(history[-1])
    nnx.update(module, params)
    return history


def lbs_arrays(traces: dict, rows, eos_id: int | None = None) -> dict:
    """The LBS training arrays of the given trace rows (float32 / int32). With eos_id,
    `masked` keeps only the masked positions whose top-1 is not end-of-text (the only
    ones that can become candidates)."""
    top1 = traces["lbs_top1"][rows].astype(np.int32)
    masked = traces["masked"][rows]
    if eos_id is not None:
        masked = masked & (top1 != eos_id)
    return {"entropy": traces["lbs_entropy"][rows].astype(np.float32), "top1": top1,
            "ce": traces["ce"][rows].astype(np.float32), "masked": masked}


def _lbs_batch_loss(router, batch):
    return lbs_loss(router(batch["entropy"], batch["top1"]), batch["ce"], batch["masked"])


def train_lbs(embedding, traces: dict, rows, tc: RouterTrainConfig, *, log=None,
              eos_id: int | None = None, shape: dict | None = None):
    """Trains an LBS router on trace rows (their masked positions).

    Args:
      embedding: [V, d_base] the base model's embedding (frozen).
      traces: `decode_traces` output.
      rows: indices of the trace rows to train on.
      tc: training settings.
      eos_id: when given, the loss is taken only over masked positions whose top-1 is
        not end-of-text. Inference never makes the others candidates; on a short-answer
        task they are most of the masked positions (an end-of-text tail with CE near 0)
        and, counted, they drive the router to select everything.
      shape: LBSConfig fields other than the paper's (d_feat, d_model, n_heads, ffn,
        n_layers), e.g. a router sized to a small base model.
    Returns:
      (LBSRouter with the frozen embedding, loss history).
    """
    V, d = np.shape(embedding)
    cfg = LBSConfig(vocab_size=V, d_base=d, max_len=max(512, traces["masked"].shape[1]),
                    **(shape or {}))
    router = LBSRouter(cfg, embedding=embedding, rngs=nnx.Rngs(tc.seed))
    history = _fit(router, _lbs_batch_loss, lbs_arrays(traces, rows, eos_id), tc, log=log)
    return router, history


def evaluate_lbs(router, traces: dict, rows, threshold: float = 0.5, batch: int = 64,
                 eos_id: int | None = None) -> dict:
    """Validation figures of an LBS router: its loss, and how its selection (p > 0.5)
    matches the positions whose reference token has CE < 1 (the loss's optimum); with
    eos_id, the same among the positions whose top-1 is not end-of-text (`*_text`: the
    only ones that can be candidates)."""
    arrays = lbs_arrays(traces, rows)
    fn = jax.jit(lambda e, t: jax.nn.sigmoid(router(e, t)))
    p = np.concatenate([np.asarray(fn(arrays["entropy"][i:i + batch], arrays["top1"][i:i + batch]))
                        for i in range(0, len(rows), batch)])
    m = arrays["masked"]
    ce = arrays["ce"]
    sel, ready = (p > threshold) & m, (ce < 1.0) & m
    loss = float(np.sum(p * ce * m) / m.sum() - np.sum(p * m) / m.sum())
    return {"loss": loss,
            "selected_share": float(sel.sum() / m.sum()),
            "ready_share": float(ready.sum() / m.sum()),
            "precision": float((sel & ready).sum() / max(1, sel.sum())),
            "recall": float((sel & ready).sum() / max(1, ready.sum())),
            "oracle_loss": float(np.sum(np.minimum(ce - 1.0, 0.0) * m) / m.sum()),
            **({} if eos_id is None else _text_figures(p > threshold, ce < 1.0,
                                                        m & (arrays["top1"] != eos_id)))}


def _text_figures(sel, ready, m) -> dict:
    sel, ready = sel & m, ready & m
    return {"text_share": float(m.sum() / m.size),
            "selected_share_text": float(sel.sum() / max(1, m.sum())),
            "ready_share_text": float(ready.sum() / max(1, m.sum())),
            "precision_text": float((sel & ready).sum() / max(1, sel.sum())),
            "recall_text": float((sel & ready).sum() / max(1, ready.sum()))}


def lps_arrays(traces: dict, rows) -> dict:
    """LPS training arrays of trace rows with their block's masked positions packed to
    the front (the router has no positional encoding and attends only within the
    block, so packing changes nothing but the cost)."""
    bm = traces["block_masked"][rows]
    keep = bm.any(axis=1)
    rows, bm = np.asarray(rows)[keep], bm[keep]
    W = int(bm.sum(axis=1).max())
    order = np.argsort(~bm, axis=1, kind="stable")[:, :W]  # block positions first
    take = lambda a: np.take_along_axis(a, order if a.ndim == 2 else order[..., None], 1)
    return {"features": take(traces["lps_features"][rows]).astype(np.float32),
            "mask": take(bm),
            "label": take(traces["label"][rows]),
            "conf": take(traces["conf"][rows]).astype(np.float32)}


def train_lps(traces: dict, rows, tc: RouterTrainConfig, *, log=None):
    """Trains an LPS router on trace rows. Returns (LPSRouter, loss history)."""
    router = LPSRouter(LPSConfig(), rngs=nnx.Rngs(tc.seed))
    arrays = lps_arrays(traces, rows)
    arrays.pop("conf")
    loss = lambda r, b: lps_loss(r(b["features"], b["mask"]), b["label"], b["mask"],
                                 tc.negative_weight)
    return router, _fit(router, loss, arrays, tc, log=log)


def lps_probabilities(router, arrays: dict, batch: int = 256) -> np.ndarray:
    fn = jax.jit(lambda f, m: jax.nn.sigmoid(router(f, m)))
    n = len(arrays["features"])
    return np.concatenate([np.asarray(fn(arrays["features"][i:i + batch],
                                         arrays["mask"][i:i + batch]))
                           for i in range(0, n, batch)])


def choose_tau(p, label, mask, conf, *, threshold: float = 0.9, max_fpr: float = 0.01) -> dict:
    """The LPS threshold: the smallest tau_psi at which at most max_fpr of the negatives
    (masked block positions whose top-1 is not the final token) would commit through
    p_psi > tau_psi. Only positions below the confidence threshold count: the others
    commit whatever p_psi says.

    Returns:
      {"tau_psi", "fpr", "tpr" (positives passing), "precision", "n_pos", "n_neg",
       "extra_commits" (share of the counted positions that p_psi adds)}.
    """
    m = mask & (conf < threshold)
    pos, neg = p[m & label], p[m & ~label]
    if len(neg) == 0:
        raise RouterError("no negatives to set tau_psi on")
    allowed = int(math.floor(max_fpr * len(neg)))
    desc = np.sort(neg)[::-1]
    tau = float(desc[allowed]) if allowed < len(desc) else 0.0
    fp, tp = int(np.sum(neg > tau)), int(np.sum(pos > tau))
    return {"tau_psi": tau, "fpr": fp / len(neg), "tpr": tp / max(1, len(pos)),
            "precision": tp / max(1, tp + fp), "n_pos": int(len(pos)),
            "n_neg": int(len(neg)), "extra_commits": (tp + fp) / max(1, int(m.sum()))}
