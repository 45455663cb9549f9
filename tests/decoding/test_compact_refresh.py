"""Compacted full forwards (driver.py, `ModelCalls.compact_buckets`): a full forward
that serves at most half the batch computes only the served rows, gathered into the
smallest bucket of 1, 2, 4, ... rows. Rows decode exactly as they do without it. (With
mixed calls off: there a full forward's rows are a part of a mixed call.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import asynclane_jax
from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.fast_dllm import FastDllmSchedule
from asynclane_jax.testbed import evaluate, tasks

# Forking rows take their full forwards (refresh_travel=16) at different iterations.
OPTS = dict(sampler="asynclane", bucket=64, gen_length=64, refresh_travel=16,
            max_lanes=16, extra_queries=8)


def compaction(on: bool):
    return driver.switched(driver.COMPACT_FULL, on)


@pytest.fixture(autouse=True)
def one_call_kind_per_iteration():
    """These tests count full forwards by the rows they compute: mixed calls (each
    row's call of its own kind, test_mixed_calls.py) off."""
    with driver.switched(driver.MIXED_CALLS, False):
        yield


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, _ = asynclane_jax.load("tiny-llada")
    prompts = evaluate.prompts_for(tasks.split("heldout", 4), tokenizer)
    return model, tokenizer, prompts


def full_calls(stats):
    """{rows: (calls, [b] calls that served each row)} of the full forwards."""
    out = {}
    for i, shape in enumerate(stats.call_shapes):
        if shape.kind == "full" and stats.shape_calls[i]:
            out[shape.rows] = (int(stats.shape_calls[i]), stats.row_shape_calls[:, i])
    return out


def test_compacted_full_forwards_decode_as_the_whole_batch_ones(shipped):
    model, tokenizer, prompts = shipped
    driver.clear_compiled()  # another test of this process may have built `lean`'s program
    with compaction(False):
        whole = generate(model, prompts, tokenizer=tokenizer, **OPTS)
    with compaction(True):
        lean = generate(model, prompts, tokenizer=tokenizer, **OPTS)
    assert lean.stats.compiled, "the setting is part of the program's key"
    np.testing.assert_array_equal(lean.tokens, whole.tokens)
    for f in ("commit_step", "row_steps", "row_nfe_full", "row_nfe_partial", "refreshes",
              "forks"):
        np.testing.assert_array_equal(getattr(lean.stats, f), getattr(whole.stats, f))
    assert lean.stats.nfe_full == whole.stats.nfe_full
    # Without compaction every full forward computes the 4 rows.
    assert set(full_calls(whole.stats)) == {4}
    # With it, the refreshes that serve one or two rows compute only those, and each
    # row's full forwards are the same in number, whatever their shape.
    got = full_calls(lean.stats)
    assert set(got) <= {1, 2, 4} and set(got) - {4}, got
    assert sum(c for c, _ in got.values()) == whole.stats.nfe_full
    np.testing.assert_array_equal(sum(r for _, r in got.values()), whole.stats.row_nfe_full)
    # The cost of what was computed: fewer rows of full forwards.
    rows = sum(s * c for s, (c, _) in got.items())
    assert rows < 4 * whole.stats.nfe_full


@dataclasses.dataclass(frozen=True)
class NoCompaction(FastDllmSchedule):
    """Fast-dLLM with compaction declined, as a sampler whose select kept per-row state
    would (not registered: no `name` of its own is set)."""

    compact_full = False


def test_schedules_that_do_not_opt_in_are_unchanged(shipped):
    model, tokenizer, prompts = shipped
    # The dual cache with a per-row refresh: refreshes of one or two rows, still
    # computed over the whole batch.
    schedule = NoCompaction(gen_length=64, cache="dual", row_refresh=True)
    with compaction(True):
        res = generate(model, prompts, sampler=schedule, bucket=64)
    assert {s.rows for s in res.stats.call_shapes} == {4}


def test_block_baselines_refresh_each_row_when_due(shipped):
    """`row_refresh` (block.py): a row entering a block is refreshed at once, over the
    entering rows alone; the batched refresh waits for every row. Same tokens, the same
    calls per row, fewer cached calls."""
    model, tokenizer, prompts = shipped
    opts = dict(sampler="fast-dllm", gen_length=64, block_length=16, cache="dual",
                cascade=True, bucket=64)
    with compaction(True):
        batched = generate(model, prompts, **opts)
        per_row = generate(model, prompts, row_refresh=True, **opts)
    np.testing.assert_array_equal(per_row.tokens, batched.tokens)
    np.testing.assert_array_equal(per_row.stats.row_nfe_full, batched.stats.row_nfe_full)
    got = full_calls(per_row.stats)
    assert set(got) - {4}, got  # some refreshes computed over fewer rows
    assert sum(c for c, _ in got.values()) > batched.stats.nfe_full
    np.testing.assert_array_equal(sum(r for _, r in got.values()),
                                  batched.stats.row_nfe_full)
    # Rows that a batched refresh leaves waiting for the slowest are served instead:
    # fewer cached calls, each computing the whole batch.
    assert per_row.stats.nfe_partial < batched.stats.nfe_partial
    np.testing.assert_array_equal(per_row.stats.row_nfe_partial,
                                  batched.stats.row_nfe_partial)


def test_buckets():
    for b, want in ((1, ()), (2, (1,)), (3, (1,)), (4, (1, 2)), (8, (1, 2, 4)),
                    (16, (1, 2, 4, 8))):
        calls = driver.ModelCalls.__new__(driver.ModelCalls)
        calls.use_cache = True
        calls.schedule = type("S", (), {"compact_full": True})()
        calls.key_mask = np.zeros((b, 3), bool)
        assert calls.compact_buckets() == want, b
        calls.use_cache = False
        assert calls.compact_buckets() == ()
