"""AsyncLane's update, phase by phase (asynclane.py): each pure phase function on small
hand-made arrays, against outputs derived by hand from its rule. No model, no compile
of the decode loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from asynclane_jax.decoding.asynclane import (
    LaneState,
    advance_phase,
    at_owner,
    cascade_phase,
    commit_phase,
    fork_phase,
    lane_owner,
    per_lane,
    refresh_phase,
    retire_phase,
    scatter_predictions,
    text_frontier,
)
from asynclane_jax.decoding.lanes import DONE, FREE, GENERATE, REFINE, TERMINATED
from asynclane_jax.decoding.schedule import CallOutput, Context

V = 12  # vocabulary
X = 11  # the mask token
EOS, EOT = 9, 10  # end-of-text tokens (eos_id, end-of-turn)
NL = 5  # the delimiter
F, T = False, True


def context(G: int, *, b: int = 1, P: int = 2, shift: int = 0) -> Context:
    return Context(batch=b, prompt_len=P, gen_length=G, shift=shift, mask_id=X, eos_id=EOS,
                   stop_ids=(EOS, EOT), pad_len=jnp.zeros((b,), jnp.int32))


def make_lanes(kind, start, end, *, G: int, **fields) -> LaneState:
    """A LaneState from [b, M] kind/start/end lists; other fields default to a fresh
    decode (no fork, nothing cached, no end-of-text) and may be given ([b] fields as
    scalars)."""
    kind = jnp.asarray(kind, jnp.int32)
    b, M = kind.shape
    row = jnp.zeros((b,), jnp.int32)
    slot = jnp.full((b, M), -1, jnp.int32)
    base = dict(win=row, gen_slot=row, kind=kind, start=jnp.asarray(start, jnp.int32),
                end=jnp.asarray(end, jnp.int32), parent=slot, birth=slot, death=slot,
                split=slot, fresh=jnp.zeros((b, G), bool), eos=row + G,
                need_full=jnp.zeros((b,), bool), full_win=row, steps=row, forks=row,
                peak=row + 1, refreshes=row, cuts=row, idle=row)
    for k, v in fields.items():
        base[k] = jnp.broadcast_to(jnp.asarray(v, base[k].dtype), base[k].shape)
    return LaneState(**base)


def eq(got, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def arr(x, dtype=jnp.int32):
    return jnp.asarray(x, dtype)


# -- helpers -------------------------------------------------------------------------------
def lane_members(lanes: LaneState, G: int, kinds):
    """[b, G, M] whether generated position j lies in slot m's span [start, end) and m's
    kind is one of `kinds`: the plain membership masks that `lane_owner` is checked
    against."""
    j = jnp.arange(G)[None, :, None]
    live = jnp.isin(lanes.kind, jnp.asarray(kinds))[:, None, :]
    return live & (j >= lanes.start[:, None, :]) & (j < lanes.end[:, None, :])


def test_text_frontier_and_lane_members():
    eq(text_frontier(arr([2, 7, 8]), 8, True), [3, 8, 8])  # the tail starts after the EOS
    eq(text_frontier(arr([2, 7, 8]), 8, False), [8, 8, 8])  # no cascade: no tail
    st = make_lanes([[REFINE, GENERATE, FREE]], [[0, 2, 0]], [[2, 4, 0]], G=5)
    eq(lane_members(st, 5, (REFINE,))[0], [[T, F, F], [T, F, F], [F, F, F], [F, F, F],
                                            [F, F, F]])
    eq(lane_members(st, 5, (REFINE, GENERATE))[0, :, 1], [F, F, T, T, F])


def test_lane_owner_and_the_reductions_over_it():
    # Two rows of a tiled region (G = 7): row 0 refine [0, 2), done [2, 3), refine
    # [3, 5), generate [5, 7); row 1 a lone generate lane and free slots.
    st = make_lanes([[REFINE, DONE, REFINE, GENERATE], [GENERATE, FREE, FREE, FREE]],
                    [[0, 2, 3, 5], [0, 0, 0, 0]], [[2, 3, 5, 7], [7, 0, 0, 0]], G=7)
    owner = lane_owner(st, 7, (REFINE,))
    eq(owner, [[0, 0, 4, 2, 2, 4, 4], [4] * 7])  # M = 4: no refine lane holds it
    eq(lane_owner(st, 7, (REFINE, DONE, GENERATE))[0], [0, 0, 1, 2, 2, 3, 3])
    members = lane_members(st, 7, (REFINE,))  # the [b, G, M] masks it replaces
    eq(owner < 4, jnp.any(members, axis=-1))
    eq(jnp.where(owner < 4, owner, -1), jnp.where(jnp.any(members, axis=-1),
                                                   jnp.argmax(members, axis=-1), -1))
    values = arr([[0.1, 0.7, 0.9, 0.2, 0.5, 0.8, 0.3], [0.4] * 7], jnp.float32)
    best = per_lane(owner, values, 4, -1.0)
    np.testing.assert_allclose(best, [[0.7, -1.0, 0.5, -1.0], [-1.0] * 4])
    eq(at_owner(owner, arr([[10, 11, 12, 13], [20, 21, 22, 23]]), -1),
       [[10, 10, -1, 12, 12, -1, -1], [-1] * 7])


def test_lane_owner_matches_the_member_masks_on_random_tilings():
    # lane_owner finds owners in O(G + M) (a running maximum of span starts); on
    # disjoint spans it names the slot the [b, G, M] member masks name. Random tilings
    # of G = 40 in up to 12 slots, with free and empty slots and every kind.
    rng = np.random.default_rng(0)
    G, M = 40, 12
    for _ in range(25):
        kinds, starts, ends = [], [], []
        for _row in range(3):
            cuts = np.sort(rng.choice(np.arange(1, G), size=rng.integers(0, M - 2),
                                      replace=False))
            bounds = np.concatenate([[0], cuts, [G]])
            n = len(bounds) - 1
            order = rng.permutation(M)[:n]  # slots in any order
            kind = np.full(M, FREE)
            start = np.zeros(M, int)
            end = np.zeros(M, int)
            kind[order] = rng.choice([GENERATE, REFINE, DONE, TERMINATED], size=n)
            start[order], end[order] = bounds[:-1], bounds[1:]
            empty = rng.integers(0, M)  # an empty span of a live kind owns nothing
            if kind[empty] == FREE:
                kind[empty], start[empty], end[empty] = REFINE, 7, 7
            kinds.append(kind), starts.append(start), ends.append(end)
        st = make_lanes(kinds, starts, ends, G=G)
        for ks in ((REFINE,), (REFINE, DONE), (GENERATE, REFINE, DONE, TERMINATED)):
            members = lane_members(st, G, ks)
            want = jnp.where(jnp.any(members, axis=-1), jnp.argmax(members, axis=-1), M)
            eq(lane_owner(st, G, ks), want)


def test_scatter_predictions():
    # P = 2, G = 4 (T = 6). Row 0 queries predict columns 1 (prompt), 2, 4 and 6 (none).
    ctx = context(4, b=2)
    logits = np.zeros((2, 4, V), np.float32)
    logits[0, 0, 1] = 5.0  # a prompt column: dropped
    logits[0, 1, 3] = 2.0  # column 2 = generated 0: token 3
    logits[0, 2, X] = 3.0  # column 4 = generated 2: the mask wins, its runner-up is 6
    logits[0, 2, 6] = 1.0
    logits[1, 1, 4] = 2.0
    out = CallOutput(logits=jnp.asarray(logits), targets=arr([[1, 2, 4, 6], [1, 2, 4, 6]]),
                     serve=jnp.asarray([True, False]), full=jnp.asarray(False))
    pred, pconf, has = scatter_predictions(ctx, out)
    eq(pred[0], [3, 0, 6, 0])
    eq(has, [[T, F, T, F], [F, F, F, F]])  # row 1 is not served: nothing is usable
    p3 = np.exp(2.0) / (np.exp(2.0) + V - 1)
    # The mask token is never committed, but the confidence stays the mask's own.
    pm = np.exp(3.0) / (np.exp(3.0) + np.exp(1.0) + V - 2)
    np.testing.assert_allclose(np.asarray(pconf[0]), [p3, 0.0, pm, 0.0], rtol=1e-6)


# -- commit --------------------------------------------------------------------------------
COMMIT = dict(block_length=4, threshold=0.9, refine_budget=4)
PRED = arr(np.arange(8) + 20)  # position j predicts token 20 + j (tokens are opaque here)
ALL = jnp.ones((1, 8), bool)


def test_commit_window_threshold():
    ctx = context(8)
    gen = arr([[X] * 8])
    st = make_lanes([[GENERATE, FREE]], [[0, 0]], [[4, 0]], G=8)
    pconf = arr([[0.95, 0.5, 0.89, 0.3, 0.99, 0.99, 0.99, 0.99]], jnp.float32)
    front = arr([8])
    # 0 is sure; 2 is just under the threshold; 4..7 are sure but outside the window
    # [0, 4).
    new = commit_phase(ctx, gen, PRED, pconf, ALL, st, front, **COMMIT)
    eq(new, [[20, X, X, X, X, X, X, X]])
    new = commit_phase(ctx, gen, PRED, pconf.at[0, 2].set(0.92), ALL, st, front, **COMMIT)
    eq(new, [[20, X, 22, X, X, X, X, X]])  # over the threshold: committed
    # The tail (frontier 1) is never a candidate, however sure the prediction.
    new = commit_phase(ctx, gen, PRED, arr([[0.5, 0.99] + [0.99] * 6], jnp.float32), ALL,
                          st, arr([1]), **COMMIT)
    eq(new, [[20, X, X, X, X, X, X, X]])  # only position 0, forced as the best


def test_commit_forces_the_window_best_unless_a_refine_lane_is_open():
    ctx = context(8)
    pconf = arr([[0.5, 0.5, 0.5, 0.6, 0.4, 0.5, 0.99, 0.5]], jnp.float32)
    # One generate lane, nothing sure: the most confident window position (3) commits.
    st = make_lanes([[GENERATE, FREE]], [[0, 0]], [[4, 0]], G=8)
    new = commit_phase(ctx, arr([[X] * 8]), PRED, pconf, ALL, st, arr([8]), **COMMIT)
    eq(new, [[X, X, X, 23, X, X, X, X]])
    # A position the call did not predict is not a candidate: the best is then 0/1/2.
    has = ALL.at[0, 3].set(False)
    new = commit_phase(ctx, arr([[X] * 8]), PRED, pconf, has, st, arr([8]), **COMMIT)
    eq(new, [[20, X, X, X, X, X, X, X]])  # ties go to the first
    # A refine lane [0, 2) holding a mask at 1 (pconf 0.5), forked at step 0, within its
    # budget; the window [2, 6) has nothing sure, its best is 3 (0.6). The refine lane
    # goes first: its best (1), not the window's more confident 3.
    gen = arr([[30, X, X, X, X, X, X, X]])
    st = make_lanes([[REFINE, GENERATE]], [[0, 2]], [[2, 6]], G=8, win=2, gen_slot=1,
                    split=[[0, -1]], steps=3)

    def run(pc=pconf, has=ALL, g=gen):
        return commit_phase(ctx, g, PRED, pc, has, st, arr([8]), **COMMIT)

    eq(run(), [[30, 21, X, X, X, X, X, X]])
    # A refine mask the call did not predict: the window's best is forced instead.
    eq(run(has=ALL.at[0, 1].set(False)), [[30, X, X, 23, X, X, X, X]])
    # A sure window position commits; the refine lane's best is still forced.
    eq(run(pconf.at[0, 4].set(0.95)), [[30, 21, X, X, 24, X, X, X]])
    # No refine lane holding a mask: block decoding (the window's best).
    eq(run(g=gen.at[0, 1].set(31)), [[30, 31, X, 23, X, X, X, X]])


def test_commit_refine_budget_forces_each_overdue_lane():
    ctx = context(8)
    # Two refine lanes, [0, 2) with a mask at 1 (0.5) forked at step 0 and [2, 4) with a
    # mask at 3 (0.6) forked at step 1; the window [4, 8) has nothing sure.
    gen = arr([[30, X, 32, X, X, X, X, X]])
    st = make_lanes([[REFINE, REFINE, GENERATE]], [[0, 2, 4]], [[2, 4, 8]], G=8, win=4,
                    gen_slot=2, split=[[0, 1, -1]], steps=3)
    pconf = arr([[0.5, 0.5, 0.5, 0.6, 0.4, 0.45, 0.3, 0.2]], jnp.float32)
    # Within both budgets only the one forced commit: the refine lanes' best (3).
    new = commit_phase(ctx, gen, PRED, pconf, ALL, st, arr([8]), **COMMIT)
    eq(new, [[30, X, 32, 23, X, X, X, X]])
    # At step 4 the first lane is 4 iterations old: it also commits its own best (1).
    new = commit_phase(ctx, gen, PRED, pconf, ALL, st.replace(steps=arr([4])), arr([8]),
                          **COMMIT)
    eq(new, [[30, 21, 32, 23, X, X, X, X]])
    # A sure refine position commits by the threshold, within the budget too; it is
    # then the refine lanes' best, so nothing else is forced.
    new = commit_phase(ctx, gen, PRED, pconf.at[0, 1].set(0.95), ALL, st, arr([8]),
                          **COMMIT)
    eq(new, [[30, 21, 32, X, X, X, X, X]])


# -- cascade -------------------------------------------------------------------------------
def test_cascade_ends_the_row_at_the_first_end_of_text():
    ctx = context(8)
    # An end-of-turn committed at 2 (and an end-of-text at 4); the tail starts at 3 and
    # is filled with eos_id; the end-of-turn itself stays.
    new = arr([[1, 2, EOT, X, EOS, X, 3, X]])
    st = make_lanes([[DONE, REFINE, DONE, GENERATE, FREE]],
                    [[0, 2, 5, 6, 0]], [[2, 5, 6, 8, 0]], G=8,
                    death=[[3, -1, 4, -1, -1]], steps=7, cuts=1)
    out_new, out = cascade_phase(ctx, new, st, cascade=True)
    eq(out_new, [[1, 2, EOT, EOS, EOS, EOS, EOS, EOS]])
    eq(out.eos, [2])
    # The lane straddling 3 is cut there; those starting at or after 3 are terminated
    # (the one that had finished keeps its death step); lanes before it are untouched.
    eq(out.kind, [[DONE, REFINE, TERMINATED, TERMINATED, FREE]])
    eq(out.end, [[2, 3, 6, 8, 0]])
    eq(out.death, [[3, -1, 4, 7, -1]])
    eq(out.cuts, [1 + 3])
    eq(out.start, st.start)


def test_cascade_an_earlier_end_of_text_wins_and_the_cascade_can_be_off():
    ctx = context(8)
    # An end-of-turn at 5 committed before (the lane was cut to 6 then); now an
    # end-of-text commits at 1: the row ends there.
    new = arr([[4, EOS, X, X, X, EOT, EOS, EOS]])
    st = make_lanes([[GENERATE]], [[0]], [[6]], G=8, eos=5, steps=2)
    out_new, out = cascade_phase(ctx, new, st, cascade=True)
    eq(out.eos, [1])
    eq(out_new, [[4, EOS] + [EOS] * 6])
    eq(out.end, [[2]])
    eq(out.cuts, [1])
    eq(out.kind, [[GENERATE]])  # cut, not terminated: it starts before the tail
    # An end-of-text recorded earlier is kept when this iteration's is later.
    _, out = cascade_phase(ctx, arr([[4, 6, X, X, X, EOT, X, X]]), st.replace(eos=arr([3])),
                           cascade=True)
    eq(out.eos, [3])
    # Without the cascade the first end-of-text is still recorded, nothing else moves.
    out_new, out = cascade_phase(ctx, new, st.replace(eos=arr([8])), cascade=False)
    eq(out_new, new)
    eq(out.eos, [1])
    eq(out.kind, st.kind)
    eq(out.end, st.end)
    eq(out.cuts, [0])
    # No end-of-text (a mask is never one): nothing changes.
    out_new, out = cascade_phase(ctx, arr([[X] * 8]), st.replace(eos=arr([8])), cascade=True)
    eq(out_new, [[X] * 8])
    eq(out.eos, [8])
    eq(out.end, [[6]])
    eq(out.cuts, [0])


# -- retire --------------------------------------------------------------------------------
def test_retire_finishes_refine_lanes_without_masks():
    ctx = context(8)
    new = arr([[1, 2, 3, 4, X, 6, 7, 8]])
    st = make_lanes([[REFINE, REFINE, GENERATE, DONE]], [[0, 3, 5, 0]], [[3, 5, 8, 0]], G=8,
                    death=[[-1, -1, -1, 2]], steps=6)
    out = retire_phase(ctx, new, st)
    # [0, 3) has no mask left: done now; [3, 5) still holds 4; a generate lane or a done
    # lane is not retired here.
    eq(out.kind, [[DONE, REFINE, GENERATE, DONE]])
    eq(out.death, [[6, -1, -1, 2]])


# -- fork ----------------------------------------------------------------------------------
# Every column fresh and slots to spare: the rule on stale positions does not bind (it
# is tested in test_fork_rule_boundaries_are_inclusive).
FORK = dict(block_length=8, refine_window=2, stable_fraction=0.5, delimiter_ids=(NL,),
            fresh=jnp.ones((1, 12), bool), query_slots=12)


def fork_lanes(M=3, **fields):
    kind = [[GENERATE] + [FREE] * (M - 1)]
    return make_lanes(kind, [[0] * M], [[8] + [0] * (M - 1)], G=12, steps=5, **fields)


def test_fork_at_the_last_stable_delimiter():
    ctx = context(12)
    # Window [0, 8): delimiters at 2 and 4; masks at 1 and 5 (and 8.. outside it).
    new = arr([[1, X, NL, 3, NL, X, 6, 7, X, X, X, X]])
    serve = jnp.asarray([True])
    st, fork = fork_phase(ctx, new, fork_lanes(), arr([12]), serve, **FORK)
    # d = 4: [0, 4] holds 1 mask (<= 2) and is 4/5 committed (>= 0.5). The generate lane
    # becomes a refine lane [0, 5) split at step 5; slot 1 is the new generate lane.
    eq(fork, [True])
    eq(st.kind, [[REFINE, GENERATE, FREE]])
    eq(st.start, [[0, 5, 0]])
    eq(st.end, [[5, 0, 0]])  # the new lane's end is set by the advance phase
    eq(st.parent, [[-1, 0, -1]])
    eq(st.birth, [[-1, 5, -1]])
    eq(st.split, [[5, -1, -1]])
    eq(st.death, [[-1, -1, -1]])
    eq(st.win, [5])
    eq(st.gen_slot, [1])
    eq(st.forks, [1])
    # stable_fraction 0.85: neither prefix (2/3, 4/5 committed) is stable enough.
    st, fork = fork_phase(ctx, new, fork_lanes(), arr([12]), serve,
                          **{**FORK, "stable_fraction": 0.85})
    eq(fork, [False])
    eq(st.kind, [[GENERATE, FREE, FREE]])
    eq(st.win, [0])
    # refine_window 0: every prefix holds a mask.
    _, fork = fork_phase(ctx, new, fork_lanes(), arr([12]), serve,
                         **{**FORK, "refine_window": 0})
    eq(fork, [False])


def test_fork_of_a_finished_prefix_and_an_earlier_stable_delimiter():
    ctx = context(12)
    # Delimiters at 1 and 4; [0, 4] holds 2 masks (> refine_window 1), [0, 1] none:
    # d = 1, and the prefix needs no refining: it is done at once.
    new = arr([[1, NL, X, X, NL, 4, 6, 7, X, X, X, X]])
    st, fork = fork_phase(ctx, new, fork_lanes(), arr([12]), jnp.asarray([True]),
                          **{**FORK, "refine_window": 1})
    eq(fork, [True])
    eq(st.kind, [[DONE, GENERATE, FREE]])
    eq(st.end, [[2, 0, 0]])
    eq(st.death, [[5, -1, -1]])
    eq(st.start, [[0, 2, 0]])
    eq(st.win, [2])


def test_fork_rule_boundaries_are_inclusive():
    """Each limit of the fork rule admits a prefix that meets it exactly: at most
    refine_window masks, at least stable_fraction committed, masks plus stale positions
    at most query_slots, and a delimiter at the window's first position. One past each
    limit, the same prefix does not fork."""
    ctx = context(12)
    serve = jnp.asarray([True])
    # One delimiter, at 3: the prefix [0, 3] holds 2 masks and is 2/4 = 0.5 committed.
    new = arr([[1, X, X, NL, 4, 6, 7, 8, X, X, X, X]])

    def forks(**over):
        st, fork = fork_phase(ctx, new, fork_lanes(), arr([12]), serve, **{**FORK, **over})
        return bool(fork[0]), st

    # refine_window: exactly 2 masks fork at refine_window 2, not at 1.
    ok, st = forks(refine_window=2, stable_fraction=0.25)
    assert ok
    eq(st.kind, [[REFINE, GENERATE, FREE]])
    eq(st.end, [[4, 0, 0]])
    eq(st.start, [[0, 4, 0]])
    eq(st.win, [4])
    assert not forks(refine_window=1, stable_fraction=0.25)[0]
    # stable_fraction: exactly half committed forks at 0.5, not at 0.51.
    assert forks(refine_window=4, stable_fraction=0.5)[0]
    assert not forks(refine_window=4, stable_fraction=0.51)[0]
    # Both limits met exactly at once.
    assert forks(refine_window=2, stable_fraction=0.5)[0]
    # query_slots: nothing in the window is fresh, so the prefix's 2 committed positions
    # (0 and the delimiter) are stale: 2 masks + 2 stale = 4 fit 4 slots, not 3.
    stale = jnp.zeros((1, 12), bool)
    assert forks(refine_window=4, stable_fraction=0.5, fresh=stale, query_slots=4)[0]
    assert not forks(refine_window=4, stable_fraction=0.5, fresh=stale, query_slots=3)[0]
    fresh0 = stale.at[0, 0].set(True)  # position 0 fresh: 2 + 1 = 3 fit 3
    assert forks(refine_window=4, stable_fraction=0.5, fresh=fresh0, query_slots=3)[0]
    # A delimiter at the window's first position forks: d = 0, a finished prefix [0, 1).
    first = arr([[NL, X, X, 3, 4, 6, 7, 8, X, X, X, X]])
    st, fork = fork_phase(ctx, first, fork_lanes(), arr([12]), serve, **FORK)
    eq(fork, [True])
    eq(st.kind, [[DONE, GENERATE, FREE]])
    eq(st.end, [[1, 0, 0]])
    eq(st.start, [[0, 1, 0]])
    eq(st.death, [[5, -1, -1]])


def test_no_fork_without_a_slot_a_position_after_it_or_service():
    ctx = context(12)
    new = arr([[1, 2, NL, 3, 4, 8, 6, 7, X, X, X, X]])
    base = fork_lanes(M=2)
    _, fork = fork_phase(ctx, new, base, arr([12]), jnp.asarray([True]), **FORK)
    eq(fork, [True])  # the case itself forks ...
    full = base.replace(kind=arr([[DONE, GENERATE]]), gen_slot=arr([1]))
    st, fork = fork_phase(ctx, new, full, arr([12]), jnp.asarray([True]), **FORK)
    eq(fork, [False])  # ... but not without a free slot
    eq(st.kind, full.kind)
    _, fork = fork_phase(ctx, new, base, arr([3]), jnp.asarray([True]), **FORK)
    eq(fork, [False])  # ... nor when the delimiter is the last position before the tail
    _, fork = fork_phase(ctx, new, base, arr([12]), jnp.asarray([False]), **FORK)
    eq(fork, [False])  # ... nor in a row the call did not serve
    _, fork = fork_phase(ctx, new, base, arr([12]), jnp.asarray([True]),
                         **{**FORK, "delimiter_ids": ()})
    eq(fork, [False])  # ... nor without delimiters
    one = make_lanes([[GENERATE]], [[0]], [[8]], G=12)
    _, fork = fork_phase(ctx, new, one, arr([12]), jnp.asarray([True]), **FORK)
    eq(fork, [False])  # ... nor with a single slot
    # A delimiter outside the window [0, 8) does not fork.
    late = arr([[1, 2, 3, 4, 6, 7, 8, 1, NL, X, X, X]])
    _, fork = fork_phase(ctx, late, base, arr([12]), jnp.asarray([True]), **FORK)
    eq(fork, [False])


# -- advance -------------------------------------------------------------------------------
def adv_lanes(**fields):
    return make_lanes([[GENERATE, FREE]], [[0, 0]], [[4, 0]], G=12, steps=3, **fields)


def test_advance_moves_a_finished_window_on():
    ctx = context(12)
    yes, no = jnp.asarray([True]), jnp.asarray([False])
    new = arr([[1, 2, 3, 4, X, X, X, X, X, X, X, X]])
    st, advance, done = advance_phase(ctx, new, adv_lanes(), arr([12]), yes, no,
                                      block_length=4)
    eq(advance, [True])
    eq(done, [False])
    eq(st.win, [4])
    eq(st.end, [[8, 0]])  # the span follows the window
    eq(st.kind, [[GENERATE, FREE]])
    # A mask left in the window: it stays (and so does the span's end).
    held = new.at[0, 3].set(X)
    st, advance, _ = advance_phase(ctx, held, adv_lanes(), arr([12]), yes, no, block_length=4)
    eq(advance, [False])
    eq(st.win, [0])
    eq(st.end, [[4, 0]])
    # A row that forked, or was not served, does not advance.
    _, advance, _ = advance_phase(ctx, new, adv_lanes(), arr([12]), yes, yes, block_length=4)
    eq(advance, [False])
    _, advance, _ = advance_phase(ctx, new, adv_lanes(), arr([12]), no, no, block_length=4)
    eq(advance, [False])
    # The span's end never passes the tail: window [8, 12) with the tail at 10.
    st, _, done = advance_phase(ctx, new.at[0, 4:8].set(6), adv_lanes(win=4), arr([10]), no,
                                no, block_length=4)
    eq(done, [False])
    eq(st.end, [[8, 0]])
    st, _, _ = advance_phase(ctx, new.at[0, 4:8].set(6), adv_lanes(win=4), arr([10]), yes, no,
                             block_length=4)
    eq(st.win, [8])
    eq(st.end, [[10, 0]])


def test_the_generate_lane_is_done_at_the_tail():
    ctx = context(12)
    yes, no = jnp.asarray([True]), jnp.asarray([False])
    # End-of-text at 5 (tail from 6): the window [0, 4) and [4, 6) hold no mask.
    new = arr([[1, 2, 3, 4, 6, EOS] + [EOS] * 6])
    st, advance, done = advance_phase(ctx, new, adv_lanes(), arr([6]), yes, no,
                                      block_length=4)
    eq(advance, [True])
    eq(done, [True])
    eq(st.win, [4])
    eq(st.kind, [[DONE, FREE]])
    eq(st.death, [[3, -1]])
    eq(st.end, [[6, 0]])  # the lane ends at the tail
    # A masked position ahead keeps it going.
    st, _, done = advance_phase(ctx, new.at[0, 4].set(X), adv_lanes(), arr([6]), yes, no,
                                block_length=4)
    eq(done, [False])
    eq(st.kind, [[GENERATE, FREE]])
    eq(st.end, [[6, 0]])  # min(win + B, tail)


def test_advance_counts_the_peak_of_live_lanes():
    ctx = context(12)
    st = make_lanes([[REFINE, GENERATE, FREE]], [[0, 3, 0]], [[3, 7, 0]], G=12, win=3,
                    gen_slot=1, peak=1)
    new = arr([[1, X, 3, 4, X, X, X, X, X, X, X, X]])
    out, advance, _ = advance_phase(ctx, new, st, arr([12]), jnp.asarray([True]),
                                    jnp.asarray([False]), block_length=4)
    eq(advance, [False])
    eq(out.peak, [2])
    eq(out.end, [[3, 7, 0]])  # a refine lane's span is not the window's


# -- refresh -------------------------------------------------------------------------------
REFRESH = dict(refresh_travel=0)


def call(targets, *, full=False, serve=(True,)):
    b, n = np.shape(targets)
    return CallOutput(logits=jnp.zeros((b, n, V)), targets=arr(targets),
                      serve=jnp.asarray(serve), full=jnp.asarray(full))


def test_refresh_marks_encoded_columns_fresh_and_commits_dirty():
    ctx = context(6)  # P = 2, T = 8
    gen = arr([[X, X, X, 7, X, X]])
    new = arr([[4, X, X, 7, X, X]])  # 0 committed this iteration
    st = make_lanes([[GENERATE]], [[0]], [[4]], G=6, fresh=[[F, F, F, T, F, F]])
    no = jnp.asarray([False])
    # Columns 2 and 3 (generated 0, 1) were encoded; 8 is an unused slot.
    out = refresh_phase(ctx, gen, new, st, call([[2, 3, 8]]), no, no, **REFRESH)
    eq(out.fresh, [[F, T, F, T, F, F]])  # 0 changed: its K/V were computed from the mask
    # Dream's shift: a query at c encodes c, predicting c + 1.
    out = refresh_phase(context(6, shift=1), gen, new, st, call([[3, 4]]), no, no, **REFRESH)
    eq(out.fresh, [[F, T, F, T, F, F]])
    # A full forward encodes every column.
    out = refresh_phase(ctx, gen, new, st, call([[8]], full=True), no, no, **REFRESH)
    eq(out.fresh, [[F, T, T, T, T, T]])
    # A row the call did not serve encodes nothing.
    out = refresh_phase(ctx, gen, gen, st, call([[2, 3]], serve=(False,)), no, no, **REFRESH)
    eq(out.fresh, st.fresh)


def test_refresh_decides_the_next_full_forward():
    ctx = context(6)
    gen = arr([[X] * 6])
    yes, no = jnp.asarray([True]), jnp.asarray([False])
    st = make_lanes([[GENERATE]], [[0]], [[4]], G=6, refreshes=1)
    out = refresh_phase(ctx, gen, gen, st, call([[2]]), no, no, **REFRESH)
    eq(out.need_full, [False])
    eq(out.refreshes, [1])
    # A served full forward counts a refresh.
    out = refresh_phase(ctx, gen, gen, st, call([[2]], full=True), no, no, **REFRESH)
    eq(out.refreshes, [2])
    eq(out.need_full, [False])
    # A window that moved on to a new block, unless the lane ended there.
    eq(refresh_phase(ctx, gen, gen, st, call([[2]]), yes, no, **REFRESH).need_full, [True])
    eq(refresh_phase(ctx, gen, gen, st, call([[2]]), yes, yes, **REFRESH).need_full, [False])
    # A row the call did not serve keeps its flag and its count.
    unserved = call([[2]], serve=(False,))
    out = refresh_phase(ctx, gen, gen, st, unserved, yes, no, **REFRESH)
    eq(out.need_full, [False])
    eq(out.refreshes, [1])
    eq(refresh_phase(ctx, gen, gen, st.replace(need_full=yes), unserved, no, no,
                     **REFRESH).need_full, [True])
    # refresh_travel: the window moved (here by forks: no advance) that far since the
    # last full forward, whose window start full_win records.
    kw = {**REFRESH, "refresh_travel": 4}
    moved = st.replace(win=arr([5]), full_win=arr([1]))
    eq(refresh_phase(ctx, gen, gen, moved, call([[2]]), no, no, **kw).need_full, [True])
    eq(refresh_phase(ctx, gen, gen, moved.replace(full_win=arr([2])), call([[2]]), no, no,
                     **kw).need_full, [False])  # 3 positions only
    eq(refresh_phase(ctx, gen, gen, moved, call([[2]]), no, yes, **kw).need_full,
       [False])  # the generate lane is done: nothing left to renew the cache for
    eq(refresh_phase(ctx, gen, gen, moved, call([[2]]), no, no, **REFRESH).need_full, [False])
    out = refresh_phase(ctx, gen, gen, moved, call([[2]], full=True), no, no, **kw)
    eq(out.full_win, [5])  # a full forward renews it: no refresh due
    eq(out.need_full, [False])


