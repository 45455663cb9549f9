"""Every decode's stats say how many model calls of each static shape it made (full or
cached; rows, queries, keys, logits), per batch and per row, and these counters agree
with the call counts the driver always kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference_samplers import make_prompts

from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.api import build_canvas, make_schedule
from asynclane_jax.decoding.stats import MAX_CALL_SHAPES, CallShape

GEN = 64

CASES = [
    ("fast-dllm", {"cache": "dual"}),
    ("fast-dllm", {"cache": "prefix", "block_length": 16}),
    ("asynclane", {}),
    ("vanilla", {"steps": 16, "cfg_scale": 1.0}),
]


def _decode(model, sampler, options, n=3):
    prompts = make_prompts(model.cfg.vocab_size, lengths=(5, 9, 12)[:n])
    return generate(model, prompts, sampler=sampler, gen_length=GEN, **options)


@pytest.mark.parametrize("sampler,options", CASES, ids=lambda c: str(c))
def test_counters_agree_with_the_call_counts(tiny_llada_model, sampler, options):
    st = _decode(tiny_llada_model, sampler, options).stats
    shapes = st.call_shapes
    assert shapes and len(shapes) <= MAX_CALL_SHAPES
    assert st.shape_calls.shape == (len(shapes),)
    assert st.row_shape_calls.shape == (3, len(shapes))  # real rows only (bucket 4)
    # A mixed call (AsyncLane at batch > 1) counts as a full forward, and serves rows by
    # a full forward and rows by a cached call.
    full = np.array([s.kind in ("full", "mixed") for s in shapes])
    mixed = np.array([s.kind == "mixed" for s in shapes])
    assert int(st.shape_calls.sum()) == st.nfe
    assert int(st.shape_calls[full].sum()) == st.nfe_full
    by_full = st.row_shape_calls[:, full & ~mixed].sum(1)
    by_cached = st.row_shape_calls[:, ~full].sum(1)
    # Each row's calls of a mixed shape are its full forwards and cached calls beyond
    # those of the other shapes.
    np.testing.assert_array_equal(st.row_shape_calls[:, mixed].sum(1),
                                  (st.row_nfe_full - by_full) + (st.row_nfe_partial - by_cached))
    assert np.all(by_full <= st.row_nfe_full) and np.all(by_cached <= st.row_nfe_partial)
    if not mixed.any():
        np.testing.assert_array_equal(by_full, st.row_nfe_full)
        np.testing.assert_array_equal(by_cached, st.row_nfe_partial)
    T = st.prompt_bucket + GEN
    guided = options.get("cfg_scale", 0) > 0
    for i, s in enumerate(shapes):
        assert s.canvas == T
        whole = st.batch_bucket * (2 if guided else 1)
        # A compacted full forward (driver.ModelCalls.compact_buckets: AsyncLane's
        # refreshes) computes a power-of-two bucket of at most half the rows.
        assert s.rows == whole or (s.kind == "full" and s.cache and 2 * s.rows <= whole
                                   and s.rows & (s.rows - 1) == 0), s
        assert 0 < s.keys <= T and 0 < s.logits
        if s.kind == "full":
            assert s.queries == s.keys
        # A row attends at most the keys the call computes, and at least its prompt.
        served = st.row_shape_calls[:, i]
        keys = st.row_shape_keys[:, i]
        assert np.all(keys <= served * s.keys)
        assert np.all(keys >= served * 5)  # the shortest prompt's 5 columns
    listed = st.calls_by_shape()
    assert sum(d["calls"] for d in listed) == st.nfe
    assert all(d["calls"] > 0 for d in listed)
    assert st.to_dict()["call_shapes"] == [s.to_dict() for s in shapes]


def test_the_shapes_of_a_dual_cache_decode(tiny_llada_model):
    """fast-dllm with the dual cache: one full forward over the canvas at each block
    start of a row (logits at the block), cached calls of one block otherwise."""
    st = _decode(tiny_llada_model, "fast-dllm", {"cache": "dual", "block_length": 16}).stats
    T = st.prompt_bucket + GEN
    by = {s.kind: (i, s) for i, s in enumerate(st.call_shapes)}
    assert set(by) == {"full", "cached"}
    i, full = by["full"]
    assert full == CallShape("full", 4, T, T, 16, True, T)
    np.testing.assert_array_equal(st.row_shape_calls[:, i], GEN // 16)
    _, cached = by["cached"]
    assert cached == CallShape("cached", 4, 16, T, 16, True, T)


def test_the_counters_cost_no_host_callback(tiny_llada_model):
    """The counters live in the loop state: the compiled decode holds no host callback."""
    model = tiny_llada_model
    schedule = make_schedule("fast-dllm", gen_length=GEN, cache="dual")
    canvas, pad_len, _ = build_canvas(make_prompts(model.cfg.vocab_size, lengths=(5,)),
                                      GEN, model.cfg, 32)
    graphdef, params = nnx.split(model)
    sites = driver.CallSites()
    text = driver.lower_decode(graphdef, params, canvas, pad_len, np.ones(1, bool),
                               jax.random.key(0), schedule=schedule, sites=sites).as_text()
    assert len(sites.shapes) == 2
    assert "callback" not in text.lower()


def test_serving_restarts_a_readmitted_rows_counters(tiny_llada_model):
    """serve_chunk: a row admitted again counts its new decode's calls only."""
    model = tiny_llada_model
    schedule = make_schedule("fast-dllm", gen_length=GEN, cache="dual", block_length=16)
    prompts = make_prompts(model.cfg.vocab_size, lengths=(5, 9))
    canvas, pad_len, _ = build_canvas(prompts, GEN, model.cfg, 32)
    graphdef, params = nnx.split(model)
    b = canvas.shape[0]
    state = driver.serve_init(graphdef, params, canvas, jax.random.key(0), schedule=schedule)

    def run(state, admit):
        return driver.serve_chunk(graphdef, params, state, jnp.asarray(pad_len),
                                  jnp.asarray(admit), jnp.asarray(canvas),
                                  jnp.zeros((b,), bool), jnp.asarray(10_000),
                                  schedule=schedule)

    state = run(state, np.ones(b, bool))
    first = np.asarray(state.row_shape_calls[0]).sum()
    assert first == int(state.row_full[0] + state.row_partial[0]) > 0
    state = run(state, np.array([True, False]))  # row 0 decodes its prompt again
    assert np.asarray(state.row_shape_calls[0]).sum() == first
    assert int(np.asarray(state.shape_calls).sum()) == int(state.nfe_full + state.nfe_partial)
