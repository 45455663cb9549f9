"""Sanity checks of the plain-Python reference samplers themselves."""

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


def _llada(threshold=False):
    return ref.make_model("llada", lm_scale=ref.LM_SCALE_THRESHOLD["llada"] if threshold
                          else ref.LM_SCALE_TOPK)


def _dream(threshold=False):
    return ref.make_model("dream", lm_scale=ref.LM_SCALE_THRESHOLD["dream"] if threshold
                          else ref.LM_SCALE_TOPK)


def _prompts(model, n=3):
    return ref.make_prompts(model.cfg.vocab_size)[:n]


# ----------------------------------------------------------------------------- pure helpers

def test_num_transfer_tokens_spreads_the_remainder_first():
    assert ref.num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert ref.num_transfer_tokens(8, 8) == [1] * 8
    assert ref.num_transfer_tokens(3, 5) == [1, 1, 1, 0, 0]


def test_shift_logits_reads_the_previous_position():
    logits = np.arange(12, dtype=np.float32).reshape(4, 3)
    shifted = ref.shift_logits(logits)
    np.testing.assert_array_equal(shifted[0], logits[0])
    np.testing.assert_array_equal(shifted[1:], logits[:-1])


def test_factor_rule_keeps_the_reference_quirks():
    # thresholds for sorted index 1, 2, 3, ...: 1 - 1/3, 1 - 1/4, 1 - 1/5, ...
    assert ref.factor_commit_count([0.99, 0.5, 0.4, 0.3], 1.0) == 1
    assert ref.factor_commit_count([0.99, 0.9, 0.5, 0.3], 1.0) == 2
    assert ref.factor_commit_count([0.99, 0.9, 0.8, 0.85], 1.0) == 4  # none fails
    # Only the last candidate fails: the reference still commits all of them.
    assert ref.factor_commit_count([0.99, 0.9, 0.1], 1.0) == 3
    assert ref.factor_commit_count([0.2, 0.1], 1.0) == 2
    assert ref.factor_commit_count([0.2], 1.0) == 1
    assert ref.factor_commit_count([], 1.0) == 0


@pytest.mark.parametrize("gen_length,steps", [(32, 32), (32, 16), (32, 8), (32, 5),
                                              (256, 256), (256, 128), (512, 64)])
def test_dream_schedule_commits_everything(gen_length, steps):
    ts = ref.linspace_f32(1.0, 1e-3, steps + 1)
    n, ks = gen_length, []
    for i in range(steps):
        k = ref.dream_transfer_count(n, i, steps, ts)
        assert 0 <= k <= n
        ks.append(k)
        n -= k
    assert n == 0
    if steps == gen_length:
        assert ks[0] == 0  # int(G * (1 - s/t)) = int(0.999) at the first step
    # The float32 schedule equals exact arithmetic here (no integer boundary is close).
    n, exact = gen_length, []
    for i in range(steps):
        t = 1 - i * (1 - 1e-3) / steps
        s = 1 - (i + 1) * (1 - 1e-3) / steps
        k = int(n * (1 - s / t)) if i < steps - 1 else n
        exact.append(k)
        n -= k
    assert ks == exact


def test_dream_schedule_matches_torch_expression():
    torch = pytest.importorskip("torch")
    for gen_length, steps in [(32, 32), (32, 16), (32, 8), (256, 256), (256, 64)]:
        tt = torch.linspace(1, 1e-3, steps + 1)
        ts = ref.linspace_f32(1.0, 1e-3, steps + 1)
        n_torch = n_ref = gen_length
        for i in range(steps):
            mask_index = torch.ones(1, n_torch, dtype=torch.bool)
            mean = mask_index.sum() / mask_index.shape[0]
            k_torch = int(mean * (1 - tt[i + 1] / tt[i])) if i < steps - 1 else int(mean)
            k_ref = ref.dream_transfer_count(n_ref, i, steps, ts)
            assert k_torch == k_ref, (gen_length, steps, i)
            n_torch -= k_torch
            n_ref -= k_ref


