"""The block samplers on AsyncLane's footing: the visible horizon and the cascade as
options of BlockSchedule (block.py). The bench's comparisons that use them are tested in
tests/commands/test_bench_compare.py.

- The horizon's promise, on the shipped tiny-llada: with horizon=96 (block 32), cascade
  and early stop, Fast-dLLM and LocalLeap at gen_length 512 make exactly the tokens and
  the calls they make at 128 with the same options, while the answer fits; and those
  tokens are the published sampler's at 128 through the block holding the answer's end.
- The cascade on hand-made logits: an end-of-text committed mid-block ends the row at
  once.
- The widening on hand-made logits: a row entering a block near the end of its view is
  shown the whole canvas by that block's refresh, at no extra call; an answer longer
  than the initial view comes out whole, equal to the horizon-free decode (AsyncLane
  with lanes off and forking, Fast-dLLM with the horizon).
- Validation and the registry's options.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asynclane_jax
from asynclane_jax.decoding import generate
from asynclane_jax.decoding.registry import build, get_schedule_class, option_docs, option_fields
from asynclane_jax.decoding.schedule import CallOutput, Context, SamplerError
from asynclane_jax.testbed import evaluate, tasks

# The bench's (c) setting under the visible horizon of earlier AsyncLane defaults.
ON = dict(horizon=96, cascade=True, early_stop=True)


# ------------------------------------------------------------ the shipped model

@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, cfg = asynclane_jax.load("tiny-llada")
    problems = tasks.heldout(4)  # math and code alternate: answers end in blocks 0 and 1
    return model, cfg, problems, evaluate.prompts_for(problems, tokenizer)


def first_stop(row, stop_ids) -> int:
    hit = np.flatnonzero(np.isin(row, stop_ids))
    return int(hit[0]) if hit.size else len(row)


@pytest.mark.parametrize("sampler", ["fast-dllm", "localleap"])
def test_the_horizon_makes_512_decode_as_128(shipped, sampler):
    # The dual cache (the bench's choice); the prefix cache under the horizon is checked
    # on hand-made logits below.
    cache = "dual"
    model, cfg, problems, prompts = shipped
    stops = list(cfg.stop_token_ids)
    bucket = max(len(p) for p in prompts)

    def run(g, **opts):
        return generate(model, prompts, sampler=sampler, gen_length=g, cache=cache,
                        bucket=bucket, **opts)

    long, short, off = run(512, **ON), run(128, **ON), run(128)
    ends = [first_stop(row, stops) for row in short.tokens]
    # The answers fit: each ends before the window would reach position 64, where
    # 64 + 32 + 96 // 2 > 128 would widen the view; both blocks 0 and 1 occur.
    assert max(ends) < 64 and min(ends) < 32 <= max(ends)

    # (1) The promise: 512 decodes as 128, token for token and call for call, and no
    # position past the first 128 goes through the model (tokens_processed).
    np.testing.assert_array_equal(long.tokens[:, :128], short.tokens)
    assert np.all(long.tokens[:, 128:] == cfg.eos_token_id)
    np.testing.assert_array_equal(long.stats.commit_step[:, :128], short.stats.commit_step)
    for field in ("row_nfe_full", "row_nfe_partial", "row_steps"):
        np.testing.assert_array_equal(getattr(long.stats, field), getattr(short.stats, field))
    assert long.stats.tokens_processed == short.stats.tokens_processed
    # One full forward per block the answer reaches (the bounded block-start refresh).
    np.testing.assert_array_equal(long.stats.row_nfe_full, 1 + (np.asarray(ends) >= 32))

    # (2) Against the sampler as published at 128 (no horizon, no cascade, no early
    # stop). At 128 the horizon shows everything (block 32 + horizon 96 = 128), so the
    # options differ only in how the row ends. Equal: every token through the end of
    # the block holding the first end-of-text, hence the answer text; the published
    # sampler then decodes the remaining blocks, which cost calls (more full forwards)
    # and need not be end-of-text. Not guaranteed in general: the cascade turns the
    # positions after an end-of-text at p into end-of-text at once, so a position before
    # p still masked at that call is then decided against end-of-text where the
    # published sampler shows masks or its own tokens; on these problems that changes
    # no token.
    for i, e in enumerate(ends):
        block_end = (e // 32 + 1) * 32
        np.testing.assert_array_equal(short.tokens[i, :block_end], off.tokens[i, :block_end])
        assert first_stop(off.tokens[i], stops) == e
        assert evaluate.check(problems[i], short.tokens[i]) == evaluate.check(
            problems[i], off.tokens[i])
    assert np.all(off.stats.row_nfe_full == 4)  # every block of the 128 positions
    assert np.all(short.stats.row_nfe_full + short.stats.row_nfe_partial
                  <= off.stats.row_nfe_full + off.stats.row_nfe_partial)


# ------------------------------------------------------------ hand-made logits

V, MASK, EOS, P = 8, 7, 6, 4


def confident_table(G, eos_at=None, unsure=()):
    """[G, V] logits predicting each generated position, whatever the call: token 1 at
    probability ~0.998, the end-of-text at eos_at more confident still, and at the
    `unsure` positions token 2 at ~0.28 (below every threshold), a little less confident
    the later they are."""
    j = np.arange(G)
    logits = np.zeros((G, V), np.float32)
    logits[:, MASK] = -1e9
    logits[:, 1] = 8.0
    if eos_at is not None:
        logits[eos_at, [1, EOS]] = 0.0, 12.0
    low = np.isin(j, unsure)
    logits[low, 1] = 0.0
    logits[low, 2] = 1.0 - 0.001 * j[low]
    return logits


def make_ctx(G):
    return Context(batch=1, prompt_len=P, gen_length=G, shift=0, mask_id=MASK, eos_id=EOS,
                   stop_ids=(EOS,), pad_len=jnp.zeros((1,), jnp.int32))


def drive(schedule, table):
    """Runs a schedule by hand (batch 1, no logit shift) with logits from `table`
    whatever it queries; returns (generated tokens, the plans made)."""
    G = schedule.gen_length
    T = P + G
    ctx = make_ctx(G)
    by_column = jnp.asarray(np.concatenate([np.zeros((P, V), np.float32), table]))
    canvas = jnp.concatenate([jnp.zeros((1, P), jnp.int32),
                              jnp.full((1, G), MASK, jnp.int32)], axis=1)
    state, live, plans = schedule.init(ctx), jnp.ones((1,), bool), []
    # Eagerly: a few dozen small steps cost less than compiling them.
    update = lambda *a: schedule.update(ctx, *a)  # noqa: E731
    plan = lambda *a: schedule.plan(ctx, *a)  # noqa: E731
    while not bool(schedule.done(ctx, canvas, state)[0]):
        assert len(plans) < schedule.max_iterations()
        p = plan(canvas, state, live)
        plans.append(p)
        out = CallOutput(logits=by_column[jnp.minimum(p.positions, T - 1)],
                         targets=p.positions, serve=p.serve & live, full=p.full)
        canvas, state = update(canvas, state, out, jax.random.PRNGKey(0))
    return np.asarray(canvas[0, P:]), plans


@pytest.mark.parametrize("sampler,opts", [
    ("fast-dllm", dict(cache="dual")), ("localleap", dict(cache="prefix")),
    ("vanilla", dict(steps=8)),
])
def test_the_cascade_ends_the_row_mid_block(sampler, opts):
    # An end-of-text at position 5 of the first block, three unsure positions after it.
    G, e = 64, 5
    table = confident_table(G, eos_at=e, unsure=[6, 7, 8])
    calls = {}
    for mode in ("published", "early_stop", "cascade"):
        flags = {"early_stop": mode == "early_stop", "cascade": mode == "cascade"}
        tokens, plans = drive(build(sampler, gen_length=G, **opts, **flags), table)
        calls[mode] = len(plans)
        assert np.all(tokens[:e] == 1) and tokens[e] == EOS
        if mode == "cascade":  # at once, mid-block
            assert np.all(tokens[e + 1:] == EOS)
        elif mode == "early_stop":  # once the block is finished
            assert np.all(tokens[6:9] == 2) and np.all(tokens[32:] == EOS)
    if sampler == "vanilla":  # 8 commits a step: the end-of-text and 0..4 in the first
        assert calls == {"published": 8, "early_stop": 4, "cascade": 1}
    else:  # the first call commits all but the unsure three, then one a call
        assert calls == {"published": 5, "early_stop": 4, "cascade": 1}


@pytest.mark.parametrize("cache", ["dual", "prefix"])
@pytest.mark.parametrize("G,horizon,widen_at", [(512, 96, 2), (128, 8, 1)])
def test_the_view_widens_at_the_refresh_near_its_end(G, horizon, widen_at, cache):
    # One unsure position per block: a refresh, then one cached call, per block.
    B = 32
    table = confident_table(G, unsure=np.arange(0, G, B) + 7)
    sched = build("fast-dllm", gen_length=G, cache=cache, horizon=horizon)
    V0 = B + horizon
    assert sched.key_bound(make_ctx(G)) == P + V0
    tokens, plans = drive(sched, table)
    assert np.all(tokens == np.where(np.isin(np.arange(G), np.arange(0, G, B) + 7), 2, 1))
    assert len(plans) == 2 * (G // B)  # as without the horizon: widening costs no call
    for k, p in enumerate(plans):
        block, full = k // 2, bool(p.full)
        assert full == (k % 2 == 0)
        visible = int(p.visible[0])
        # Blocks before widen_at see the first V0 generated positions; from the refresh
        # of block widen_at on, the whole canvas.
        assert visible == (P + V0 if block < widen_at else P + G), (k, visible)
        valid = np.asarray(p.positions[0])
        assert np.all(valid[valid < P + G] < visible)  # nothing hidden is queried


@pytest.mark.parametrize("sampler,opts", [
    ("asynclane", dict(max_lanes=1, horizon=96, refresh_travel=0)),
    ("asynclane", dict(horizon=96, max_lanes=16)),
    ("fast-dllm", dict(cache="dual", horizon=96, early_stop=True, cascade=True)),
], ids=["asynclane", "asynclane-forking", "fast-dllm-horizon"])
def test_an_answer_longer_than_the_view_comes_out_whole(sampler, opts):
    # The answer ends at position 200, past the initial view (block 32 + horizon 96):
    # the view widens before the window reaches its end, and where the model is
    # confident whatever it sees the decode is the horizon-free one, call for call.
    G, B, end = 256, 32, 200
    table = confident_table(G, eos_at=end, unsure=np.arange(0, G, B) + 7)
    tokens, plans = drive(build(sampler, gen_length=G, **opts), table)
    free, free_plans = drive(build(sampler, gen_length=G, **{**opts, "horizon": 0}), table)
    np.testing.assert_array_equal(tokens, free)
    assert len(plans) == len(free_plans)
    assert first_stop(tokens, [EOS]) == end and np.all(tokens[end:] == EOS)
    assert np.all(tokens[:end][(np.arange(end) % B) != 7] == 1)
    visible = [int(p.visible[0]) for p in plans]
    assert visible[0] == P + B + 96 and visible[-1] == P + G
    assert visible == sorted(visible)  # the view only widens


# ------------------------------------------------------------ options and validation

@pytest.mark.parametrize("opts,needle", [
    (dict(sampler="fast-dllm", cache="dual", horizon=-1), "horizon=-1 must be a whole number"),
    (dict(sampler="localleap", cache="dual", horizon=1.5), "horizon=1.5 must be a whole"),
    (dict(sampler="fast-dllm", cache="dual", horizon=True), "horizon=True must be a whole"),
    (dict(sampler="fast-dllm", horizon=96), "horizon=96 needs a cache"),
    (dict(sampler="localleap", cascade="yes"), "cascade='yes' must be true or false"),
    (dict(sampler="vanilla", horizon=96), "unknown option"),
])
def test_bad_options_are_refused_in_one_line(opts, needle):
    with pytest.raises(SamplerError, match=needle) as err:
        build(opts.pop("sampler"), gen_length=128, **opts)
    assert "\n" not in str(err.value)


def test_options_off_by_default_and_documented():
    for name in ("fast-dllm", "localleap"):
        cls = get_schedule_class(name)
        fields, docs = option_fields(cls), option_docs(cls)
        assert fields["horizon"].default == 0 and fields["cascade"].default is False
        assert "horizon" in docs and "cascade" in docs
        sched = build(name, gen_length=512, cache="dual")
        assert sched.key_bound(make_ctx(512)) is None  # as published: the whole canvas
    # The fixed-step samplers have no cache, so no horizon; the cascade they take.
    for name in ("vanilla", "dream"):
        fields = option_fields(get_schedule_class(name))
        assert "horizon" not in fields and "cascade" in fields
