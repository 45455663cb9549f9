"""Early-Bird decoding: each rule on hand-made logits and router outputs (candidate gaps,
the L_min fallback, end-of-text exclusion, the block kept until resolved, the combined
commit rule), the routers' save/load and folding, and end-to-end runs on tiny-llada with
its shipped routers."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asynclane_jax.decoding import eb_routers as ER
from asynclane_jax.decoding import generate
from asynclane_jax.decoding.early_bird import EarlyBirdSchedule, choose_block, lps_commit
from asynclane_jax.decoding.schedule import CallOutput, Context, SamplerError
from asynclane_jax.testbed import routers as R

M, EOS, V = 9, 8, 10  # mask id, end-of-text id, vocabulary of the hand-made cases
P, G = 2, 12


def _ctx():
    return Context(batch=1, prompt_len=P, gen_length=G, shift=0, mask_id=M, eos_id=EOS,
                   stop_ids=(EOS,), pad_len=jnp.zeros((1,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class HandMade(EarlyBirdSchedule):
    """The eb schedule with router outputs given per generated position."""

    p_lbs: tuple = (0.0,) * G
    p_lps: tuple = (0.0,) * G

    def lbs_probs(self, weights, entropy, top1):
        return jnp.asarray(self.p_lbs, jnp.float32)[None]

    def lps_probs(self, weights, features, block_masked):
        return jnp.asarray(self.p_lps, jnp.float32)[None]


def _schedule(**kw):
    kw = {"g_max": 2, "l_min": 3, "fallback_length": 4, "threshold": 0.9, "tau_psi": 0.8,
          "router_digest": "hand-made", **kw}
    return HandMade(gen_length=G, **kw)


def _call(picks):
    """Logits of every generated position: `picks` maps a position to (token, prob);
    every other position predicts token 0 with probability 0.3."""
    probs = np.full((1, G, V), 0.7 / (V - 1))
    probs[0, :, 0] = 0.3
    for pos, (tok, p) in picks.items():
        probs[0, pos] = (1 - p) / (V - 1)
        probs[0, pos, tok] = p
    cols = P + np.arange(G)
    return CallOutput(logits=jnp.log(jnp.asarray(probs, jnp.float32)),
                      targets=jnp.asarray(cols[None], jnp.int32),
                      serve=jnp.ones((1,), bool), full=jnp.asarray(True))


def _step(sched, canvas, state, picks):
    canvas, state = sched.update(_ctx(), canvas, state, _call(picks), None)
    return canvas, state


def _mask(positions, n=G):
    out = np.zeros((1, n), bool)
    out[0, list(positions)] = True
    return jnp.asarray(out)


def _on(mask):
    return np.nonzero(np.asarray(mask)[0])[0].tolist()


# ----------------------------------------------------------------------------- block rule

def test_block_runs_from_the_leftmost_candidate_to_the_first_gap_over_g_max():
    masked = _mask(range(G))
    cand = _mask([2, 3, 5, 9, 10])  # gaps 0, 1, then 3 > g_max=2 before 9
    block, fell = choose_block(masked, cand, g_max=2, l_min=3, fallback_length=4)
    assert _on(block) == [2, 3, 4, 5] and not bool(fell[0])
    # With g_max=3 the gap before 9 is allowed and the run goes on to 10.
    block, _ = choose_block(masked, cand, g_max=3, l_min=3, fallback_length=4)
    assert _on(block) == list(range(2, 11))


def test_committed_positions_are_neither_gap_nor_break():
    masked = _mask([0, 1, 2, 3, 4, 5, 9, 10, 11])  # 6, 7, 8 committed
    cand = _mask([4, 9, 10])  # one masked non-candidate (5) between 4 and 9
    block, fell = choose_block(masked, cand, g_max=2, l_min=3, fallback_length=4)
    assert _on(block) == [4, 5, 9, 10] and not bool(fell[0])


def test_short_block_falls_back_to_the_first_masked_positions():
    masked = _mask([1, 2, 4, 5, 6, 7, 8])
    cand = _mask([6, 7])  # a block of 2 < l_min=3
    block, fell = choose_block(masked, cand, g_max=2, l_min=3, fallback_length=4)
    assert bool(fell[0]) and _on(block) == [1, 2, 4, 5]
    # No candidate at all falls back too.
    block, fell = choose_block(masked, _mask([]), g_max=2, l_min=3, fallback_length=4)
    assert bool(fell[0]) and _on(block) == [1, 2, 4, 5]


def test_end_of_text_predictions_are_never_candidates():
    # Every position is ready by the LBS; 3..6 predict end-of-text, which breaks the run
    # (4 > g_max=2 masked non-candidates), so the block is 0..2; l_min=3 keeps it.
    sched = _schedule(p_lbs=(0.9,) * G, p_lps=(0.0,) * G)
    picks = {i: (EOS if 3 <= i <= 6 else 5, 0.5) for i in range(G)}
    canvas = jnp.asarray([[1, 2] + [M] * G])
    _, state = _step(sched, canvas, sched.init(_ctx()), picks)
    assert _on(state.block) == [0, 1, 2] and int(state.fallbacks[0]) == 0


def test_block_is_kept_until_resolved_and_the_lbs_is_consulted_only_then():
    ready_left = (0.9,) * 4 + (0.0,) * (G - 4)
    sched = _schedule(p_lbs=ready_left)
    canvas = jnp.asarray([[1, 2] + [M] * G])
    state = sched.init(_ctx())
    # Call 1: block 0..3 chosen; position 1 passes the threshold (others do not).
    picks = {i: (5, 0.5) for i in range(G)}
    picks[1] = (6, 0.95)
    canvas, state = _step(sched, canvas, state, picks)
    assert _on(state.block) == [0, 1, 2, 3] and int(state.blocks[0]) == 1
    assert np.asarray(canvas)[0, P + 1] == 6
    # Call 2: the LBS now prefers 6..11, but the block stays until resolved; only the
    # most confident of its masked positions commits (nothing passes).
    sched2 = dataclasses.replace(sched, p_lbs=(0.0,) * 6 + (0.9,) * 6)
    picks = {i: (5, 0.5) for i in range(G)}
    picks[3] = (7, 0.6)
    canvas, state = _step(sched2, canvas, state, picks)
    assert _on(state.block) == [0, 1, 2, 3] and int(state.blocks[0]) == 1
    gen = np.asarray(canvas)[0, P:]
    assert gen[3] == 7 and (gen[[0, 2]] == M).all() and (gen[4:] == M).all()
    # Call 3: the block resolves (0 and 2 pass) ...
    picks = {0: (5, 0.95), 2: (5, 0.97)}
    canvas, state = _step(sched2, canvas, state, picks)
    assert int(state.blocks[0]) == 1
    # ... call 4 chooses a new block from this call's LBS output: 6..11.
    canvas, state = _step(sched2, canvas, state, {i: (5, 0.5) for i in range(G)})
    assert int(state.blocks[0]) == 2 and _on(state.block) == list(range(6, 12))


# ----------------------------------------------------------------------------- commit rule

def test_commit_rule_threshold_or_lps_else_top1():
    bm = jnp.asarray([[True, True, True, True, False]])
    conf = jnp.asarray([[0.95, 0.5, 0.6, 0.3, 0.99]])
    p_psi = jnp.asarray([[0.0, 0.85, 0.7, 0.1, 0.99]])
    got = lps_commit(bm, conf, p_psi, threshold=0.9, tau_psi=0.8)
    assert np.asarray(got).tolist() == [[True, True, False, False, False]]
    # Nothing passes: the most confident block position commits alone.
    low = jnp.asarray([[0.5, 0.3, 0.6, 0.2, 0.99]])  # the 0.99 lies outside the block
    got = lps_commit(bm, low, p_psi * 0.5, threshold=0.9, tau_psi=0.8)
    assert np.asarray(got).tolist() == [[False, False, True, False, False]]
    # An empty block commits nothing.
    got = lps_commit(bm & False, conf, p_psi, threshold=0.9, tau_psi=0.8)
    assert not np.asarray(got).any()


def test_schedule_commits_through_p_psi_inside_the_block_only():
    p_lps = (0.0, 0.95, 0.0, 0.0, 0.95) + (0.0,) * (G - 5)  # 4 lies outside the block
    sched = _schedule(p_lbs=(0.9,) * 4 + (0.0,) * (G - 4), p_lps=p_lps)
    canvas = jnp.asarray([[1, 2] + [M] * G])
    picks = {i: (5, 0.5) for i in range(G)}
    canvas, state = _step(sched, canvas, sched.init(_ctx()), picks)
    gen = np.asarray(canvas)[0, P:]
    assert gen[1] == 5 and (gen[[0, 2, 3]] == M).all() and gen[4] == M
    # Without the LPS (lps=false) the same call commits the top-1 alone (position 0,
    # the first of equal confidences).
    canvas2, _ = _step(dataclasses.replace(sched, lps=False), jnp.asarray([[1, 2] + [M] * G]),
                       sched.init(_ctx()), picks)
    assert _on(jnp.asarray(np.asarray(canvas2)[:, P:] != M)) == [0]


def test_options_are_validated():
    with pytest.raises(SamplerError, match="fallback_length"):
        EarlyBirdSchedule(gen_length=G, fallback_length=0)
    with pytest.raises(SamplerError, match="tau_psi"):
        EarlyBirdSchedule(gen_length=G, tau_psi=1.5)
    with pytest.raises(SamplerError, match="not bound"):
        EarlyBirdSchedule(gen_length=G)._weights()


# ----------------------------------------------------------------------------- routers

def _tiny_weights(tmp_path=None, V=V, d_base=6):
    emb = np.random.default_rng(0).normal(size=(V, d_base)).astype(np.float32)
    lbs = ER.LBSRouter(ER.LBSConfig(vocab_size=V, d_base=d_base, d_feat=8, d_model=16,
                                  ffn=16, max_len=G), embedding=emb, rngs=nnx.Rngs(1))
    lps = ER.LPSRouter(ER.LPSConfig(d_model=8, ffn=8), rngs=nnx.Rngs(2))
    return lbs, lps


def test_folded_lbs_equals_the_trained_router_and_round_trips(tmp_path):
    lbs, lps = _tiny_weights()
    w = ER.RouterWeights.from_modules(lbs=lbs, lps=lps, meta={"tau_psi": 0.8})
    ent = jax.random.uniform(jax.random.key(0), (2, G))
    top1 = jax.random.randint(jax.random.key(1), (2, G), 0, V)
    np.testing.assert_allclose(w.lbs_module()(ent, top1), lbs(ent, top1), rtol=1e-5,
                               atol=1e-5)
    ER.save_routers(tmp_path, w)
    back = ER.load_routers(tmp_path)
    assert back == w and hash(back) == hash(w) and back.meta["tau_psi"] == 0.8
    feats = jax.random.uniform(jax.random.key(2), (2, G, ER.N_LPS_FEATURES))
    mask = jnp.arange(G)[None] < 5
    np.testing.assert_allclose(back.lps_module()(feats, mask), lps(feats, mask), rtol=1e-6)


def test_changed_router_files_are_refused(tmp_path):
    lbs, lps = _tiny_weights()
    w = ER.RouterWeights.from_modules(lbs=lbs, lps=lps, meta={"tau_psi": 0.8})
    out = ER.save_routers(tmp_path, w)
    arrays = dict(np.load(out / ER.WEIGHTS_FILE))
    key = sorted(arrays)[0]
    changed = dict(arrays, **{key: arrays[key] + 1e-3})
    np.savez(out / ER.WEIGHTS_FILE, **changed)
    with pytest.raises(ER.RouterError, match="do not match the digest"):
        ER.load_routers(tmp_path)
    changed[key] = np.full_like(arrays[key], np.nan)
    np.savez(out / ER.WEIGHTS_FILE, **changed)
    with pytest.raises(ER.RouterError, match="non-finite"):
        ER.load_routers(tmp_path)
    np.savez(out / ER.WEIGHTS_FILE, **arrays)
    assert ER.load_routers(tmp_path) == w


def test_losses_and_tau():
    ce = jnp.asarray([[0.1, 3.0, 0.5]])
    m = jnp.ones((1, 3), bool)
    good = R.lbs_loss(jnp.asarray([[9.0, -9.0, 9.0]]), ce, m)  # selects CE < 1 only
    bad = R.lbs_loss(jnp.asarray([[-9.0, 9.0, -9.0]]), ce, m)
    assert float(good) < -0.4 < float(bad)
    # A negative costs twice a positive at the same margin.
    lab = jnp.asarray([[True, False]])
    per = R.lps_loss(jnp.asarray([[-1.0, 1.0]]), lab, jnp.ones((1, 2), bool))
    assert np.isclose(float(per), 3 * float(R.lps_loss(jnp.asarray([[-1.0]]), lab[:, :1],
                                                         jnp.ones((1, 1), bool))) / 2)
    rng = np.random.default_rng(0)
    label = rng.random((50, 40)) < 0.7
    p = np.clip(label * 0.5 + rng.random((50, 40)) * 0.6, 0, 1)
    mask = np.ones_like(label)
    conf = np.zeros(label.shape)
    t = R.choose_tau(p, label, mask, conf, max_fpr=0.01)
    assert t["fpr"] <= 0.01 and 0 < t["tpr"] < 1
    assert np.mean(p[~label] > t["tau_psi"]) == t["fpr"]


def test_lbs_trains_on_text_positions_only_when_asked():
    # Two trace rows of 4 positions; top-1 end-of-text (EOS) at some masked positions.
    top1 = np.asarray([[3, EOS, 4, EOS], [EOS, EOS, 5, 2]], np.int16)
    masked = np.asarray([[True, True, True, False], [True, True, False, True]])
    traces = {"lbs_top1": top1, "masked": masked, "lbs_entropy": np.zeros((2, 4), np.float16),
              "ce": np.zeros((2, 4), np.float16)}
    every = R.lbs_arrays(traces, [0, 1])
    text = R.lbs_arrays(traces, [0, 1], eos_id=EOS)
    np.testing.assert_array_equal(every["masked"], masked)
    np.testing.assert_array_equal(text["masked"], [[True, False, True, False],
                                                   [False, False, False, True]])
    # The shape is a choice; the trained router and its folded weights carry it.
    emb = np.zeros((V, 8), np.float32)
    traces = {k: np.tile(v, (1, 3)) for k, v in traces.items()}
    lbs, _ = R.train_lbs(emb, traces, [0, 1], R.RouterTrainConfig(steps=2, batch=2),
                         eos_id=EOS, shape={"d_feat": 8, "d_model": 16, "ffn": 32})
    assert (lbs.cfg.d_feat, lbs.cfg.d_model, lbs.cfg.ffn, lbs.cfg.n_layers) == (8, 16, 32, 2)
    assert ER.RouterWeights.from_modules(lbs=lbs).lbs_module()(
        jnp.zeros((1, 12)), jnp.zeros((1, 12), jnp.int32)).shape == (1, 12)


# ----------------------------------------------------------------------------- end to end

def _problems(n):
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    problems = tasks.heldout(n)
    return problems, ev.prompts_for(problems)


@pytest.fixture(scope="module")
def tiny_llada():
    import asynclane_jax as aj

    return aj.load("tiny-llada")[0]


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_without_routers_it_is_threshold_decoding_with_the_same_cache(tiny_llada, cache):
    """Fast-dLLM's tokens with the same cache (blocks of 32, threshold 0.9); with
    cache=dual its calls too (tests/decoding/test_early_bird_cache.py: tiny random LLaDA
    and Dream models)."""
    _, prompts = _problems(4)
    a = generate(tiny_llada, prompts, sampler="eb", gen_length=128, lbs=False, lps=False,
                 cache=cache)
    b = generate(tiny_llada, prompts, sampler="fast-dllm", gen_length=128, cache=cache)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.stats.row_fallbacks == a.stats.row_blocks).all()
    if cache == "dual":
        np.testing.assert_array_equal(a.stats.row_nfe_full, b.stats.row_nfe_full)
        np.testing.assert_array_equal(a.stats.row_nfe_partial, b.stats.row_nfe_partial)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_shipped_routers_end_to_end(name, tiny_llada):
    import asynclane_jax as aj
    from asynclane_jax import checkpoint
    from asynclane_jax.testbed import tasks

    assert ER.has_routers(checkpoint.resolve(name)), f"{name} ships no routers"
    model = tiny_llada if name == "tiny-llada" else aj.load(name)[0]
    problems, prompts = _problems(8)
    res = generate(model, prompts, sampler="eb", gen_length=256)
    assert not res.stats.hit_step_cap
    assert not (res.tokens == model.cfg.mask_token_id).any()
    assert res.stats.options["router_digest"] and res.stats.options["tau_psi"] is not None
    # The model's own routers, found by its config.
    assert pathlib.Path(res.stats.options["routers"]).resolve() == \
        pathlib.Path(checkpoint.resolve(name)).resolve()
    assert ER.load_routers(res.stats.options["routers"]).digest == \
        res.stats.options["router_digest"]
    assert (res.stats.row_blocks >= 1).all()
    assert sum(tasks.check(p, row) for p, row in zip(problems, res.tokens)) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada-v4b", "tiny-dream-v4"])
def test_shipped_routers_of_the_long_answer_models(name):
    """The v4 models' own routers, found through their folders, decode the first 8
    held-out problems of v4 (4 short, 4 long answers) at gen_length 512 with no mask
    left, and answer at least 6 (on 100 held-out problems eb scores 86.0% and 95.0%:
    experiments/results/baselines/eb_<model>.md)."""
    import asynclane_jax as aj
    from asynclane_jax import checkpoint
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    folder = checkpoint.resolve(name)
    assert ER.has_routers(folder), f"{name} ships no routers"
    model = aj.load(name)[0]
    problems = tasks.heldout(8, "v4")
    res = generate(model, ev.prompts_for(problems), sampler="eb", gen_length=512)
    assert not res.stats.hit_step_cap
    assert not (res.tokens == model.cfg.mask_token_id).any()
    assert pathlib.Path(res.stats.options["routers"]).resolve() == pathlib.Path(folder).resolve()
    assert ER.load_routers(folder).digest == res.stats.options["router_digest"]
    assert sum(tasks.check(p, row) for p, row in zip(problems, res.tokens)) >= 6


def test_missing_routers_are_reported(tiny_llada, tmp_path):
    _, prompts = _problems(1)
    with pytest.raises(SamplerError, match="no router weights"):
        generate(tiny_llada, prompts, sampler="eb", gen_length=32, routers=str(tmp_path))


def test_router_traces_are_the_drivers_decode(tiny_llada):
    """decode_traces runs the driver's own step: the same rows, steps and answers as
    `generate` with the same schedule."""
    from asynclane_jax.testbed import tasks

    problems, prompts = _problems(4)
    sched = EarlyBirdSchedule(gen_length=64, lbs=False, lps=False)
    traces = R.decode_traces(tiny_llada, problems, sched, batch=4)
    res = generate(tiny_llada, prompts, sampler=sched)
    np.testing.assert_array_equal(traces["steps"], res.stats.row_steps)
    np.testing.assert_array_equal(traces["correct"],
                                  [tasks.check(p, row) for p, row in zip(problems, res.tokens)])
    assert len(traces["step"]) == res.stats.row_steps.sum()


def test_router_weights_are_operands_not_constants(tiny_llada):
    """Routers of one shape share a compiled program, and their values still decide."""
    from asynclane_jax import checkpoint
    from asynclane_jax.decoding import driver

    w = ER.load_routers(checkpoint.resolve("tiny-llada"))
    # The same shapes; an LBS head that scores every position far below 0.5, so no
    # position is a candidate and every block falls back.
    silent = dict(w.lbs, **{"head/bias": np.full_like(w.lbs["head/bias"], -1e4)})
    w2 = ER.RouterWeights(w.lbs_config, silent, w.lps_config, w.lps, w.meta)
    assert w2.digest != w.digest
    _, prompts = _problems(4)
    sched = EarlyBirdSchedule(gen_length=64, tau_psi=0.8)
    before = driver.TRACE_COUNT["decode"]
    a = generate(tiny_llada, prompts, sampler=sched.with_weights(w))
    b = generate(tiny_llada, prompts, sampler=sched.with_weights(w2))
    assert driver.TRACE_COUNT["decode"] - before <= 1 and not b.stats.compiled
    assert a.stats.options["router_digest"] == w.digest
    assert b.stats.options["router_digest"] == w2.digest
    assert "weights" not in a.stats.options
    assert (b.stats.row_fallbacks == b.stats.row_blocks).all()
    assert a.stats.row_fallbacks.sum() < a.stats.row_blocks.sum()
