"""AsyncLane with forking on: refinement and advancement at once, and the invariants.

- A constructed case (hand-made logits, the schedule driven by hand): every block has
  one position the model is unsure of before a delimiter. With forking, a continuation
  lane commits while a refine lane is alive (overlap), the row takes fewer iterations
  than with forking off, no iteration commits nothing (the refine lanes' best is
  forced while one is open), and no refine lane reads its prefix through stale K/V.
- Hypothesis properties over random tiny models with forking on (docs/asynclane.md, "The
  lane tree in the stats"): no mask left, the end-of-text tail, lane spans tiling the region, a
  valid lane tree, one compiled program for all examples of a shape, and batch rows
  equal to single runs. The settings are fixed per family, so the examples vary only
  array inputs (weights, prompts) and reuse the compiled programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_samplers import make_model, make_prompts
from test_asynclane import check_invariants

from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.asynclane import AsyncLaneSchedule
from asynclane_jax.decoding.lanes import DONE, REFINE, TERMINATED
from asynclane_jax.decoding.schedule import CallOutput, Context

# ------------------------------------------------------------ hand-made logits

V, MASK, EOS, P = 8, 7, 6, 4
WORD, UNSURE, NL = 1, 2, 3


def unsure_lines_table(G: int, B: int, eos_at: int | None = None, unsure=None):
    """[G, V] logits for every call: each block of B positions is a line ending in a
    delimiter at offset 3 of the block (NL), with position 1 of the block unsure (UNSURE
    at probability ~0.28, below every threshold; or the positions `unsure` instead) and
    every other position a confident WORD (~0.998); an end-of-text at eos_at, if given."""
    j = np.arange(G)
    logits = np.full((G, V), 0.0, np.float32)
    logits[:, MASK] = -1e9
    logits[:, WORD] = 8.0
    logits[j % B == 3, WORD], logits[j % B == 3, NL] = 0.0, 8.0
    low = j % B == 1 if unsure is None else np.isin(j, unsure)
    logits[low, [WORD]], logits[low, [NL]] = 0.0, 0.0
    logits[low, UNSURE] = 1.0 - 0.001 * j[low]  # the earlier, the more confident
    if eos_at is not None:
        logits[eos_at, [WORD, NL, UNSURE, EOS]] = 0.0, 0.0, 0.0, 12.0
    return logits


def drive(schedule: AsyncLaneSchedule, table, calls=None):
    """Runs the schedule by hand (batch 1, no logit shift), every call answered from
    `table` whatever it queries.

    `calls`, when given, is a list that gets one (full forward, LaneState before the
    call, generated tokens before the call) triple per iteration.

    Returns:
      (generated tokens [G], commit step [G] (the iteration that committed each
      position), iterations, final LaneState).
    """
    G = schedule.gen_length
    T = P + G
    ctx = Context(batch=1, prompt_len=P, gen_length=G, shift=0, mask_id=MASK, eos_id=EOS,
                  stop_ids=(EOS,), pad_len=jnp.zeros((1,), jnp.int32))
    by_column = jnp.asarray(np.concatenate([np.zeros((P, V), np.float32), table]))
    canvas = jnp.concatenate([jnp.zeros((1, P), jnp.int32),
                              jnp.full((1, G), MASK, jnp.int32)], axis=1)
    state, live = schedule.init(ctx), jnp.ones((1,), bool)
    step = np.full(G, -1)
    plan = jax.jit(lambda c, s: schedule.plan(ctx, c, s, live))
    update = jax.jit(lambda c, s, o: schedule.update(ctx, c, s, o, jax.random.PRNGKey(0)))
    it = 0
    while not bool(schedule.done(ctx, canvas, state)[0]):
        assert it < schedule.max_iterations()
        p = plan(canvas, state)
        out = CallOutput(logits=by_column[jnp.minimum(p.positions, T - 1)],
                         targets=p.positions, serve=p.serve & live, full=p.full)
        before = np.asarray(canvas[0, P:])
        if calls is not None:
            calls.append((bool(p.full), state, before))
        canvas, state = update(canvas, state, out)
        now = np.asarray(canvas[0, P:])
        step[(before == MASK) & (now != MASK)] = it
        it += 1
    return np.asarray(canvas[0, P:]), step, it, state


def test_the_default_lane_slots_fork_at_every_line_of_a_long_answer():
    # 32 lines of 8 positions (gen_length 256): the default gives 256 / 8 = 32 slots, so
    # the row forks at each of its 31 delimiters before the tail; 16 slots fork 15 times
    # and leave the later lines to one lane, in more iterations, with the same text.
    table = unsure_lines_table(256, 8)
    case = {**CASE, "gen_length": 256}
    default = AsyncLaneSchedule(**case)
    assert default.lane_slots == 32
    assert AsyncLaneSchedule(**{**case, "gen_length": 64}).lane_slots == 16  # the floor
    assert AsyncLaneSchedule(**{**case, "delimiters": "none"}).lane_slots == 1
    tokens, _, iters, state = drive(default, table)
    few_tokens, _, few_iters, few_state = drive(AsyncLaneSchedule(max_lanes=16, **case), table)
    np.testing.assert_array_equal(tokens, few_tokens)
    assert int(state.forks[0]) == 31 and int(few_state.forks[0]) == 15
    assert iters < few_iters


def lanes_of(state):
    """The used lane slots of row 0: (kind, start, end, split, death) tuples."""
    k, s, e, sp, d = (np.asarray(x[0]) for x in (state.kind, state.start, state.end,
                                                    state.split, state.death))
    return [(int(k[m]), int(s[m]), int(e[m]), int(sp[m]), int(d[m]))
            for m in range(k.size) if state.birth[0, m] >= 0 or m == 0]


def overlap_steps(step, lanes) -> set[int]:
    """Iterations t in which a refine lane still held a mask (forked at s < t, its last
    mask committed at t or later) and a position outside it committed."""
    out = set()
    for _, a, b, s, d in lanes:
        if s < 0 or d <= s:
            continue  # never a refine lane, or done at once
        for t in range(s + 1, d + 1):
            if np.any((step == t) & ((np.arange(step.size) < a) | (np.arange(step.size) >= b))):
                # the lane was alive at t: one of its masks is committed at t or later
                if np.any(step[a:b] >= t):
                    out.add(t)
    return out


# Lines of 8 positions, a refresh once the window has travelled a line; a line's prefix
# (committed in one call) fits the 8 extra query slots, so it forks at once.
CASE = dict(gen_length=64, block_length=8, cascade=True, delimiters=str(NL),
            extra_queries=8, refresh_travel=8)


def test_forking_overlaps_refinement_with_advancement_and_takes_fewer_iterations():
    table = unsure_lines_table(64, 8)
    off_tokens, off_step, off_iters, off_state = drive(
        AsyncLaneSchedule(max_lanes=1, **CASE), table)
    tokens, step, iters, state = drive(AsyncLaneSchedule(max_lanes=16, **CASE), table)
    # The same text: the model's prediction at every position.
    want = np.argmax(table, axis=-1)
    np.testing.assert_array_equal(off_tokens, want)
    np.testing.assert_array_equal(tokens, want)
    # Forking off: a block takes two iterations (the sure positions, then the unsure
    # one forced); nothing is ever forked.
    assert off_iters == 16 and int(off_state.forks[0]) == 0
    lanes = lanes_of(state)
    refine = [ln for ln in lanes if ln[3] >= 0 and ln[4] > ln[3]]
    assert len(refine) >= 6, lanes  # a refine lane per line, each holding its unsure mask
    # Overlap: in some iteration a refine lane was alive and the continuation committed.
    both = overlap_steps(step, lanes)
    assert len(both) >= 5, (both, lanes)
    # Fewer iterations than block by block, and none committing nothing.
    assert iters < off_iters, (iters, off_iters)
    assert int(state.idle[0]) == 0
    assert len(set(step.tolist())) == iters  # every iteration committed something
    # The lanes end finished, their spans tiling the canvas in slot order.
    spans = [(a, b) for k, a, b, _, _ in lanes if k != TERMINATED]
    assert all(k == DONE for k, *_ in lanes)
    assert spans[0][0] == 0 and spans[-1][1] == 64
    assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def test_a_fork_waits_until_the_next_call_can_re_encode_its_prefix():
    # One extra query slot and no refresh by travel: a prefix forks only once its
    # masks and its committed positions with stale K/V fit that one slot, so no refine
    # lane reads a committed position of its line through K/V computed from the mask,
    # and no full forward is spent at a fork.
    table = unsure_lines_table(64, 8)
    case = {**CASE, "extra_queries": 1, "refresh_travel": 0}
    j = np.arange(64)
    calls = []
    tokens, _, _, state = drive(AsyncLaneSchedule(max_lanes=16, **case), table, calls)
    stale, after_fork = 0, []
    for t, (full, lanes, gen) in enumerate(calls):
        if t and int(lanes.forks[0]) > int(calls[t - 1][1].forks[0]):
            after_fork.append(full)  # the call right after a fork
        refine = np.zeros(64, bool)
        for k, lo, hi in zip(*(np.asarray(x[0]) for x in (lanes.kind, lanes.start, lanes.end))):
            refine |= (k == REFINE) & (j >= lo) & (j < hi)
        # Committed positions of a refine lane whose K/V came from the mask and that the
        # call did not re-encode (still not fresh after it; a committed token never
        # changes, and a full forward re-encodes everything).
        after = (calls[t + 1][1] if t + 1 < len(calls) else state).fresh[0]
        stale += int(np.sum(refine & (gen != MASK) & ~np.asarray(lanes.fresh[0])
                            & ~np.asarray(after)))
    np.testing.assert_array_equal(tokens, np.argmax(table, axis=-1))
    assert int(state.forks[0]) >= 6 and len(after_fork) >= 6
    assert not any(after_fork)  # the call after a fork is a cached call
    assert stale == 0, stale


def test_the_refine_lane_goes_first_and_no_iteration_commits_nothing():
    # The first line's position 1 is unsure, and so is the whole next line, which (as
    # in a chain of computations) cannot be sure before the first is finished. While
    # the refine lane holds its mask, its best is forced before the window's.
    table = unsure_lines_table(64, 8, unsure=[1, *range(4, 12)])
    _, step, iters, state = drive(AsyncLaneSchedule(max_lanes=16, **CASE), table)
    assert int(state.forks[0]) >= 1
    assert int(state.idle[0]) == 0
    assert len(set(step.tolist())) == iters  # every iteration committed something
    assert step[1] == 1  # the refine lane goes first


def test_an_end_of_text_cuts_the_lanes_while_forking():
    # The end-of-text sits inside the fourth line: the lanes after it are never made,
    # the one straddling it is cut, and no position is left masked.
    table = unsure_lines_table(64, 8, eos_at=29)
    tokens, _, _, state = drive(AsyncLaneSchedule(max_lanes=16, **CASE), table)
    assert tokens[29] == EOS and np.all(tokens[30:] == EOS)
    assert not np.any(tokens == MASK)
    spans = [(a, b) for k, a, b, _, _ in lanes_of(state) if k != TERMINATED]
    assert spans[0][0] == 0 and spans[-1][1] == 30, spans
    assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert int(state.forks[0]) >= 3


# ------------------------------------------------------------ random models, forking on

# One setting per family, forking on with a small lane budget; the delimiters are a
# fixed third of the vocabulary, so forks are frequent. Examples vary the weights (seed,
# sharpness), the prompts and the cascade only through arrays: one program per
# (family, batch shape).
FORK_SETTINGS = dict(gen_length=24, block_length=8, max_lanes=5, extra_queries=4,
                     refine_window=4, refine_budget=2)
PROGRAMS_SEEN: set = set()


def delimiters_for(cfg) -> str:
    vocab = np.arange(cfg.vocab_size)
    vocab = vocab[(vocab != cfg.mask_token_id) & ~np.isin(vocab, cfg.stop_token_ids)]
    return ",".join(map(str, vocab[::3]))


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       lm_scale=st.sampled_from([10.0, 30.0]), prompt_seed=st.integers(0, 50))
def test_invariants_with_forking_on_for_random_models(family, seed, lm_scale, prompt_seed):
    model = make_model(family, lm_scale=lm_scale, seed=seed)
    cfg = model.cfg
    opts = dict(sampler="asynclane", delimiters=delimiters_for(cfg), bucket=16,
                **FORK_SETTINGS)
    prompts = make_prompts(cfg.vocab_size, lengths=(4, 7, 11), seed=prompt_seed)
    before = driver.TRACE_COUNT["decode"]
    batch = generate(model, prompts, **opts)
    singles = [generate(model, [p], **opts) for p in prompts]
    traced = driver.TRACE_COUNT["decode"] - before
    # A new program only for a (family, batch shape) not seen before.
    new = {(family, 3), (family, 1)} - PROGRAMS_SEEN
    assert traced <= len(new), (traced, new)
    PROGRAMS_SEEN.update(new)
    check_invariants(batch, cfg, cascade=True)
    # The forced commit while refining: no iteration commits nothing.
    assert np.all(batch.stats.idle_steps == 0), batch.stats.idle_steps
    for i, s in enumerate(singles):
        check_invariants(s, cfg, cascade=True)
        np.testing.assert_array_equal(batch.tokens[i], s.tokens[0])
        for f in ("lane_kind", "lane_start", "lane_end", "lane_parent", "lane_birth",
                  "lane_death", "lane_split", "row_nfe_full", "row_nfe_partial",
                  "idle_steps", "row_steps"):
            np.testing.assert_array_equal(getattr(batch.stats, f)[i],
                                          getattr(s.stats, f)[0], err_msg=f)


def test_the_random_models_do_fork():
    # The property above is about forking: on these settings the lanes fork, and a refine
    # lane lives on after its fork.
    model = make_model("llada", lm_scale=30.0, seed=1)
    cfg = model.cfg
    res = generate(model, make_prompts(cfg.vocab_size, lengths=(4, 7, 11), seed=2),
                   sampler="asynclane", delimiters=delimiters_for(cfg), bucket=16,
                   **FORK_SETTINGS)
    st_ = res.stats
    assert st_.forks.sum() >= 2, st_.forks
    split, death = st_.lane_split, st_.lane_death
    assert np.any((split >= 0) & (death > split)), (split, death)
    assert np.all(st_.idle_steps == 0)
