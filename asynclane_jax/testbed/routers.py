"""The two small routers of Early-Bird decoding (EB-Decode, arXiv 2609.16450): modules,
losses, decode traces of the frozen model, optax training loops, save and load.

  LBS (learnable block size): reads the whole generation region of a canvas, one
    position per element, and scores each position: p = sigmoid(O), "this position is
    ready to be decoded now". Per position: the normalised entropy H/log|V| of the
    frozen model's distribution through Linear(1, 64)-GELU-Linear(64, 64)-LayerNorm,
    and its top-1 token through the frozen base embedding and Linear(d_base, 64);
    concatenated, Linear(128, 128) plus learned positions, a 2-layer Transformer
    (d 128, 4 heads, FFN 256), a linear head. A committed position enters with entropy
    0 and its committed token. Loss (the paper's): mean sigmoid(O_i) * CE_i minus mean
    sigmoid(O_i) over masked positions, CE_i the frozen model's cross-entropy of the
    reference token: selecting a position pays its CE and earns 1, so the optimum
    selects exactly the positions with CE < 1 (probability of the right token > 1/e).
  LPS (position-aware sampler): reads the still-masked positions of the current block
    (attention restricted to them) with five features per position (top-1 probability,
    normalised entropy, top-1 minus top-2 probability, the block's masked share, the
    position's relative place in the block) through Linear(5, 32)-LayerNorm-GELU, two
    Transformer blocks (d 32, 4 heads, FFN 64) and a linear head: p_psi, "the top-1
    token now is the token the decode ends with". Weighted binary cross-entropy,
    negatives counted twice (a wrong early commit costs more than a late one).

Frozen embedding, folded. The LBS router is trained through the frozen base embedding
E [V, d_base] and Linear(d_base, 64); what inference needs is only E @ W + b, a [V, 64]
table. `fold_lbs` stores that table instead, so the router weights need no model
parameters at decode time (the schedule holds them as compile-time constants).

Traces (`decode_traces`): the frozen model decodes training-split problems with the
`eb` schedule's own step (`EarlyBirdSchedule.decide`) under a conservative rule (no LPS:
commit at probability >= 0.9, else the top-1), one full forward per step, batch by batch.
Each step records, per generated position, the LBS inputs (normalised entropy, top-1 id,
masked), the cross-entropy of the reference token (response, then end-of-text), and for
the block's masked positions the LPS features and the step's top-1. After the decode, a
position's LPS label is whether that top-1 equals the final token. Two rounds: without
LBS (every block is the fallback of 32 positions: the block decoding the LBS learns to
improve on) for LBS data, then with the trained LBS for LPS data, so LPS sees the
variable-length blocks it will decide in.

Saved beside a model: `<model folder>/routers/early_bird.npz` (the folded weights,
flat keys `lbs/...`, `lps/...`) and `early_bird.json` (the router configs, tau_psi and
how it was chosen, training figures, a digest of the weights).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROUTER_DIR = "routers"
WEIGHTS_FILE = "early_bird.npz"
META_FILE = "early_bird.json"
N_LPS_FEATURES = 5


class RouterError(ValueError):
    """Router weights missing, malformed, or made for another model."""


# ----------------------------------------------------------------------------- modules

@dataclasses.dataclass(frozen=True)
class LBSConfig:
    """Shape of the LBS router.

    Attributes:
      vocab_size: V of the base model.
      d_base: width of the base model's embedding.
      d_feat: width of each of the two per-position feature branches.
      d_model: Transformer width (the concatenated branches are projected to it).
      n_heads, ffn, n_layers: the Transformer's heads, FFN width and depth.
      max_len: learned positions (the longest generation region it reads).
    """

    vocab_size: int
    d_base: int
    d_feat: int = 64
    d_model: int = 128
    n_heads: int = 4
    ffn: int = 256
    n_layers: int = 2
    max_len: int = 512


@dataclasses.dataclass(frozen=True)
class LPSConfig:
    """Shape of the LPS router (attributes as LBSConfig's)."""

    n_features: int = N_LPS_FEATURES
    d_model: int = 32
    n_heads: int = 4
    ffn: int = 64
    n_layers: int = 2


class FrozenEmbedding(nnx.Variable):
    """The base model's embedding inside the LBS router while it trains (never updated)."""


class SelfAttention(nnx.Module):
    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        if d % heads:
            raise RouterError(f"d_model={d} is not a multiple of n_heads={heads}")
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, key_mask=None):
        b, n, d = x.shape
        h = self.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, n, 3, h, d // h), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]) / math.sqrt(d // h)
        if key_mask is not None:
            # A finite fill: a row with no valid key attends uniformly instead of NaN.
            s = jnp.where(key_mask[:, None, None, :], s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v[:, :, 0])
        return self.out(o.reshape(b, n, d))


