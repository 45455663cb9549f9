"""A teacher-forced probe of statement lookup in the long families (task set v2).

Each probe row shows a model the prompt and the reference's first k working lines of a
held-out chain or list problem and masks line k+1 and everything after it (what a
left-to-right decode faces when it starts that line). One forward per row; the argmax
at each masked position of line k+1 is compared with the reference:

- lookup: the tokens the line copies from its statement in the prompt (list: the
  starting value, the sign and the operand; chain: the sign and the operand, the
  starting value being the previous line's result);
- result: the value after "=";
- line: every token of the line, its free choices (connective, consequence word) graded
  right whichever member is predicted.

Tallied per family and by the line's index (INDEX_BUCKETS); its results on tiny-llada-v2 are
in experiments/results/testbed/lookup_probe.md.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np

from asynclane_jax.testbed import tokenizer as tok
from asynclane_jax.testbed.words import CONNECTIVES, CONSEQUENCES

__all__ = ["INDEX_BUCKETS", "probe_rows", "probe"]

INDEX_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 34))
# Token offsets inside a chain / list working line:
# (i) CONNECTIVE v +/- c = r , CONSEQUENCE r
LINE_TOKENS = 10
LOOKUP = {"list": (2, 3, 4), "chain": (3, 4)}
RESULT = 6
FREE = (1, 8)
PROMPT_BUCKET, REGION = 144, 512


def probe_rows(problems, per_problem: int, seed: int = 0):
    """(tokens, key_mask, (family, line index, positions, targets)) per probe row."""
    ids = tok.special_ids()
    rng = random.Random(seed)
    rows, masks, meta = [], [], []
    for p in problems:
        prompt, resp = tok.prompt_ids(p.prompt), tok.encode(p.response) + [ids["eos_token_id"]]
        n_lines = len(p.lines) - 1
        seq = np.full(PROMPT_BUCKET + REGION, ids["eos_token_id"], np.int32)
        seq[PROMPT_BUCKET - len(prompt):PROMPT_BUCKET] = prompt
        seq[PROMPT_BUCKET:PROMPT_BUCKET + len(resp)] = resp
        key_mask = np.ones(len(seq), bool)
        key_mask[:PROMPT_BUCKET - len(prompt)] = False
        for k in sorted(rng.sample(range(n_lines), min(per_problem, n_lines))):
            start = PROMPT_BUCKET + (LINE_TOKENS + 1) * k
            row = seq.copy()
            row[start:] = ids["mask_token_id"]
            positions = np.arange(start, start + LINE_TOKENS)
            rows.append(row)
            masks.append(key_mask)
            meta.append((p.family, k + 1, positions, seq[positions]))
    return np.stack(rows), np.stack(masks), meta


def probe(model, problems, per_problem: int = 6, batch: int = 16, jit: bool = True) -> dict:
    """Lookup / result / line accuracy per family and line-index bucket.

    model: called as model(tokens, key_mask=...) -> logits [b, T, V] (a DiffusionLM,
    jitted here; jit=False calls it as it is)."""
    tokens, key_mask, meta = probe_rows(problems, per_problem)
    def fwd(t, m):
        return jnp.argmax(model(t, key_mask=m), axis=-1)

    fwd = jax.jit(fwd) if jit else fwd
    preds = np.concatenate([np.asarray(fwd(tokens[i:i + batch], key_mask[i:i + batch]))
                            for i in range(0, len(tokens), batch)])
    ids = tok.token_to_id()
    free_sets = {1: {ids[w] for w in CONNECTIVES}, 8: {ids[w] for w in CONSEQUENCES}}
    tally: dict = {}
    for pred_row, (family, index, positions, target) in zip(preds, meta):
        pred = pred_row[positions]
        ok = pred == target
        for j in FREE:
            ok[j] = pred[j] in free_sets[j]
        bucket = next(f"{a}-{b}" for a, b in INDEX_BUCKETS if a <= index <= b)
        t = tally.setdefault(family, {}).setdefault(bucket, [0, 0, 0, 0])
        t[0] += 1
        t[1] += bool(ok[list(LOOKUP[family])].all())
        t[2] += bool(ok[RESULT])
        t[3] += bool(ok.all())
    order = [f"{a}-{b}" for a, b in INDEX_BUCKETS]
    return {family: {b: {"rows": by[b][0], "lookup": by[b][1] / by[b][0],
                         "result": by[b][2] / by[b][0], "line": by[b][3] / by[b][0]}
                     for b in order if b in by}
            for family, by in sorted(tally.items())}
