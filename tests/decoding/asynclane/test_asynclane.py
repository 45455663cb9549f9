"""AsyncLane: exactness against Fast-dLLM with the lanes switched off, and the
invariants of its output and lane tree (docs/asynclane.md, "The lane tree in the
stats"), on fixed cases
and as hypothesis properties over random tiny models and random settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_samplers import make_model, make_prompts

import asynclane_jax
from asynclane_jax.decoding import driver, generate, make_schedule
from asynclane_jax.decoding.lanes import DONE, FREE, TERMINATED
from asynclane_jax.decoding.schedule import SamplerError
from asynclane_jax.testbed import evaluate, tasks

# AsyncLane with forking, the extra queries and the cascade off (it refreshes with a full
# forward at every block start, as Fast-dLLM's dual cache does).
AS_FAST_DLLM = dict(max_lanes=1, extra_queries=0, cascade=False, threshold=0.9)
# Forking at every newline of the shipped models' answers, with more extra query slots
# than the defaults.
FORKING = dict(max_lanes=16, extra_queries=8)


def check_invariants(res, cfg, *, cascade: bool):
    """What every AsyncLane result must satisfy, row by row."""
    stats = res.stats
    stop = set(cfg.stop_token_ids)
    G = res.tokens.shape[1]
    assert not stats.hit_step_cap
    for r, row in enumerate(res.tokens):
        assert not np.any(row == cfg.mask_token_id), "a generated position is still masked"
        assert np.all(stats.commit_step[r] >= 0)
        stops = [i for i, t in enumerate(row) if int(t) in stop]
        front = G
        if cascade and stops:
            front = stops[0] + 1
            assert all(int(t) in stop for t in row[front:]), "text after the first end-of-text"
        kind = stats.lane_kind[r]
        used = kind != FREE
        # Slots are taken in order and never reused.
        assert np.all(used[: used.sum()]) and not np.any(used[used.sum():])
        assert np.all((kind == DONE) | (kind == TERMINATED) | (kind == FREE)), kind
        # Parent links: slot 0 is the only root, every other lane's parent is an
        # earlier slot, so the links form a tree.
        parent = stats.lane_parent[r]
        assert parent[0] == -1
        for m in np.flatnonzero(used)[1:]:
            assert 0 <= parent[m] < m
            assert stats.lane_birth[r, m] >= stats.lane_birth[r, parent[m]]
        # Spans of the lanes that were not terminated tile [0, front) in slot order.
        kept = np.flatnonzero(used & (kind != TERMINATED))
        spans = sorted((int(stats.lane_start[r, m]), int(stats.lane_end[r, m])) for m in kept)
        assert spans[0][0] == 0 and spans[-1][1] == front, (spans, front)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:])), spans
        assert [int(stats.lane_start[r, m]) for m in kept] == [s for s, _ in spans]
        assert np.all(stats.lane_death[r][used] >= stats.lane_birth[r][used])
        assert stats.forks[r] == used.sum() - 1


def test_equals_fast_dllm_dual_cache_on_random_llada(tiny_llada_model):
    model = tiny_llada_model
    prompts = make_prompts(model.cfg.vocab_size, lengths=(5, 9, 3))
    for threshold in (0.9, 0.6):
        ref = generate(model, prompts, sampler="fast-dllm", gen_length=32, block_length=8,
                       threshold=threshold, cache="dual")
        got = generate(model, prompts, sampler="asynclane", gen_length=32, block_length=8,
                       delimiters="none", **{**AS_FAST_DLLM, "threshold": threshold})
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        # The same calls per row: a full forward per block, cached calls in between.
        np.testing.assert_array_equal(got.stats.row_nfe_full, ref.stats.row_nfe_full)
        np.testing.assert_array_equal(got.stats.row_nfe_partial, ref.stats.row_nfe_partial)


@pytest.fixture(scope="module")
def shipped_llada():
    model, tokenizer, cfg = asynclane_jax.load("tiny-llada")
    problems = tasks.split("heldout", 6)
    return model, tokenizer, cfg, problems, evaluate.prompts_for(problems, tokenizer)


def test_equals_fast_dllm_dual_cache_on_the_shipped_model(shipped_llada):
    model, tokenizer, _, _, prompts = shipped_llada
    ref = generate(model, prompts, sampler="fast-dllm", gen_length=64, cache="dual")
    got = generate(model, prompts, sampler="asynclane", gen_length=64, tokenizer=tokenizer,
                   **AS_FAST_DLLM)
    np.testing.assert_array_equal(got.tokens, ref.tokens)


def test_lanes_fork_and_cascade_on_the_shipped_model(shipped_llada):
    model, tokenizer, cfg, problems, prompts = shipped_llada
    res = generate(model, prompts, sampler="asynclane", gen_length=96, tokenizer=tokenizer,
                   **FORKING)
    check_invariants(res, cfg, cascade=True)
    st_ = res.stats
    assert np.all(st_.forks >= 1), "the answers have several lines: the lanes must fork"
    assert np.all(st_.peak_lanes >= 2)
    # Every answer ends well before 96 tokens; the cascade filled the rest.
    assert all(int(row[64]) in cfg.stop_token_ids for row in res.tokens)
    # No full forward at a fork: one to start, and at most one more as the window passes
    # position 32 (refresh_travel=32, or the advance to a new block), however often
    # the row forks.
    assert np.all(st_.refreshes <= 2) and np.all(st_.refreshes <= st_.forks), (
        st_.refreshes, st_.forks)
    np.testing.assert_array_equal(st_.row_nfe_full, st_.refreshes)
    # The text is the model's: most answers right.
    assert sum(evaluate.check(p, row) for p, row in zip(problems, res.tokens)) >= 3
    # The lane tree comes with the statistics.
    tree = st_.lane_tree(0)
    assert tree[0]["parent"] == -1 and len(tree) == st_.forks[0] + 1
    assert "lane_kind" in st_.to_dict()


def test_defaults_on_the_shipped_model(shipped_llada):
    model, tokenizer, cfg, problems, prompts = shipped_llada
    res = generate(model, prompts, sampler="asynclane", gen_length=96, tokenizer=tokenizer)
    check_invariants(res, cfg, cascade=True)
    st_ = res.stats
    # The defaults fork at the answers' newlines, and no iteration commits nothing.
    assert np.all(st_.forks >= 1) and np.all(st_.idle_steps == 0)
    # No full forward at a fork: one to start, and one once the window
    # has travelled a block (refresh_travel=32), which only the 50-token answers do.
    longer = np.asarray(st_.generated_tokens) >= 32
    assert longer.any() and not longer.all()
    np.testing.assert_array_equal(st_.refreshes, 1 + longer)
    np.testing.assert_array_equal(st_.row_nfe_full, st_.refreshes)
    assert sum(evaluate.check(p, row) for p, row in zip(problems, res.tokens)) >= 4
    # Lanes off (max_lanes=1): no forks, and never fewer iterations for a row.
    off = generate(model, prompts, sampler="asynclane", gen_length=96, tokenizer=tokenizer,
                   max_lanes=1).stats
    assert np.all(off.forks == 0)
    assert np.all(st_.row_steps <= off.row_steps) and st_.row_steps.sum() < off.row_steps.sum()


def test_dream_shipped_model_invariants():
    model, tokenizer, cfg = asynclane_jax.load("tiny-dream")
    prompts = evaluate.prompts_for(tasks.split("heldout", 4), tokenizer)
    res = generate(model, prompts, sampler="asynclane", gen_length=96, tokenizer=tokenizer,
                   **FORKING)
    check_invariants(res, cfg, cascade=True)
    assert np.all(res.stats.forks >= 1)


def test_batch_rows_equal_single_runs_and_one_compilation(shipped_llada):
    # Forking rows take their full forwards (refresh_travel=16) at different iterations
    # while the others wait.
    model, tokenizer, _, _, prompts = shipped_llada
    opts = dict(sampler="asynclane", tokenizer=tokenizer, bucket=64, gen_length=64,
                refresh_travel=16, **FORKING)
    batch = generate(model, prompts[:4], **opts)
    traces = driver.TRACE_COUNT["decode"]
    singles = [generate(model, [p], **opts) for p in prompts]
    # One program for every single-prompt run of this bucket.
    assert driver.TRACE_COUNT["decode"] == traces + 1
    assert [s.stats.compiled for s in singles] == [True] + [False] * (len(prompts) - 1)
    for i in range(4):
        np.testing.assert_array_equal(batch.tokens[i], singles[i].tokens[0])
        for f in ("lane_kind", "lane_start", "lane_end", "lane_parent", "lane_birth",
                  "lane_death", "lane_split", "row_nfe_full", "row_nfe_partial"):
            np.testing.assert_array_equal(getattr(batch.stats, f)[i],
                                          getattr(singles[i].stats, f)[0])


def test_bad_settings_are_refused(tiny_llada_model):
    for opts in ({"threshold": 0.0}, {"max_lanes": 0}, {"max_lanes": 4, "extra_queries": 0},
                 {"delimiters": "a,b"}, {"stable_fraction": 2.0}, {"refresh_travel": -1}):
        with pytest.raises(SamplerError):
            generate(tiny_llada_model, [[1, 2]], sampler="asynclane", gen_length=8, **opts)
    with pytest.raises(SamplerError, match="tokenizer"):
        generate(tiny_llada_model, [[1, 2]], sampler="asynclane", gen_length=8, max_lanes=4)
    with pytest.raises(SamplerError, match="outside the vocabulary"):
        generate(tiny_llada_model, [[1, 2]], sampler="asynclane", gen_length=8,
                 delimiters="100000")


def test_extra_queries_and_refine_budget_follow_the_canvas():
    # 4 and 4 below gen_length 512, 8 and 8 from it; the budget follows the slots unless
    # given, and given values win.
    def slots(**opts):
        s = make_schedule("asynclane", **opts)
        return s.extra_queries, s.refine_budget

    assert [slots(gen_length=g) for g in (8, 256, 511, 512, 1024)] == [
        (4, 4), (4, 4), (4, 4), (8, 8), (8, 8)]
    assert slots(gen_length=256, extra_queries=8) == (8, 8)
    assert slots(gen_length=512, extra_queries=4, refine_budget=2) == (4, 2)
    with pytest.raises(SamplerError, match="refine_budget"):
        slots(gen_length=512, refine_budget=-1)


# -- properties over random tiny models and random settings -----------------------------
settings_strategy = st.fixed_dictionaries({
    "block_length": st.sampled_from([4, 8]),
    "threshold": st.sampled_from([0.5, 0.9]),
    "max_lanes": st.sampled_from([1, 3, 6]),
    "refine_window": st.sampled_from([0, 2, 8]),
    "stable_fraction": st.sampled_from([0.0, 0.75]),
    "refine_budget": st.sampled_from([0, 2]),
    "extra_queries": st.sampled_from([1, 5]),
    "refresh_travel": st.sampled_from([0, 8]),
    "cascade": st.booleans(),
})


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(opts=settings_strategy, family=st.sampled_from(["llada", "dream"]),
       seed=st.integers(0, 2), delimiter_share=st.sampled_from([0.1, 0.4]))
def test_invariants_hold_for_random_models_and_settings(opts, family, seed, delimiter_share):
    model = make_model(family, lm_scale=30.0, seed=seed)
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    # A random share of the vocabulary serves as delimiters, so forks are frequent; the
    # end-of-text token is among the candidates a random model may commit.
    vocab = np.arange(cfg.vocab_size)
    vocab = vocab[vocab != cfg.mask_token_id]
    delims = rng.choice(vocab, max(1, int(delimiter_share * len(vocab))), replace=False)
    prompts = make_prompts(cfg.vocab_size, lengths=(4, 7), seed=seed)
    res = generate(model, prompts, sampler="asynclane", gen_length=24,
                   delimiters=",".join(map(str, sorted(delims))), **opts)
    check_invariants(res, cfg, cascade=opts["cascade"])
    if opts["max_lanes"] == 1:
        assert np.all(res.stats.forks == 0)