class TransformerBlock(nnx.Module):
    """Pre-LayerNorm block: x + attn(LN x), then x + FFN(LN x) with a GELU."""

    def __init__(self, d: int, heads: int, ffn: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = SelfAttention(d, heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, ffn, rngs=rngs)
        self.down = nnx.Linear(ffn, d, rngs=rngs)

    def __call__(self, x, key_mask=None):
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LBSRouter(nnx.Module):
    """Learnable block size router: [b, n] entropy and top-1 ids -> [b, n] logits O.

    Built with `embedding` (the base model's [V, d_base] table, frozen) for training, or
    without it for inference, where `tok_table` [V, d_feat] holds E @ W + b (fold_lbs).
    """

    def __init__(self, cfg: LBSConfig, *, embedding=None, rngs: nnx.Rngs):
        self.cfg = cfg
        f, d = cfg.d_feat, cfg.d_model
        self.ent_in = nnx.Linear(1, f, rngs=rngs)
        self.ent_out = nnx.Linear(f, f, rngs=rngs)
        self.ent_norm = nnx.LayerNorm(f, rngs=rngs)
        if embedding is not None:
            embedding = jnp.asarray(embedding, jnp.float32)
            if embedding.shape != (cfg.vocab_size, cfg.d_base):
                raise RouterError(f"embedding {embedding.shape} does not match "
                                  f"(vocab_size, d_base)=({cfg.vocab_size}, {cfg.d_base})")
            self.embedding = FrozenEmbedding(embedding)
            self.tok_proj = nnx.Linear(cfg.d_base, f, rngs=rngs)
        else:
            self.tok_table = nnx.Param(jnp.zeros((cfg.vocab_size, f), jnp.float32))
        self.mix = nnx.Linear(2 * f, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, d)))
        self.blocks = nnx.List([TransformerBlock(d, cfg.n_heads, cfg.ffn, rngs=rngs)
                                for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def token_features(self, top1):
        if hasattr(self, "tok_table"):
            return jnp.take(self.tok_table[...], top1, axis=0)
        return self.tok_proj(jnp.take(self.embedding[...], top1, axis=0))

    def __call__(self, entropy, top1):
        """entropy [b, n] in [0, 1], top1 [b, n] int -> logits O [b, n]."""
        n = entropy.shape[-1]
        if n > self.cfg.max_len:
            raise RouterError(f"LBS router reads at most {self.cfg.max_len} positions, got {n}")
        e = self.ent_norm(self.ent_out(jax.nn.gelu(self.ent_in(entropy[..., None]))))
        x = self.mix(jnp.concatenate([e, self.token_features(top1)], axis=-1))
        x = x + self.pos[...][:n]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))[..., 0]


