"""Samplers other than `llada2` on a block-causal LLaDA2 model, through the one driver:
D2F (made for block-causal students) decodes the tiny random LLaDA2 model as its
restatement of the public D2F decoding does, token for token and call for call; a sampler
with no attention layout of its own (fast-dllm, asynclane) gets the model's, LLaDA2's
blocks, and commits a position only once the blocks before it are finished."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference_samplers import d2f, make_prompts
from test_llada2_decode import tiny_llada2

from asynclane_jax.decoding import generate


@pytest.mark.slow
def test_d2f_decodes_llada2_as_its_restatement():
    model = tiny_llada2(lm_scale=60.0)
    assert model.cfg.block_causal
    prompts = make_prompts(model.cfg.vocab_size)
    kw = dict(block_add_threshold=0.5, decoded_token_threshold=0.5, skip_threshold=0.5)
    res = generate(model, prompts, sampler="d2f", gen_length=16, block_length=8,
                   max_active_blocks=2, **kw)
    assert res.stats.nfe_full == 0  # every call cached, block-causal
    assert not np.any(res.tokens == model.cfg.mask_token_id)
    for i, p in enumerate(prompts):
        tokens, info = d2f(model, p, gen_length=16, block_length=8, **kw)
        assert info["logit_margin"] > 1e-4 and info["conf_margin"] > 1e-5
        np.testing.assert_array_equal(res.tokens[i], tokens, err_msg=f"row {i}")
        assert res.stats.row_nfe_partial[i] == info["steps"]



def _threshold_block_causal(model, prompt, *, gen_length, block_length, threshold):
    """Fast-dLLM's threshold rule without a cache (every step a forward over the
    canvas), restated on LLaDA2's attention: blocks of 32 columns from the first prompt
    token, a query seeing its own block and the earlier ones. The sampler's blocks of B
    start where the attention's do: the first one (P mod 32) mod B prompt positions
    before the generation, the last one cut at the canvas's end. A position commits
    only once every earlier attention block is finished (Context.commit_gate), so a
    block of the sampler that straddles two attention blocks decodes the first one's
    positions, then the second's. Returns (tokens, steps, smallest gap between a
    confidence and the threshold, how many steps a gate held back a position over the
    threshold)."""
    import jax
    import jax.numpy as jnp

    mask = model.cfg.mask_token_id
    P, T = len(prompt), len(prompt) + gen_length
    canvas = np.asarray(list(prompt) + [mask] * gen_length, np.int32)
    blocks = np.arange(T, dtype=np.int32) // 32
    forward = jax.jit(lambda c: model(c[None], block_ids=jnp.asarray(blocks)[None])[0])
    steps, gap, held = 0, np.inf, 0
    lead = (P % 32) % block_length
    for start in range(P - lead, T, block_length):
        span = np.arange(max(start, P), min(start + block_length, T))
        while np.any(canvas[span] == mask):
            probs = np.asarray(jax.nn.softmax(forward(jnp.asarray(canvas)), axis=-1))
            steps += 1
            masked = span[canvas[span] == mask]
            first = blocks[P:][canvas[P:] == mask].min()  # the first unfinished block
            cand = masked[blocks[masked] <= first]
            later = masked[blocks[masked] > first]
            held += bool(len(later)) and bool(np.any(probs[later].max(-1) >= threshold))
            conf = probs[cand].max(-1)
            commit = conf >= threshold
            commit[np.argmax(conf)] = True
            gap = min(gap, float(np.min(np.abs(conf - threshold))))
            canvas[cand[commit]] = probs[cand[commit]].argmax(-1)
    return canvas[P:], steps, gap, held


@pytest.mark.slow
def test_a_sampler_without_a_layout_decodes_llada2_with_its_blocks():
    """fast-dllm sets no attention layout; on a LLaDA2 model the driver gives it the
    model's own (blocks of 32 from the first prompt token), and its blocks follow the
    model's, so it decodes as its threshold rule restated on that attention, row by row
    in a left-padded batch. Blocks of 12 do not divide the model's 32: the gate orders
    the two attention blocks a sampler block straddles."""
    model = tiny_llada2(lm_scale=60.0)
    prompts = make_prompts(model.cfg.vocab_size)
    res = generate(model, prompts, sampler="fast-dllm", cache="none", gen_length=48,
                   block_length=12, threshold=0.7)
    held, leads = 0, set()
    for i, p in enumerate(prompts):
        assert (len(p) + 48) > 32  # every row spans two attention blocks
        leads.add((len(p) % 32) % 12)
        tokens, steps, gap, h = _threshold_block_causal(model, p, gen_length=48,
                                                        block_length=12, threshold=0.7)
        assert gap > 1e-5
        np.testing.assert_array_equal(res.tokens[i], tokens, err_msg=f"row {i}")
        assert res.stats.row_nfe_full[i] == steps
        held += h
    assert held  # the gate decided something: a position over the threshold waited
    assert len(leads) > 1  # the rows' blocks start at different places


@pytest.mark.slow
def test_blocks_that_follow_the_model_keep_the_caches_exact():
    """With blocks of the model's 32, a Fast-dLLM block is one attention block of the
    model: what its cached calls do not recompute (the finished blocks before it) cannot
    change, and what comes after it is not attended. So the prefix and dual caches give
    the tokens of no cache, every row, and spend fewer full forwards."""
    model = tiny_llada2(lm_scale=60.0)
    prompts = make_prompts(model.cfg.vocab_size)
    runs = {cache: generate(model, prompts, sampler="fast-dllm", cache=cache,
                            gen_length=64, block_length=32, threshold=0.7)
            for cache in ("none", "prefix", "dual")}
    assert not np.any(runs["none"].tokens == model.cfg.mask_token_id)
    for cache in ("prefix", "dual"):
        np.testing.assert_array_equal(runs[cache].tokens, runs["none"].tokens,
                                      err_msg=cache)
        assert runs[cache].stats.nfe_partial > 0
        assert runs[cache].stats.nfe_full < runs["none"].stats.nfe_full


def _gate_breaches(prompts, tokens, commit_step, stop_ids) -> int:
    """Generated positions committed while an earlier attention block (LLaDA2's blocks
    of 32 from the row's first prompt token) still held a mask: at a row iteration no
    later than some position of an earlier block. The end-of-text tail a cascade or an
    early stop writes is left out (it is not predicted)."""
    breaches = 0
    for prompt, row, steps in zip(prompts, tokens, commit_step):
        stops = [j for j, t in enumerate(row) if int(t) in stop_ids]
        end = stops[0] + 1 if stops else len(row)
        blocks = (len(prompt) + np.arange(len(row))) // 32
        breaches += sum(bool(np.any(steps[:end][blocks[:end] < blocks[j]] >= steps[j]))
                        for j in range(end))
    return breaches


def _ungated(schedule):
    """The same schedule, of a subclass that does not ask the driver for the gate."""
    cls = type(f"Ungated{type(schedule).__name__}", (type(schedule),),
               {"gated_commits": False})
    return cls(**{f.name: getattr(schedule, f.name)
                  for f in dataclasses.fields(schedule) if f.init})


@pytest.mark.slow
def test_samplers_that_run_ahead_commit_only_after_the_earlier_blocks():
    """tiny-llada2-v4 under AsyncLane (which forks and runs its continuation ahead) and
    Fast-dLLM's dual cache (blocks from the prompt's end, straddling the model's): no
    position commits before every earlier attention block is finished, as the model
    was trained (Context.commit_gate); with the gate off both do."""
    import asynclane_jax as aj
    from asynclane_jax.decoding import make_schedule
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    model, tok, cfg = aj.load("tiny-llada2-v4")
    prompts = ev.prompts_for(tasks.heldout(1, "v4"))
    stop_ids = set(cfg.stop_token_ids)
    for name, options in (("asynclane", {}), ("fast-dllm", {"cache": "dual"})):
        schedule = make_schedule(name, gen_length=64, **options)
        for sched, gated in ((schedule, True), (_ungated(schedule), False)):
            res = generate(model, prompts, sampler=sched, gen_length=64, tokenizer=tok)
            assert not np.any(res.tokens == cfg.mask_token_id)
            breaches = _gate_breaches(prompts, res.tokens, res.stats.commit_step, stop_ids)
            assert (breaches == 0) == gated, (name, gated, breaches)
            if name == "asynclane":
                assert np.sum(res.stats.forks) > 0  # the continuation did run ahead
