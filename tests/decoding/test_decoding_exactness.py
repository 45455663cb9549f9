"""The jitted decode engine against the plain-Python references, token for token.

The engine is called ONCE per case with a batch of prompts of different lengths; every
row must equal that prompt decoded alone by the reference (greedy, float32, highest
matmul precision). Also compared: the step at which each position was committed (up to
a constant offset per row, so 0- or 1-based counters both pass) and the model-call
counts.

The test models are sharpened (see ``reference_samplers.make_model``) so that threshold
rules really commit several tokens per step; each threshold case asserts that it did, so
no case passes vacuously. Every reference run also asserts that none of its decisions was
a float near-tie (``_assert_no_near_ties``): if one fires, change the seed, never the
tolerance.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

try:  # pytest puts tests/ on sys.path while it is not a package
    import reference_samplers as ref
except ImportError:  # pragma: no cover
    from tests import reference_samplers as ref

GEN = 32
# Engine/reference float noise (padding, batching, reduction order) is ~1e-6 on logits of
# this size and ~1e-7 on probabilities; decisions closer than these are near-ties.
MIN_LOGIT_MARGIN = 1e-4
MIN_CONF_MARGIN = 1e-6


def _generate(model, prompts, **kwargs):
    from asynclane_jax.decoding import generate

    return generate(model, prompts, **kwargs)


def _assert_no_near_ties(info, what):
    assert info["logit_margin"] > MIN_LOGIT_MARGIN, (
        f"{what}: argmax near-tie in the reference ({info['logit_margin']:.2e}); pick another "
        "model seed")
    assert info["conf_margin"] > MIN_CONF_MARGIN, (
        f"{what}: confidence near-tie in the reference ({info['conf_margin']:.2e}); pick "
        "another model seed")


def _stat(stats, key, batch):
    value = np.asarray(stats[key])
    return value if value.shape == (batch,) else None


def _compare(model, prompts, engine_kwargs, reference, reference_kwargs, *,
             compare_nfe=True):
    """Runs the engine once on the batch and the reference per prompt; compares all."""
    refs = [reference(model, p, **reference_kwargs) for p in prompts]
    for r, (tokens, info) in enumerate(refs):
        _assert_no_near_ties(info, f"row {r}")
        assert (tokens != model.cfg.mask_token_id).all()

    res = _generate(model, prompts, **engine_kwargs)
    tokens = np.asarray(res.tokens)
    assert tokens.shape == (len(prompts), GEN), tokens.shape
    for r, (want, _) in enumerate(refs):
        np.testing.assert_array_equal(tokens[r], want, err_msg=f"row {r} (prompt length "
                                      f"{len(prompts[r])}) differs from the reference")

    commit_step = np.asarray(res.stats["commit_step"])
    assert commit_step.shape == (len(prompts), GEN), commit_step.shape
    for r, (_, info) in enumerate(refs):
        offset = commit_step[r] - info["commit_step"]
        assert (offset == offset[0]).all(), (
            f"row {r}: commit steps {commit_step[r].tolist()} vs reference "
            f"{info['commit_step'].tolist()}")

    keys = ("nfe_full", "nfe_partial") if compare_nfe else ()
    per_row = {k: _stat(res.stats, k, len(prompts)) for k in (*keys, "steps")}
    if all(v is not None for v in per_row.values()):
        for k, v in per_row.items():
            assert v.tolist() == [info[k] for _, info in refs], k
    else:
        # Batch-level counters: the lockstep loop runs as long as the slowest row, and
        # call counts are only comparable for a batch of one.
        steps = np.asarray(res.stats["steps"])
        if steps.ndim == 0:
            assert int(steps) == max(info["steps"] for _, info in refs)
        if keys:
            single = _generate(model, prompts[:1], **engine_kwargs)
            np.testing.assert_array_equal(np.asarray(single.tokens)[0], refs[0][0])
            for k in keys:
                assert int(np.asarray(single.stats[k]).reshape(-1)[0]) == refs[0][1][k], k
    return refs


def _committed_several_at_once(refs):
    return max(max(info["commits_per_step"]) for _, info in refs) > 1


# ----------------------------------------------------------------------------- LLaDA vanilla

@pytest.mark.parametrize("block_length,steps,cfg_scale", [(8, 32, 0.0), (32, 16, 0.5)],
                         ids=["blocks8-steps32", "single-block-steps16-cfg"])
def test_vanilla_matches_reference(block_length, steps, cfg_scale):
    model = ref.make_model("llada", lm_scale=ref.LM_SCALE_TOPK)
    prompts = ref.make_prompts(model.cfg.vocab_size)
    refs = _compare(
        model, prompts,
        dict(sampler="vanilla", gen_length=GEN, block_length=block_length, steps=steps,
             remasking="low_confidence", temperature=0.0, cfg_scale=cfg_scale),
        ref.llada_vanilla,
        dict(gen_length=GEN, block_length=block_length, steps=steps, cfg_scale=cfg_scale))
    # A guided pair is one call in both (the reference's loop counts it once).
    for _, info in refs:
        assert set(info["commits_per_step"]) == {GEN // steps}


def test_a_guided_call_is_counted():
    """Classifier-free guidance runs the prompt and its masked copy as one call of twice
    the rows: one full forward per step, its positions counted twice."""
    from asynclane_jax.decoding import generate

    model = ref.make_model("llada", lm_scale=ref.LM_SCALE_TOPK)
    prompts = ref.make_prompts(model.cfg.vocab_size)[:1]
    opts = dict(sampler="vanilla", gen_length=GEN, block_length=GEN, steps=8)
    plain = generate(model, prompts, **opts).stats
    guided = generate(model, prompts, cfg_scale=0.5, **opts).stats
    assert guided.nfe_full == plain.nfe_full == guided.steps == 8
    assert list(guided.row_nfe_full) == [8]
    assert guided.tokens_processed == 2 * plain.tokens_processed


# ----------------------------------------------------------------------------- Dream

@pytest.mark.parametrize("alg,steps", [("maskgit_plus", 32), ("topk_margin", 16),
                                       ("entropy", 8)])
def test_dream_matches_reference(alg, steps):
    model = ref.make_model("dream", lm_scale=ref.LM_SCALE_TOPK)
    prompts = ref.make_prompts(model.cfg.vocab_size)
    refs = _compare(
        model, prompts,
        dict(sampler="dream", gen_length=GEN, steps=steps, alg=alg, temperature=0.0),
        ref.dream_reference, dict(gen_length=GEN, steps=steps, alg=alg))
    if steps == GEN:  # Dream's schedule commits nothing at the first of GEN steps
        assert refs[0][1]["commits_per_step"][0] == 0
    if steps < GEN:
        assert _committed_several_at_once(refs)


# ----------------------------------------------------------------------------- Fast-dLLM

FAST_DLLM_CASES = [
    *[(family, cache, 8, dict(threshold=0.9))
      for family in ("llada", "dream") for cache in ("none", "prefix", "dual")],
    ("llada", "dual", GEN, dict(threshold=0.9)),
    ("dream", "prefix", GEN, dict(threshold=0.9)),
    ("llada", "none", 8, dict(factor=1.0)),
    ("llada", "dual", 8, dict(factor=1.0)),
    ("dream", "prefix", 8, dict(factor=1.0)),
]


@pytest.mark.parametrize(
    "family,cache,block_length,rule", FAST_DLLM_CASES,
    ids=[f"{f}-{c}-B{b}-{next(iter(r))}" for f, c, b, r in FAST_DLLM_CASES])
def test_fast_dllm_matches_reference(family, cache, block_length, rule):
    model = ref.make_model(family, lm_scale=ref.LM_SCALE_THRESHOLD[family])
    prompts = ref.make_prompts(model.cfg.vocab_size)
    refs = _compare(
        model, prompts,
        dict(sampler="fast-dllm", gen_length=GEN, block_length=block_length, cache=cache,
             **rule),
        ref.fast_dllm, dict(gen_length=GEN, block_length=block_length, cache=cache, **rule))
    assert _committed_several_at_once(refs), "the threshold path was never exercised"
    assert any(1 in info["commits_per_step"] for _, info in refs), (
        "the top-1 fallback was never exercised")


# ----------------------------------------------------------------------------- LocalLeap

@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_localleap_matches_reference(family, cache):
    model = ref.make_model(family, lm_scale=ref.LM_SCALE_THRESHOLD[family])
    prompts = ref.make_prompts(model.cfg.vocab_size)
    knobs = dict(threshold=0.9, relaxed_threshold=0.75, radius=4)
    refs = _compare(
        model, prompts,
        dict(sampler="localleap", gen_length=GEN, block_length=8, cache=cache, **knobs),
        ref.localleap, dict(gen_length=GEN, block_length=8, cache=cache, **knobs))
    assert sum(info["relaxed_commits"] for _, info in refs) > 0, (
        "the relaxed-threshold path was never exercised")
