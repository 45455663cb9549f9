"""Plain-Python reference samplers: the oracle the jitted decode engine is tested against.

Each function decodes ONE prompt (batch 1, variable shapes, per-step Python loops, numpy
bookkeeping) and restates the public reference code's semantics:

- ``llada_vanilla``: ML-GSAI/LLaDA ``generate.py``.
- ``dream_reference``: Dream's ``diffusion_generate`` (``generation_utils.py``).
- ``fast_dllm``: NVlabs/Fast-dLLM ``llada/generate.py`` (threshold and factor variants,
  prefix and dual cache) and, for Dream models, ``dream/model/generation_utils_block.py``.
- ``localleap``: docs/baselines.md, ``localleap`` (no public code), on the Fast-dLLM
  skeleton.

Only the sampler logic is restated here; logits come from the model under test
(``model(...)`` for full forwards, ``model.forward_cached(...)`` for cached ones).

Conventions shared by every function:
  * returns ``(tokens, info)``: ``tokens`` int64 [gen_length], the generated part;
    ``info`` a dict with ``nfe_full`` / ``nfe_partial`` (model calls over the whole
    canvas / over a query window against a K/V cache), ``steps`` (decode steps, one model
    call each), ``commit_step`` int64 [gen_length] (0-based step whose call committed the
    position), ``commits_per_step`` (list), and decision margins (see ``_Margins``).
  * the whole generation region is decoded: none of the references stops at EOS.
  * a CFG step batches the conditional and unconditional canvases into one call and
    counts as one full forward.
  * Dream's logit shift (the token at i is read from the output at i - 1) is applied here
    whenever ``model.cfg.logit_shift`` is set; the model never applies it.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# ----------------------------------------------------------------------------- model calls

_RUNNERS: dict[int, tuple[object, _Runner]] = {}


# Compiled once per (graph structure, shape): models of one config share executables, and
# full forwards always go through the K/V-returning variant (one compile per canvas length).
@partial(jax.jit, static_argnums=0)
def _full_kv(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens, return_kv=True)


@partial(jax.jit, static_argnums=0)
def _cached(graphdef, state, tokens, positions, write_index, cache):
    return nnx.merge(graphdef, state).forward_cached(tokens, positions, write_index, cache)


class _Runner:
    """Full and cached forwards of one model at batch 1, on numpy canvases."""

    def __init__(self, model):
        self.graphdef, self.state = nnx.split(model)

    def full(self, x):
        """x: [n, T] ints -> logits float32 numpy [n, T, V]."""
        logits, _ = _full_kv(self.graphdef, self.state, jnp.asarray(x, jnp.int32))
        return np.asarray(logits)

    def full_kv(self, x):
        """x: [T] -> (logits [T, V], KVCache of the canvas)."""
        logits, cache = _full_kv(self.graphdef, self.state, jnp.asarray(x, jnp.int32)[None])
        return np.asarray(logits[0]), cache

    def cached(self, x, q_start, q_stop, write_start, cache):
        """Queries the canvas positions [q_start, q_stop) against ``cache``.

        Queries at positions >= write_start first overwrite their K/V with fresh values
        (Fast-dLLM: the prefix cache feeds x[s:] after the K/V of [0, s); the dual cache
        replaces the block's K/V in place); queries before write_start only read (their
        write index is out of range, so the cache keeps its entries there). Every query
        attends to all T positions. Returns logits [q_stop - q_start, V].
        """
        t = len(x)
        pos = np.arange(q_start, q_stop)
        write = np.where(pos >= write_start, pos, t)
        as_row = lambda a: jnp.asarray(a, jnp.int32)[None]
        logits, _ = _cached(self.graphdef, self.state, as_row(x[q_start:q_stop]), as_row(pos),
                            as_row(write), cache)
        return np.asarray(logits[0])


def runner(model) -> _Runner:
    """The (memoised) runner of a model; its parameters are read once, here."""
    key = id(model)
    if key not in _RUNNERS:
        _RUNNERS[key] = (model, _Runner(model))  # keep the model alive so ids stay unique
    return _RUNNERS[key][1]


def shift_logits(logits):
    """Dream's shift over the last-but-one axis: out[i] = in[i - 1], out[0] = in[0]."""
    return np.concatenate([logits[..., :1, :], logits[..., :-1, :]], axis=-2)