# ----------------------------------------------------------------------------- model calls

@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cached_forward_on_a_fresh_cache_equals_the_full_forward(family):
    model = _llada() if family == "llada" else _dream()
    prompt = _prompts(model, 1)[0]
    p = len(prompt)
    x = np.array(prompt + [model.cfg.mask_token_id] * GEN)
    x[p:p + 5] = np.arange(5)  # a partly decoded canvas
    run = ref.runner(model)
    full, kv = run.full_kv(x)
    s = p + 8
    # dual cache: the block's queries; prefix cache: the reference's window [P, T), of
    # which only [s, T) is written (the same shapes the samplers compile).
    np.testing.assert_allclose(run.cached(x, s, s + 8, s, kv), full[s:s + 8], atol=2e-5)
    np.testing.assert_allclose(run.cached(x, p, len(x), s, kv), full[p:], atol=2e-5)


# ----------------------------------------------------------------------------- LLaDA vanilla

def test_vanilla_one_token_per_step_in_block_order():
    model = _llada()
    for prompt in _prompts(model):
        tokens, info = ref.llada_vanilla(model, prompt, gen_length=GEN, block_length=8,
                                         steps=GEN)
        assert info["commits_per_step"] == [1] * GEN
        assert sorted(info["commit_step"].tolist()) == list(range(GEN))
        for b in range(GEN // 8):
            steps_of_block = info["commit_step"][b * 8:(b + 1) * 8]
            assert set(steps_of_block.tolist()) == set(range(b * 8, (b + 1) * 8))
        assert (tokens != model.cfg.mask_token_id).all()
        assert info["nfe_full"] == GEN and info["nfe_partial"] == 0


def test_vanilla_two_tokens_per_step_and_cfg_runs():
    model = _llada()
    prompt = _prompts(model, 1)[0]
    tokens, info = ref.llada_vanilla(model, prompt, gen_length=GEN, block_length=8,
                                     steps=GEN // 2)
    assert info["commits_per_step"] == [2] * (GEN // 2)
    tokens_cfg, info_cfg = ref.llada_vanilla(model, prompt, gen_length=GEN, block_length=GEN,
                                             steps=GEN // 2, cfg_scale=0.5)
    assert (tokens_cfg != model.cfg.mask_token_id).all()
    assert info_cfg["steps"] == GEN // 2


def test_vanilla_random_remasking_and_temperature_fill_the_canvas():
    model = _llada()
    prompt = _prompts(model, 1)[0]
    tokens, info = ref.llada_vanilla(model, prompt, gen_length=GEN, block_length=8, steps=16,
                                     remasking="random", temperature=0.7, seed=3)
    assert (tokens != model.cfg.mask_token_id).all()
    assert info["commits_per_step"] == [2] * 16


# ----------------------------------------------------------------------------- Dream

@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_reference_fills_the_canvas(alg):
    model = _dream()
    prompt = _prompts(model, 1)[0]
    tokens, info = ref.dream_reference(model, prompt, gen_length=GEN, steps=8, alg=alg)
    assert (tokens != model.cfg.mask_token_id).all()
    assert sum(info["commits_per_step"]) == GEN
    assert info["nfe_full"] == 8


def test_dream_top_k_filter_changes_confidence_not_the_greedy_token():
    logits = np.array([[3.0, 2.0, 1.0, 0.0], [0.0, 0.5, 4.0, 3.9]], np.float32)
    conf, x0, _ = ref._dream_sample_tokens(logits)
    conf_k, x0_k, _ = ref._dream_sample_tokens(logits, top_k=2)
    np.testing.assert_array_equal(x0, x0_k)
    assert (conf_k > conf).all()


# ----------------------------------------------------------------------------- Fast-dLLM

@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fast_dllm_first_call_is_shared_by_all_cache_modes(family):
    model = _llada(True) if family == "llada" else _dream(True)
    prompt = _prompts(model, 1)[0]
    outs = {c: ref.fast_dllm(model, prompt, gen_length=GEN, block_length=8, cache=c)
            for c in ("none", "prefix", "dual")}
    first = {c: (tuple(np.flatnonzero(info["commit_step"] == 0)),
                 tuple(tok[info["commit_step"] == 0])) for c, (tok, info) in outs.items()}
    assert first["none"] == first["prefix"] == first["dual"]
    for c, (tokens, info) in outs.items():
        assert (tokens != model.cfg.mask_token_id).all()
        if c == "none":
            assert info["nfe_partial"] == 0
        else:
            assert info["nfe_full"] == GEN // 8  # one refresh per block
        assert info["nfe_full"] + info["nfe_partial"] == len(info["commits_per_step"])


def test_fast_dllm_threshold_above_one_is_vanilla_top1():
    model = _llada()
    for prompt in _prompts(model):
        tokens, info = ref.fast_dllm(model, prompt, gen_length=GEN, block_length=8,
                                     threshold=1.01, cache="none")
        assert info["commits_per_step"] == [1] * GEN
        want, want_info = ref.llada_vanilla(model, prompt, gen_length=GEN, block_length=8,
                                            steps=GEN)
        np.testing.assert_array_equal(tokens, want)
        np.testing.assert_array_equal(info["commit_step"], want_info["commit_step"])


def test_fast_dllm_threshold_commits_several_and_respects_blocks():
    model = _llada(True)
    tokens, info = ref.fast_dllm(model, _prompts(model, 1)[0], gen_length=GEN, block_length=8,
                                 threshold=0.9, cache="dual")
    assert max(info["commits_per_step"]) > 1 and info["threshold_commits"] > 0
    # blocks finish in order: every step of block b precedes every step of block b + 1
    steps = info["commit_step"].reshape(GEN // 8, 8)
    assert (steps.max(axis=1)[:-1] < steps.min(axis=1)[1:]).all()


def test_fast_dllm_dream_block_start_commits_the_first_position():
    model = _dream(True)
    for cache in ("none", "prefix", "dual"):
        tokens, info = ref.fast_dllm(model, _prompts(model, 1)[0], gen_length=GEN,
                                     block_length=8, cache=cache)
        steps = info["commit_step"].reshape(GEN // 8, 8)
        for b in range(GEN // 8):
            first_step = steps[b].min()
            assert steps[b, 0] == first_step
            assert info["commits_per_step"][first_step] == 1
            assert (steps[b, 1:] > first_step).all()


def test_fast_dllm_factor_runs_and_fills_the_canvas():
    model = _llada(True)
    for cache in ("none", "prefix", "dual"):
        tokens, info = ref.fast_dllm(model, _prompts(model, 1)[0], gen_length=GEN,
                                     block_length=8, factor=1.0, cache=cache)
        assert (tokens != model.cfg.mask_token_id).all()
        assert max(info["commits_per_step"]) > 1


# ----------------------------------------------------------------------------- LocalLeap

@pytest.mark.parametrize("family", ["llada", "dream"])
def test_localleap_without_relaxation_is_fast_dllm(family):
    model = _llada(True) if family == "llada" else _dream(True)
    for prompt in _prompts(model, 2):
        want, want_info = ref.fast_dllm(model, prompt, gen_length=GEN, block_length=8,
                                        threshold=0.9, cache="dual")
        for kwargs in (dict(relaxed_threshold=0.9), dict(radius=0)):
            tokens, info = ref.localleap(model, prompt, gen_length=GEN, block_length=8,
                                         threshold=0.9, cache="dual", **kwargs)
            np.testing.assert_array_equal(tokens, want)
            np.testing.assert_array_equal(info["commit_step"], want_info["commit_step"])
            assert info["relaxed_commits"] == 0


def test_localleap_relaxed_rule_fires():
    model = _llada(True)
    relaxed = 0
    for prompt in _prompts(model):
        tokens, info = ref.localleap(model, prompt, gen_length=GEN, block_length=8,
                                     cache="none")
        assert (tokens != model.cfg.mask_token_id).all()
        relaxed += info["relaxed_commits"]
    assert relaxed > 0
