"""The driver is not a block sampler: a schedule that decodes two regions at once, right
to left, with scattered queries, cached calls and a periodic full refresh, runs under the
same driver and matches a plain-Python restatement token for token."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from reference_samplers import make_model, make_prompts

from asynclane_jax.decoding import generate
from asynclane_jax.decoding.ops import greedy_confidence, never_the_mask
from asynclane_jax.decoding.schedule import Plan, Schedule

GEN = 16


@struct.dataclass
class _State:
    row_step: jax.Array  # [b] int32 iterations that served the row


@dataclasses.dataclass(frozen=True)
class TwoRegionsRightToLeft(Schedule):
    """The generation region is split in two halves decoded at the same time. Each step
    queries, in each half, its `k` rightmost masked columns and commits the most
    confident of them; every `refresh_every`-th step of a row is a full forward, the
    others are cached calls that re-encode only the queried columns.

    Attributes:
      k: columns queried per half and step.
      refresh_every: a full forward every this many steps.
    """

    k: int = 3
    refresh_every: int = 4

    @property
    def uses_cache(self) -> bool:
        return True

    def max_iterations(self) -> int:
        return self.gen_length + 2

    def init(self, ctx):
        return _State(row_step=jnp.zeros((ctx.batch,), jnp.int32))

    def _halves(self, ctx, canvas):
        """Per half: [b, k] queried canvas columns (T where fewer masks) and validity."""
        P, G, T = ctx.prompt_len, ctx.gen_length, ctx.length
        gen = canvas[:, P:] == ctx.mask_id  # [b, G]
        out = []
        for lo, hi in ((0, G // 2), (G // 2, G)):
            j = jnp.arange(G)
            score = jnp.where(gen & (j >= lo) & (j < hi), j, -1)  # rightmost first
            top, idx = jax.lax.top_k(score, self.k)
            out.append(jnp.where(top >= 0, P + idx, T))
        return out

    def plan(self, ctx, canvas, state, live):
        cols = jnp.concatenate(self._halves(ctx, canvas), axis=1)  # [b, 2k]
        q = jnp.where(cols < ctx.length, cols - ctx.shift, ctx.length)
        need = live & (state.row_step % self.refresh_every == 0)
        full = jnp.any(need)
        return Plan(positions=q, full=full, serve=jnp.where(full, need, live))

    def update(self, ctx, canvas, state, out, key):
        rows = jnp.arange(ctx.batch)[:, None]
        for cols in self._halves(ctx, canvas):
            logits, has = out.at(cols)
            x0, conf = greedy_confidence(logits)
            x0 = never_the_mask(logits, x0, ctx.mask_id)
            ok = has & (cols < ctx.length) & out.serve[:, None]
            conf = jnp.where(ok, conf, -jnp.inf)
            best = jnp.argmax(conf, axis=1)[:, None]
            pick = (jnp.arange(self.k)[None, :] == best) & ok
            canvas = canvas.at[rows, jnp.where(pick, cols, ctx.length)].set(x0, mode="drop")
        return canvas, _State(row_step=state.row_step + out.serve)

    def done(self, ctx, canvas, state):
        return ~jnp.any(canvas[:, ctx.prompt_len:] == ctx.mask_id, axis=1)


@partial(jax.jit, static_argnums=0)
def _full(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens, return_kv=True)


@partial(jax.jit, static_argnums=0)
def _cached(graphdef, params, tokens, positions, cache):
    return nnx.merge(graphdef, params).forward_cached(tokens, positions, positions, cache)


def restated(model, prompt, k, refresh_every):
    """The schedule above for one prompt, as a Python loop over numpy."""
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    mask, shift = cfg.mask_token_id, int(cfg.logit_shift)
    x = np.array(list(prompt) + [mask] * GEN)
    P = len(prompt)
    cache, step = None, 0
    while (x[P:] == mask).any():
        halves = []
        for lo, hi in ((0, GEN // 2), (GEN // 2, GEN)):
            masked = [P + j for j in range(lo, hi) if x[P + j] == mask]
            halves.append(masked[::-1][:k])
        want = [c for h in halves for c in h]
        q = np.array([c - shift for c in want])
        if step % refresh_every == 0:
            logits, cache = _full(graphdef, params, jnp.asarray(x[None], jnp.int32))
            logits = np.asarray(logits[0])[q]
        else:
            lg, cache = _cached(graphdef, params, jnp.asarray(x[q][None], jnp.int32),
                                jnp.asarray(q[None], jnp.int32), cache)
            logits = np.asarray(lg[0])
        pred = dict(zip(want, logits))
        commits = []
        for h in halves:
            if not h:
                continue
            best = max(h, key=lambda c: (_conf(pred[c]), -h.index(c)))
            commits.append((best, _token(pred[best], mask)))
        for c, t in commits:
            x[c] = t
        step += 1
    return x[P:]


def _conf(logits):
    p = np.exp(logits - logits.max())
    return p.max() / p.sum()


def _token(logits, mask):
    order = np.argsort(-logits, kind="stable")
    return order[0] if order[0] != mask else order[1]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_two_regions_right_to_left_matches_restatement(family):
    model = make_model(family, lm_scale=10.0)
    prompts = make_prompts(model.cfg.vocab_size)
    res = generate(model, prompts, sampler=TwoRegionsRightToLeft(gen_length=GEN, k=3,
                                                                   refresh_every=4))
    assert not res.stats["hit_step_cap"]
    # Two commits per step (one per half) until the halves are done.
    assert res.stats["steps"] == GEN // 2
    assert res.stats["nfe_full"] == 2 and res.stats["nfe_partial"] == GEN // 2 - 2
    for r, p in enumerate(prompts):
        np.testing.assert_array_equal(res.tokens[r], restated(model, p, 3, 4),
                                      err_msg=f"row {r}")
    # Each step commits one column per half, always among the k rightmost still masked.
    cs = res.stats["commit_step"]
    for half in (cs[:, : GEN // 2], cs[:, GEN // 2:]):
        for row in half:
            assert sorted(row.tolist()) == list(range(GEN // 2))
            for j, s in enumerate(row):
                assert np.sum(row[j + 1:] > s) < 3