# ----------------------------------------------------------------------------- numerics

def softmax(logits, dtype):
    z = np.asarray(logits, dtype)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class _Margins:
    """Smallest distances to a decision boundary met while decoding.

    Float noise between the engine and this reference (padding, batching, reduction
    order) is ~1e-6 relative; a decision closer than that to its boundary is a near-tie
    and a test using it would be flaky. Tests assert these are comfortably positive.

    logit: top-1 minus top-2 logit at every position that was committed.
    conf: gap between the last selected and first unselected confidence (top-k), or
      |confidence - threshold| for threshold rules.
    """

    def __init__(self):
        self.logit = math.inf
        self.conf = math.inf

    def argmax_gap(self, logits_rows):
        if len(logits_rows):
            top2 = np.sort(np.asarray(logits_rows, np.float64), axis=-1)[:, -2:]
            self.logit = min(self.logit, float((top2[:, 1] - top2[:, 0]).min()))

    def conf_gap(self, value):
        self.conf = min(self.conf, abs(float(value)))


def num_transfer_tokens(n_masked: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one row: base = n // steps per step, and the
    first n % steps steps take one more."""
    base, rem = divmod(n_masked, steps)
    return [base + 1 if i < rem else base for i in range(steps)]


def linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """Dream's ``torch.linspace(1, eps, steps + 1)`` (float32). torch's kernels round the
    last bit differently per device and vector width; here: exact values rounded once to
    float32. The transfer counts built on it match exact arithmetic for the usual
    (gen_length, steps) pairs (checked in test_reference_samplers.py)."""
    return np.linspace(start, end, steps).astype(np.float32)


def dream_transfer_count(n_masked: int, i: int, steps: int, timesteps: np.ndarray) -> int:
    """Dream: k = int(n * (1 - s / t)) in float32 (t = timesteps[i], s = timesteps[i+1]),
    and every remaining mask at the last step. ``n`` is the batch-mean mask count in
    Dream (``mask_index.sum() / batch``), which equals the row's count at batch 1."""
    if i == steps - 1:
        return int(n_masked)
    t, s = timesteps[i], timesteps[i + 1]
    return int(np.float32(n_masked) * (np.float32(1.0) - s / t))


def factor_commit_count(sorted_conf, factor: float) -> int:
    """Fast-dLLM's factor rule (``get_transfer_index_dynamic``), kept with its quirks.

    sorted_conf: confidences of the N masked candidates, descending. Thresholds
    th_n = 1 - factor / (n + 1) for n = 1..N with th_1 = -1; k = the first (0-based) index
    whose confidence is < its threshold. The reference then adds one when that index is
    0 or N - 1, so when only the LAST candidate fails, all N are committed anyway (and
    with N == 2 both always are).
    """
    n = len(sorted_conf)
    if n == 0:
        return 0
    thresholds = [1.0 - factor / (j + 1) for j in range(1, n + 1)]
    thresholds[0] = -1.0
    top_i = 0
    for top_i in range(n):
        if sorted_conf[top_i] < thresholds[top_i]:
            break
    if top_i == 0 or top_i == n - 1:
        top_i += 1
    return top_i


# ----------------------------------------------------------------------------- helpers

def _canvas(model, prompt, gen_length):
    cfg = model.cfg
    prompt = [int(t) for t in prompt]
    if any(t == cfg.mask_token_id for t in prompt):
        raise ValueError("prompt contains the mask id")
    return np.array(prompt + [cfg.mask_token_id] * gen_length, np.int64), len(prompt)


def _topk_desc(values, k):
    """Indices of the k largest values; ties go to the lower index (torch/lax order)."""
    order = np.argsort(-np.asarray(values, np.float64), kind="stable")
    return order[:k]


def _info(nfe_full, nfe_partial, commit_step, commits_per_step, margins, **extra):
    info = {
        "nfe_full": int(nfe_full),
        "nfe_partial": int(nfe_partial),
        "steps": int(nfe_full + nfe_partial),
        "commit_step": np.asarray(commit_step, np.int64),
        "commits_per_step": list(commits_per_step),
        "logit_margin": margins.logit,
        "conf_margin": margins.conf,
    }
    info.update(extra)
    return info


# ----------------------------------------------------------------------------- LLaDA

def llada_vanilla(model, prompt, *, gen_length, block_length, steps,
                  remasking="low_confidence", temperature=0.0, cfg_scale=0.0, seed=0):
    """LLaDA's block-wise semi-autoregressive sampler (ML-GSAI/LLaDA ``generate``).

    Per block, ``steps // num_blocks`` steps; step i commits ``num_transfer_tokens``[i]
    masked positions of the current block with the highest confidence (softmax
    probability of the argmax token in the logits' dtype, float32 here; or uniform
    noise for ``remasking='random'``). Positions after the block and committed ones get
    -inf. CFG: the unconditional canvas has the prompt positions masked, logits =
    un + (cfg + 1) * (cond - un). Gumbel-max in float64 when temperature > 0 (numpy RNG:
    only the structure, not the random stream, can match another implementation).
    """
    run = runner(model)
    cfg = model.cfg
    mask_id = cfg.mask_token_id
    x, p_len = _canvas(model, prompt, gen_length)
    if gen_length % block_length:
        raise ValueError("gen_length must be a multiple of block_length")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError("steps must be a multiple of the number of blocks")
    steps_per_block = steps // num_blocks
    rng = np.random.default_rng(seed)
    prompt_index = np.zeros(len(x), bool)
    prompt_index[:p_len] = True
    commit_step = np.full(gen_length, -1, np.int64)
    commits, margins, nfe, step = [], _Margins(), 0, 0
    for b in range(num_blocks):
        start = p_len + b * block_length
        end = start + block_length
        schedule = num_transfer_tokens(int((x[start:end] == mask_id).sum()), steps_per_block)
        for i in range(steps_per_block):
            masked = x == mask_id
            if cfg_scale > 0:
                un_x = x.copy()
                un_x[prompt_index] = mask_id
                cond, un = run.full(np.stack([x, un_x]))
                logits = un + (cfg_scale + 1) * (cond - un)
            else:
                logits = run.full(x[None])[0]
            if cfg.logit_shift:
                logits = shift_logits(logits)
            nfe += 1
            if temperature > 0:
                noise = rng.random(logits.shape)
                noisy = np.exp(logits.astype(np.float64)) / (-np.log(noise)) ** temperature
            else:
                noisy = logits
            x0 = np.argmax(noisy, axis=-1)
            if remasking == "low_confidence":
                p = softmax(logits, logits.dtype)
                x0_p = np.take_along_axis(p, x0[:, None], axis=-1)[:, 0].astype(np.float64)
            elif remasking == "random":
                x0_p = rng.random(len(x))
            else:
                raise ValueError(f"remasking={remasking!r}")
            x0_p[end:] = -np.inf
            confidence = np.where(masked, x0_p, -np.inf)
            k = schedule[i]
            sel = _topk_desc(confidence, k)
            sel = sel[masked[sel]]
            if 0 < k < masked[:end].sum():
                ordered = np.sort(confidence)[::-1]
                margins.conf_gap(ordered[k - 1] - ordered[k])
            margins.argmax_gap(noisy[sel] if temperature == 0 else [])
            x[sel] = x0[sel]
            commit_step[sel - p_len] = step
            commits.append(len(sel))
            step += 1
    return x[p_len:].copy(), _info(nfe, 0, commit_step, commits, margins)


# ----------------------------------------------------------------------------- Dream

def _dream_sample_tokens(logits, temperature=0.0, top_p=None, top_k=None,
                         margin_confidence=False, neg_entropy=False, rng=None):
    """Dream's ``sample_tokens`` on rows of logits [n, V]: filter, softmax (float32),
    then (confidence, token). Greedy: the max probability and its argmax; top_p / top_k
    change the confidence even at temperature 0 (the softmax is renormalised over the
    kept tokens)."""
    logits = np.asarray(logits, np.float32)
    if temperature > 0:
        logits = logits / np.float32(temperature)
    fill = np.finfo(np.float32).min
    if top_p is not None and top_p < 1:
        order = np.argsort(-logits, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(logits, order, axis=-1)
        cum = np.cumsum(softmax(sorted_logits, np.float32), axis=-1)
        remove_sorted = cum > top_p
        remove_sorted[..., 1:] = remove_sorted[..., :-1].copy()
        remove_sorted[..., 0] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        logits = np.where(remove, fill, logits)
    if top_k is not None:
        kth = np.sort(logits, axis=-1)[..., -min(top_k, logits.shape[-1]), None]
        logits = np.where(logits < kth, fill, logits)
    probs = softmax(logits, np.float32)
    if temperature > 0:
        x0 = np.array([rng.choice(len(p), p=p / p.sum()) for p in probs.astype(np.float64)])
        confidence = np.take_along_axis(probs, x0[:, None], axis=-1)[:, 0]
    else:
        x0 = probs.argmax(axis=-1)
        confidence = probs.max(axis=-1)
    if margin_confidence:
        top2 = -np.sort(-probs, axis=-1)[:, :2]
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = np.sum(probs * np.log(probs + np.float32(1e-10)), axis=-1)
    return confidence, x0, logits


def dream_reference(model, prompt, *, gen_length, steps, alg="maskgit_plus", eps=1e-3,
                    temperature=0.0, top_p=None, top_k=None, alg_temp=None, seed=0):
    """Dream's ``diffusion_generate`` (not block-wise).

    timesteps = linspace(1, eps, steps + 1) in float32; at step i every masked position
    gets a confidence (``maskgit_plus``: top-1 probability, ``topk_margin``: top-1 minus
    top-2, ``entropy``: sum p log p) and the k = int(n_masked * (1 - s / t)) most
    confident are committed (all remaining at the last step). k may be 0 (e.g. the first
    step when steps == gen_length). ``origin`` commits each mask with probability
    1 - s / t (random; structure only).
    """
    run = runner(model)
    cfg = model.cfg
    mask_id = cfg.mask_token_id
    x, p_len = _canvas(model, prompt, gen_length)
    rng = np.random.default_rng(seed)
    timesteps = linspace_f32(1.0, eps, steps + 1)
    commit_step = np.full(gen_length, -1, np.int64)
    commits, margins = [], _Margins()
    for i in range(steps):
        masked = x == mask_id
        logits = run.full(x[None])[0]
        if cfg.logit_shift:
            logits = shift_logits(logits)
        pos = np.flatnonzero(masked)
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1.0
            chosen = pos[rng.random(len(pos)) < p_transfer]
            _, x0, _ = _dream_sample_tokens(logits[chosen], temperature, top_p, top_k, rng=rng)
            x[chosen] = x0
            commit_step[chosen - p_len] = i
            commits.append(len(chosen))
            continue
        if alg not in ("maskgit_plus", "topk_margin", "entropy"):
            raise ValueError(f"alg={alg!r}")
        confidence, x0, filtered = _dream_sample_tokens(
            logits[pos], temperature, top_p, top_k, margin_confidence=alg == "topk_margin",
            neg_entropy=alg == "entropy", rng=rng)
        k = dream_transfer_count(len(pos), i, steps, timesteps)
        if k > 0:
            if alg_temp:
                z = confidence.astype(np.float64) / alg_temp
                w = softmax(z, np.float64)
                sel_local = rng.choice(len(pos), size=k, replace=False, p=w)
            else:
                sel_local = _topk_desc(confidence, k)
                if k < len(pos):
                    ordered = np.sort(confidence.astype(np.float64))[::-1]
                    margins.conf_gap(ordered[k - 1] - ordered[k])
            if temperature == 0:
                margins.argmax_gap(filtered[sel_local])
            sel = pos[sel_local]
            x[sel] = x0[sel_local]
            commit_step[sel - p_len] = i
        commits.append(max(k, 0))
    return x[p_len:].copy(), _info(steps, 0, commit_step, commits, margins)


# ----------------------------------------------------------------------------- Fast-dLLM skeleton

def _block_decode(model, prompt, *, gen_length, block_length, cache, select, temperature,
                  seed):
    """The Fast-dLLM block loop shared by ``fast_dllm`` and ``localleap``.

    ``select(conf, positions, margins) -> local indices`` picks which masked in-block
    candidates (``positions``: canvas indices, ascending; ``conf``: their confidences)
    to commit at a step. Blocks run until they have no masks (``steps`` plays no part).

    LLaDA (no shift): every step decodes with ``select``; confidence = softmax in float64
    of the argmax token (Fast-dLLM casts to float64).
      none:   a full forward per step.
      prefix: a full forward at the block start (its logits decode that step), then the
              queries x[s:] at positions s..T-1 against the K/V of [0, s) from that call.
      dual:   a full forward at the block start, then only the block's B positions,
              their fresh K/V overwriting the block's entries in place.
      The block-complete check comes before every cached call (upstream's current
      code; an older revision checked after, which made one extra, idle call whenever
      the block-start step had filled the block).
    Dream (shift; Fast-dLLM ``generation_utils_block.py``): the block-start full forward
      commits exactly ONE token, the block's first position s, read from the output at
      s - 1 (argmax, no threshold). Later steps query the same windows as LLaDA ([s, T)
      prefix, [s, s + B) dual) and shift inside the window, so position p > s reads the
      output at p - 1, which is in the window; position s would read its own output but
      is already committed, so its logit is never used. The output at s - 1 is thus
      needed only at the block start, where the full forward provides it. Confidence is
      Dream's float32 top-1 probability. Fast-dLLM's Dream code has no cache-free block
      variant (it falls back to a different, non-block sampler); ``cache='none'`` here is
      the same schedule with a full forward (shifted) at every step.
    """
    if cache not in ("none", "prefix", "dual"):
        raise ValueError(f"cache={cache!r}")
    run = runner(model)
    cfg = model.cfg
    mask_id = cfg.mask_token_id
    shift = cfg.logit_shift
    x, p_len = _canvas(model, prompt, gen_length)
    if gen_length % block_length:
        raise ValueError("gen_length must be a multiple of block_length")
    rng = np.random.default_rng(seed)
    commit_step = np.full(gen_length, -1, np.int64)
    commits, margins = [], _Margins()
    counters = {"full": 0, "partial": 0, "step": 0}

    def commit(sel, tokens):
        x[sel] = tokens
        commit_step[sel - p_len] = counters["step"]
        commits.append(len(sel))
        counters["step"] += 1

    def greedy(rows):
        if temperature > 0:
            noise = rng.random(rows.shape)
            return np.argmax(np.exp(rows.astype(np.float64)) / (-np.log(noise)) ** temperature,
                             axis=-1)
        return np.argmax(rows, axis=-1)

    for b in range(gen_length // block_length):
        start = p_len + b * block_length
        end = start + block_length
        kv = None
        first = True
        while (x[start:end] == mask_id).any():
            if first or cache == "none":
                if cache == "none":
                    logits = run.full(x[None])[0]
                else:
                    logits, kv = run.full_kv(x)
                counters["full"] += 1
                offset = 0
            elif cache == "prefix":
                # Fixed window [P, T) per prompt (fewer compiled shapes); the committed
                # queries before s only read, so the K/V of [0, s) stay the block-start
                # ones and [s, T) is fresh: the prefix cache exactly.
                logits = run.cached(x, p_len, len(x), start, kv)
                counters["partial"] += 1
                offset = p_len
            else:
                logits = run.cached(x, start, end, start, kv)
                counters["partial"] += 1
                offset = start
            if shift:
                logits = shift_logits(logits)
            if shift and first:
                # Fast-dLLM Dream: the block-start call commits the block's first token.
                row = logits[start - offset]
                tok = greedy(row[None])[0]
                if temperature == 0:
                    margins.argmax_gap(row[None])
                commit(np.array([start]), np.array([tok]))
                first = False
                continue
            first = False
            pos = np.flatnonzero(x[start:end] == mask_id) + start
            rows = logits[pos - offset]
            x0 = greedy(rows)
            if shift:
                p = softmax(rows, np.float32)
            else:
                p = softmax(rows, np.float64)
            conf = np.take_along_axis(p, x0[:, None], axis=-1)[:, 0]
            sel_local = np.asarray(select(conf, pos, margins), np.int64)
            if temperature == 0:
                margins.argmax_gap(rows[sel_local])
            commit(pos[sel_local], x0[sel_local])
    info = _info(counters["full"], counters["partial"], commit_step, commits, margins)
    return x[p_len:].copy(), info


def _threshold_select(threshold, stats):
    def select(conf, pos, margins):
        top = int(_topk_desc(conf, 1)[0])
        chosen = conf >= threshold
        chosen[top] = True
        for j in range(len(conf)):
            if j != top:
                margins.conf_gap(conf[j] - threshold)
        if conf[top] < threshold and len(conf) > 1:
            ordered = np.sort(conf.astype(np.float64))[::-1]
            margins.conf_gap(ordered[0] - ordered[1])
        stats["threshold_commits"] += int(chosen.sum()) - 1
        return np.flatnonzero(chosen)
    return select


def _factor_select(factor, stats):
    def select(conf, pos, margins):
        order = _topk_desc(conf, len(conf))
        ordered = conf[order].astype(np.float64)
        k = factor_commit_count(ordered, factor)
        n = len(conf)
        for j in range(1, min(k + 1, n)):
            margins.conf_gap(ordered[j] - (1.0 - factor / (j + 2)))
        if k < n:
            margins.conf_gap(ordered[k - 1] - ordered[k])
        stats["threshold_commits"] += k - 1
        return order[:k]
    return select


def fast_dllm(model, prompt, *, gen_length, block_length, threshold=0.9, factor=None,
              cache="none", temperature=0.0, seed=0):
    """Fast-dLLM parallel decoding (NVlabs/Fast-dLLM ``llada/generate.py``).

    Threshold rule (``get_transfer_index``): sort the masked in-block candidates by
    confidence; the top-1 always commits; every other commits iff its confidence is NOT
    below the threshold (``>= threshold``). Factor rule (``factor`` not None, threshold
    ignored): ``factor_commit_count``. See ``_block_decode`` for caches and Dream.
    """
    stats = {"threshold_commits": 0}
    select = (_factor_select(factor, stats) if factor is not None
              else _threshold_select(threshold, stats))
    tokens, info = _block_decode(model, prompt, gen_length=gen_length,
                                 block_length=block_length, cache=cache, select=select,
                                 temperature=temperature, seed=seed)
    info.update(stats)
    return tokens, info


def localleap(model, prompt, *, gen_length, block_length, threshold=0.9,
              relaxed_threshold=0.75, radius=4, cache="none", temperature=0.0, seed=0):
    """LocalLeap (docs/baselines.md) on the Fast-dLLM block loop and caches.

    Among the masked in-block candidates: the top-1 always commits; anchors are the
    candidates with confidence >= threshold (they commit); a candidate within ``radius``
    canvas positions of an anchor (|p - a| <= radius) commits when its confidence is
    >= relaxed_threshold. No anchor: only the top-1 (plain Fast-dLLM threshold step).
    """
    stats = {"threshold_commits": 0, "relaxed_commits": 0}

    def select(conf, pos, margins):
        top = int(_topk_desc(conf, 1)[0])
        anchors = pos[conf >= threshold]
        near = np.zeros(len(pos), bool)
        for a in anchors:
            near |= np.abs(pos - a) <= radius
        strong = conf >= threshold
        relaxed = near & (conf >= relaxed_threshold) & ~strong
        chosen = strong | relaxed
        chosen[top] = True
        for j in range(len(conf)):
            if j != top:
                margins.conf_gap(conf[j] - threshold)
                if near[j]:
                    margins.conf_gap(conf[j] - relaxed_threshold)
        if conf[top] < threshold and len(conf) > 1:
            ordered = np.sort(conf.astype(np.float64))[::-1]
            margins.conf_gap(ordered[0] - ordered[1])
        stats["threshold_commits"] += int(chosen.sum()) - 1
        stats["relaxed_commits"] += int((relaxed & (np.arange(len(pos)) != top)).sum())
        return np.flatnonzero(chosen)

    tokens, info = _block_decode(model, prompt, gen_length=gen_length,
                                 block_length=block_length, cache=cache, select=select,
                                 temperature=temperature, seed=seed)
    info.update(stats)
    return tokens, info




# ----------------------------------------------------------------------------- test models

# Random tiny models are nearly position-blind (near-uniform attention, small layer
# outputs), so every masked position gets almost the same confidence and top-k orders
# become float near-ties. Sharpening attention (q and k scaled: RoPE makes positions
# differ) and the output head (probabilities spread, and >= 0.9 often enough for the
# threshold rules to commit several tokens per step) fixes that. The mask token's output
# column is zeroed so it is (practically) never the argmax: the references would commit
# it as a token, which real models never predict.
LM_SCALE_TOPK = 10.0  # vanilla / Dream (fixed-count) samplers
LM_SCALE_THRESHOLD = {"llada": 40.0, "dream": 30.0}  # threshold samplers
QK_SCALE = 20.0
PROMPT_LENGTHS = (5, 9, 14)
_MODELS: dict = {}


def make_model(family: str, *, lm_scale: float, seed: int = 0, qk_scale: float = QK_SCALE):
    """A (memoised) tiny random LLaDA or Dream model, sharpened as described above."""
    from asynclane_jax.models import init_model, tiny_dream, tiny_llada

    key = (family, lm_scale, seed, qk_scale)
    if key not in _MODELS:
        cfg = {"llada": tiny_llada, "dream": tiny_dream}[family]()
        model = init_model(cfg, seed)
        head = np.array(model.lm_head.kernel[...])
        head[:, cfg.mask_token_id] = 0.0
        model.lm_head.kernel[...] = jnp.asarray(head * lm_scale)
        for layer in model.layers:
            for proj in (layer.attn.q_proj, layer.attn.k_proj):
                proj.kernel[...] = proj.kernel[...] * qk_scale
        _MODELS[key] = model
    return _MODELS[key]


def make_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths avoiding the special ids at the top of the vocab."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab_size - 2, n)] for n in lengths]


__all__ = [
    "llada_vanilla", "dream_reference", "fast_dllm", "localleap", "num_transfer_tokens",
    "dream_transfer_count", "factor_commit_count", "linspace_f32", "shift_logits",
    "runner", "make_model", "make_prompts",
]


# ----------------------------------------------------------------------------- D2F

@partial(jax.jit, static_argnums=0)
def _full_blocks(graphdef, state, tokens, block_ids):
    return nnx.merge(graphdef, state)(tokens, block_ids=block_ids)


def d2f(model, prompt, *, gen_length, block_length, block_add_threshold=0.1,
        decoded_token_threshold=0.95, skip_threshold=0.9):
    """D2F's pipelined decoding, greedy (the public D2F-eval ``_generate_block_single``).

    The canvas grows by one all-mask block at a time. Each step is one full forward over
    the canvas so far with block-causal attention (the prompt block 0, generated block i
    block i + 1): a block's K/V depend only on it and earlier blocks, so this equals the
    public code's computation against the cache of finished blocks. Positions of blocks
    never added (after an end-of-text) are returned as end-of-text.
    """
    cfg = model.cfg
    mask, eos, B = cfg.mask_token_id, cfg.eos_token_id, block_length
    P, nb = len(prompt), gen_length // block_length
    x = np.array(prompt, np.int64)
    blocks: list[dict] = []  # per added block: state, complete
    r = runner(model)
    margins = _Margins()
    commit_step = np.full(gen_length, -1, np.int64)
    commits_per_step: list[int] = []
    eos_seen, steps = False, 0

    def frac(i):  # decoded fraction of generated block i (the prompt, i = -1, is done)
        if i < 0:
            return 1.0
        return float(np.sum(x[P + i * B: P + (i + 1) * B] != mask)) / B

    while True:
        if len(blocks) < nb and not eos_seen and frac(len(blocks) - 1) >= block_add_threshold:
            blocks.append({"state": "active", "complete": False})
            x = np.concatenate([x, np.full(B, mask, np.int64)])
        for i, blk in enumerate(blocks):
            if frac(i - 1) >= decoded_token_threshold:
                blk["complete"] = True
        if not any(b["state"] == "active" for b in blocks):
            break
        ids = np.concatenate([np.zeros(P, np.int64), np.repeat(np.arange(1, len(blocks) + 1), B)])
        logits = np.asarray(_full_blocks(r.graphdef, r.state, jnp.asarray(x, jnp.int32)[None],
                                         jnp.asarray(ids, jnp.int32)[None])[0])
        if cfg.logit_shift:
            logits = shift_logits(logits)
        for blk in blocks:
            if blk["state"] == "to_cache":
                blk["state"] = "in_cache"
        finished, n_commit = [], 0
        for i, blk in enumerate(blocks):
            if blk["state"] != "active":
                continue
            cols = P + i * B + np.flatnonzero(x[P + i * B: P + (i + 1) * B] == mask)
            if len(cols):
                p = softmax(logits[cols], np.float32)
                conf, x0 = p.max(axis=-1), p.argmax(axis=-1)
                margins.argmax_gap(logits[cols])
                for c in conf:
                    margins.conf_gap(c - skip_threshold)
                sel = np.flatnonzero(conf > skip_threshold)
                if blk["complete"] and not len(sel):
                    sel = np.array([int(np.argmax(conf))])
                    if len(conf) > 1:
                        margins.conf_gap(np.sort(conf)[-1] - np.sort(conf)[-2])
                x[cols[sel]] = x0[sel]
                commit_step[cols[sel] - P] = steps
                n_commit += len(sel)
                eos_seen |= bool(np.any(x0[sel] == eos))
            if not np.any(x[P + i * B: P + (i + 1) * B] == mask):
                finished.append(i)
        for i in finished:
            if all(blocks[j]["state"] != "active" for j in range(i)):
                blocks[i]["state"] = "to_cache"
        commits_per_step.append(n_commit)
        steps += 1
    tokens = np.full(gen_length, eos, np.int64)
    tokens[: len(x) - P] = x[P:]
    return tokens, _info(0, steps, commit_step, commits_per_step, margins,
                         blocks_added=len(blocks))