class LPSRouter(nnx.Module):
    """Position-aware sampler: [b, n, 5] features, [b, n] key mask -> [b, n] logits."""

    def __init__(self, cfg: LPSConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.inp = nnx.Linear(cfg.n_features, d, rngs=rngs)
        self.inp_norm = nnx.LayerNorm(d, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(d, cfg.n_heads, cfg.ffn, rngs=rngs)
                                for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, features, key_mask):
        x = jax.nn.gelu(self.inp_norm(self.inp(features)))
        for block in self.blocks:
            x = block(x, key_mask)
        return self.head(self.norm(x))[..., 0]


# ----------------------------------------------------------------------------- features

def normalised_entropy(logits):
    """H(softmax(logits)) / log V; [..., V] -> [...] in [0, 1]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    h = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return h / math.log(logits.shape[-1])


def lbs_inputs(logits, tokens, mask_id: int):
    """The LBS router's inputs over a generation region.

    Args:
      logits: [b, n, V] the call's logits predicting each position.
      tokens: [b, n] the canvas there.
      mask_id: the mask token.
    Returns:
      (entropy [b, n], top1 [b, n] int32): a committed position enters with entropy 0
      and its own token.
    """
    masked = tokens == mask_id
    ent = jnp.where(masked, normalised_entropy(logits), 0.0)
    top1 = jnp.where(masked, jnp.argmax(logits, -1), tokens).astype(jnp.int32)
    return ent, top1


def lps_features(logits, block_masked, size, index):
    """The LPS router's five features per position.

    Args:
      logits: [b, n, V].
      block_masked: [b, n] bool, the current block's still-masked positions.
      size: [b] positions in the block when it was chosen.
      index: [b, n] each block member's index in the block (by position).
    Returns:
      [b, n, 5] float32: top-1 probability, normalised entropy, top-1 minus top-2
      probability, the block's masked share, relative place in the block.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    # Two maxima rather than lax.top_k: fused with the rest, top_k costs ~6x on CPU.
    p1 = jnp.max(probs, axis=-1)
    top = jnp.arange(logits.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
    p2 = jnp.max(jnp.where(top, -1.0, probs), axis=-1)
    size = jnp.maximum(size, 1).astype(jnp.float32)[:, None]
    ratio = jnp.sum(block_masked, axis=-1, keepdims=True) / size
    feats = [p1, normalised_entropy(logits), p1 - p2,
             jnp.broadcast_to(ratio, block_masked.shape), index / size]
    return jnp.stack(feats, axis=-1).astype(jnp.float32)


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
    from asynclane_jax.testbed import tokenizer as tok

    eos = tok.special_ids()["eos_token_id"]
    out = np.full((len(problems), gen_length), eos, np.int32)
    for i, p in enumerate(problems):
        resp = tok.encode(p.response)[:gen_length]
        out[i, :len(resp)] = resp
    return out


def decode_traces(model, problems, schedule, *, weights=None, batch: int = 64,
                  seed: int = 0, progress=None) -> dict:
    """Decodes problems with the `eb` schedule's step and records what the routers read.

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
    from asynclane_jax.decoding import driver
    from asynclane_jax.decoding.api import build_canvas
    from asynclane_jax.decoding.schedule import CallOutput
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed import tokenizer as tok

    cfg = model.cfg
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

    @jax.jit
    def step(params, canvas, pad_len, state, ref, key):
        m = nnx.merge(graphdef, params)
        ctx = driver.make_context(cfg, schedule, canvas.shape, pad_len)
        T = canvas.shape[1]
        cols = jnp.arange(T, dtype=jnp.int32)[None, :]
        live = ~schedule.done(ctx, canvas, state)
        plan = schedule.plan(ctx, canvas, state, live)
        logits, _ = m.forward(canvas, jnp.maximum(cols - pad_len[:, None], 0),
                              key_mask=cols >= pad_len[:, None],
                              logits_index=jnp.minimum(plan.positions, T - 1))
        targets = jnp.where(plan.positions < T, plan.positions + ctx.shift, T)
        out = CallOutput(logits=logits, targets=targets, serve=live, full=jnp.asarray(True))
        canvas, state, info = schedule.decide(ctx, canvas, state, out, key, weights)
        rec = {k: info[k] for k in keys if k != "ce"}
        rec["ce"] = optax.softmax_cross_entropy_with_integer_labels(info["logits"], ref)
        return canvas, state, live, rec

    @jax.jit
    def init(canvas, pad_len):
        return schedule.init(driver.make_context(cfg, schedule, canvas.shape, pad_len))

    key = jax.random.key(seed)
    for start in range(0, len(problems), batch):
        canvas, pad_len, P = build_canvas(prompts[start:start + batch], G, cfg, bucket)
        canvas, pad_len = jnp.asarray(canvas), jnp.asarray(pad_len)
        ref = jnp.asarray(refs[start:start + batch])
        state = init(canvas, pad_len)
        rows = []
        for it in range(schedule.max_iterations()):
            key, sub = jax.random.split(key)
            canvas, state, live, rec = step(params, canvas, pad_len, state, ref, sub)
            live = np.asarray(live)
            if not live.any():
                break
            rows.append((it, live, rec))
        final = np.asarray(canvas)[:, P:]
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


# ----------------------------------------------------------------------------- save / load

def _path_key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat_params(module) -> dict[str, np.ndarray]:
    """A module's Params as {"a/b/kernel": numpy array}."""
    pure = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    return {_path_key(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def fold_lbs(router: LBSRouter) -> dict[str, np.ndarray]:
    """The router's Params with the frozen embedding and Linear(d_base, d_feat) replaced
    by their product, the [V, d_feat] table inference reads."""
    flat = flat_params(router)
    if "tok_table" in flat:
        return flat
    table = (np.asarray(router.embedding[...]) @ flat.pop("tok_proj/kernel")
             + flat.pop("tok_proj/bias"))
    return dict(flat, tok_table=table.astype(np.float32))


def build_module(cls, cfg, flat: dict):
    """A module of class cls (LBSRouter folded, or LPSRouter) holding the flat arrays
    (as jnp constants when called inside a trace)."""
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    missing = [_path_key(p) for p, _ in leaves if _path_key(p) not in flat]
    if missing:
        raise RouterError(f"router weights lack {missing}")
    values = []
    for p, leaf in leaves:
        v = flat[_path_key(p)]
        if tuple(v.shape) != tuple(leaf.shape):
            raise RouterError(f"router weight {_path_key(p)}: shape {v.shape}, expected "
                              f"{tuple(leaf.shape)}")
        values.append(jnp.asarray(v))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    return nnx.merge(graphdef, state)


class RouterWeights:
    """Router weights as the `eb` schedule holds them: numpy arrays (the LBS folded),
    their configs and metadata, named by a digest of the bytes. Either router may be
    absent (a trace round that runs only the LBS)."""

    def __init__(self, lbs_config: LBSConfig | None, lbs: dict | None,
                 lps_config: LPSConfig | None, lps: dict | None, meta: dict | None = None):
        self.lbs_config, self.lbs = lbs_config, lbs
        self.lps_config, self.lps = lps_config, lps
        self.meta = dict(meta or {})
        h = hashlib.sha256()
        for tag, cfg, arrays in (("lbs", lbs_config, lbs), ("lps", lps_config, lps)):
            h.update(json.dumps([tag, dataclasses.asdict(cfg) if cfg else None]).encode())
            for k in sorted(arrays or {}):
                h.update(k.encode())
                h.update(np.ascontiguousarray(arrays[k], np.float32).tobytes())
        self.digest = h.hexdigest()[:16]

    @classmethod
    def from_modules(cls, lbs: LBSRouter | None = None, lps: LPSRouter | None = None,
                     meta: dict | None = None) -> RouterWeights:
        return cls(lbs.cfg if lbs is not None else None,
                   fold_lbs(lbs) if lbs is not None else None,
                   lps.cfg if lps is not None else None,
                   flat_params(lps) if lps is not None else None, meta)

    def lbs_module(self) -> LBSRouter:
        if self.lbs is None:
            raise RouterError("these router weights have no LBS router")
        return build_module(LBSRouter, self.lbs_config, self.lbs)

    def lps_module(self) -> LPSRouter:
        if self.lps is None:
            raise RouterError("these router weights have no LPS router")
        return build_module(LPSRouter, self.lps_config, self.lps)

    def __hash__(self):
        return hash(self.digest)

    def __eq__(self, other):
        return isinstance(other, RouterWeights) and other.digest == self.digest

    def __repr__(self):
        return f"RouterWeights({self.digest})"


def router_dir(model_folder) -> pathlib.Path:
    return pathlib.Path(model_folder) / ROUTER_DIR


def save_routers(model_folder, weights: RouterWeights) -> pathlib.Path:
    """Writes weights beside a model: <folder>/routers/early_bird.{npz,json}."""
    if weights.lbs is None or weights.lps is None:
        raise RouterError("save both routers")
    out = router_dir(model_folder)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {f"lbs/{k}": v for k, v in weights.lbs.items()}
    arrays.update({f"lps/{k}": v for k, v in weights.lps.items()})
    np.savez(out / WEIGHTS_FILE, **arrays)
    meta = dict(weights.meta, digest=weights.digest,
                lbs_config=dataclasses.asdict(weights.lbs_config),
                lps_config=dataclasses.asdict(weights.lps_config))
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def has_routers(folder) -> bool:
    """Whether folder (a model folder or its routers folder) holds router weights."""
    folder = pathlib.Path(folder)
    return ((folder / WEIGHTS_FILE).is_file()
            or (folder / ROUTER_DIR / WEIGHTS_FILE).is_file())


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> RouterWeights:
    del mtime  # part of the cache key: a rewritten file is read again
    folder = pathlib.Path(path)
    try:
        meta = json.loads((folder / META_FILE).read_text())
        with np.load(folder / WEIGHTS_FILE) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError) as e:
        raise RouterError(f"{folder}: cannot read router weights ({e})") from None
    lbs = {k[4:]: v for k, v in arrays.items() if k.startswith("lbs/")}
    lps = {k[4:]: v for k, v in arrays.items() if k.startswith("lps/")}
    return RouterWeights(LBSConfig(**meta.pop("lbs_config")), lbs,
                         LPSConfig(**meta.pop("lps_config")), lps, meta)


def load_routers(folder) -> RouterWeights:
    """Reads router weights from a model folder or its routers folder."""
    folder = pathlib.Path(folder).expanduser().absolute()
    if not (folder / WEIGHTS_FILE).is_file():
        folder = folder / ROUTER_DIR
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / META_FILE).is_file():
        raise RouterError(f"no router weights in {folder} (expected {WEIGHTS_FILE} and "
                          f"{META_FILE}; experiments/train_eb.py writes them)")
    return _load(str(folder), (folder / WEIGHTS_FILE).stat().st_mtime)
