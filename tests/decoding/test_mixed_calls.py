"""Mixed calls (driver.py, `ModelCalls.by_kind`; `DiffusionLM.forward_mixed`; off by
default, `driver.MIXED_CALLS`): at batch > 1, the rows due a full forward are served in
the same model call as the other rows' cached queries, so no row waits an iteration for
another's full forward. Rows decode exactly as they do without it, and as they do
alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asynclane_jax
from asynclane_jax import checkpoint
from asynclane_jax.costs import chips, formula, roofline
from asynclane_jax.costs.chips import CostError
from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.api import make_schedule
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models import config as model_config
from asynclane_jax.models.model import CallPart, KVCache
from asynclane_jax.testbed import evaluate, tasks

# Forking rows take their full forwards (refresh_travel=8) at different iterations. The
# decodes of several rows below are of 4 (mixed parts of 1 and 2 rows) with these
# options, so that they share their programs, but for the 3 unpadded rows of the
# fallback's test.
OPTS = dict(sampler="asynclane", bucket=64, gen_length=64, refresh_travel=8,
            max_lanes=16, extra_queries=8)
SAME = ("commit_step", "row_steps", "row_nfe_full", "row_nfe_partial")


def mixing(on: bool):
    return driver.switched(driver.MIXED_CALLS, on)


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, _ = asynclane_jax.load("tiny-llada")
    prompts = evaluate.prompts_for(tasks.split("heldout", 7), tokenizer)
    return model, tokenizer, prompts


def calls_of(stats, kind):
    """{full rows (mixed) or rows: calls} of the shapes of one kind."""
    return {(s.full_rows or s.rows): int(stats.shape_calls[i])
            for i, s in enumerate(stats.call_shapes) if s.kind == kind and stats.shape_calls[i]}


@pytest.mark.parametrize("layout", ["unrolled", "stacked"])
def test_a_mixed_call_gives_each_part_what_it_gets_alone(layout):
    """One call: a full forward of rows 1 and 3 over their (changed) canvases and a cached
    call of rows 0 and 2's queries; each part's logits and cache rows are those of its
    own call, within float rounding (the projections run over both parts' tokens at
    once), and greedy choices agree."""
    model = (checkpoint.load_model("tiny-llada", scan_layers=True) if layout == "stacked"
             else asynclane_jax.load("tiny-llada")[0])
    cfg = model.cfg
    b, T, Q = 4, 40, 5
    rng = np.random.default_rng(0)
    canvas = jnp.asarray(rng.integers(0, cfg.vocab_size - 3, (b, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
    keys = jnp.asarray(np.arange(T)[None, :] >= np.array([0, 3, 0, 7])[:, None])
    _, cache = jax.jit(lambda c: model.forward(c, pos, key_mask=keys,
                                               cache=KVCache.zeros(cfg, b, T),
                                               write_index=pos))(canvas)
    canvas = canvas.at[1, 12].set(5).at[3, 30].set(9).at[0, 20].set(7)
    cols = jnp.asarray(rng.integers(8, T, (b, Q)), jnp.int32)
    full_rows, cached_rows = jnp.array([1, 3]), jnp.array([True, False, True, False])
    write = jnp.where(cached_rows[:, None], cols, T)
    take = lambda a: jnp.take_along_axis(a, cols, axis=1)

    @jax.jit
    def apart(cache):
        lf, small = model.forward(canvas[full_rows], pos[full_rows],
                                  key_mask=keys[full_rows], cache=KVCache.zeros(cfg, 2, T),
                                  write_index=pos[full_rows], logits_index=cols[full_rows])
        lc, cache = model.forward(take(canvas), take(pos), key_mask=keys, cache=cache,
                                  write_index=write)
        return lf, lc, small, cache

    @jax.jit
    def mixed(cache):
        parts = (CallPart(canvas[full_rows], pos[full_rows], keys[full_rows],
                          pos[full_rows], full_rows, cols[full_rows]),
                 CallPart(take(canvas), take(pos), keys, write))
        return model.forward_mixed(parts, cache)

    lf, lc, small, want = apart(cache)
    (mf, mc), got = mixed(cache)
    np.testing.assert_allclose(mf, lf, atol=1e-4)
    np.testing.assert_allclose(mc[cached_rows], lc[cached_rows], atol=1e-4)
    np.testing.assert_array_equal(jnp.argmax(mf, -1), jnp.argmax(lf, -1))
    np.testing.assert_array_equal(jnp.argmax(mc[cached_rows], -1),
                                  jnp.argmax(lc[cached_rows], -1))
    np.testing.assert_allclose(got.k[:, full_rows], small.k, atol=1e-5)
    np.testing.assert_allclose(got.v[:, cached_rows], want.v[:, cached_rows], atol=1e-5)


def test_asynclane_rows_decode_as_without_mixing_and_alone(shipped):
    model, tokenizer, prompts = shipped
    prompts = prompts[:4]
    with mixing(False):
        plain = generate(model, prompts, tokenizer=tokenizer, **OPTS)
    with mixing(True):
        mixed = generate(model, prompts, tokenizer=tokenizer, **OPTS)
    assert mixed.stats.compiled, "the setting is part of the program's key"
    np.testing.assert_array_equal(mixed.tokens, plain.tokens)
    for f in SAME + ("refreshes", "forks"):
        np.testing.assert_array_equal(getattr(mixed.stats, f), getattr(plain.stats, f))
    assert calls_of(mixed.stats, "mixed"), mixed.stats.call_shapes  # some calls mixed
    assert not calls_of(plain.stats, "mixed")
    # No row waits for another's full forward: fewer iterations, as many calls per row.
    assert mixed.stats.iterations < plain.stats.iterations
    assert mixed.stats.nfe < plain.stats.nfe
    alone = [generate(model, [p], tokenizer=tokenizer, **OPTS) for p in prompts[:2]]
    for i, one in enumerate(alone):
        np.testing.assert_array_equal(mixed.tokens[i], one.tokens[0])
        assert not calls_of(one.stats, "mixed")  # one row: nothing to mix


def test_more_rows_due_than_a_full_part_holds(shipped):
    """Three rows, unpadded: a full part holds one (at most half the rows), so when two
    are due a full forward while the third is cached, the two get a full forward over
    the batch and the third waits, as without mixing."""
    model, tokenizer, prompts = shipped
    rows = prompts[1:4]  # rows whose refreshes fall due two at once, once
    with mixing(False):
        plain = generate(model, rows, tokenizer=tokenizer, pad_batch=False, **OPTS)
    with mixing(True):
        mixed = generate(model, rows, tokenizer=tokenizer, pad_batch=False, **OPTS)
    np.testing.assert_array_equal(mixed.tokens, plain.tokens)
    for f in SAME:
        np.testing.assert_array_equal(getattr(mixed.stats, f), getattr(plain.stats, f))
    assert set(calls_of(mixed.stats, "mixed")) == {1}
    # A full forward of the 3 rows that served only 2 of them: the two due, the third
    # waiting.
    full3 = [i for i, c in enumerate(mixed.stats.call_shapes)
             if c.kind == "full" and c.rows == 3]
    served = mixed.stats.row_shape_calls[:, full3].sum(axis=0)  # row-calls per shape
    assert (served < 3 * mixed.stats.shape_calls[full3]).any(), mixed.stats.call_shapes


def test_block_baselines_with_row_refresh_mix(shipped):
    model, tokenizer, prompts = shipped
    prompts = prompts[:4]
    opts = dict(sampler="fast-dllm", gen_length=64, block_length=16, cache="dual",
                cascade=True, bucket=64, row_refresh=True)
    with mixing(False):
        plain = generate(model, prompts, **opts)
    with mixing(True):
        mixed = generate(model, prompts, **opts)
    np.testing.assert_array_equal(mixed.tokens, plain.tokens)
    for f in SAME:
        np.testing.assert_array_equal(getattr(mixed.stats, f), getattr(plain.stats, f))
    assert calls_of(mixed.stats, "mixed")
    assert mixed.stats.nfe < plain.stats.nfe
    # The published batched refresh is one call kind per iteration, as before: the
    # driver does not mix a schedule that does not plan per-row kinds.
    published = make_schedule("fast-dllm", gen_length=64, block_length=16, cache="dual",
                              cascade=True)
    assert not published.mixes_calls and make_schedule(
        "fast-dllm", gen_length=64, block_length=16, cache="dual", row_refresh=True).mixes_calls
    with mixing(True):
        assert not driver.mixing(published, model.cfg, 4, None)


def test_a_mixed_call_reads_the_weights_once():
    cfg = model_config.PRESETS["llada-8b-instruct"]()
    shape = CallShape("mixed", 8, 40, 544, 40, True, 544, full_rows=2)
    full, cached = shape.parts()
    assert full == CallShape("full", 2, 544, 544, 40, True, 544)
    assert cached == CallShape("cached", 8, 40, 544, 40, True, 544)
    cost, parts = (formula.call_cost(cfg, shape),
                   [formula.call_cost(cfg, p) for p in shape.parts()])
    assert cost.flops == pytest.approx(sum(p.flops for p in parts))
    assert cost.weight_bytes < sum(p.weight_bytes for p in parts)
    assert cost.linear_weight_bytes == parts[0].linear_weight_bytes
    assert cost.bytes_kv_read == pytest.approx(sum(p.bytes_kv_read for p in parts))
    for chip in ("v6e", "h200"):  # where a call is bound by its weights, it saves time
        c = chips.get_chip(chip)
        assert roofline.call_time(c, cost) < sum(roofline.call_time(c, p) for p in parts)
    with pytest.raises(CostError, match="dense"):
        formula.call_cost(model_config.PRESETS["llada2-mini"](), shape)


def test_mixed_call_shapes():
    shape = CallShape("mixed", 8, 40, 544, 40, True, 544, full_rows=2)
    assert CallShape.from_dict(shape.to_dict()) == shape
    plain = CallShape("cached", 8, 40, 544, 40, True, 544)
    assert "full_rows" not in plain.to_dict()  # as written before mixed calls
    assert CallShape.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError, match="full_rows"):
        CallShape("mixed", 8, 40, 544, 40, True, 544)
    with pytest.raises(ValueError, match="full_rows"):
        CallShape("cached", 8, 40, 544, 40, True, 544, full_rows=1)
