"""AsyncLane (arXiv 2606.08411): refinement decoupled from advancement, as lane slots.

A row decodes with a *generate lane*: a window of `block_length` positions that commits
by threshold, as Fast-dLLM's block does. When the window holds a committed delimiter
(by default any token containing a newline) whose prefix is nearly finished, the lane
forks: the prefix [window start, delimiter] becomes a *refine lane* that keeps
committing its few remaining masks, and a new generate lane starts right after the
delimiter, so the text keeps advancing while the prefix is polished. Every lane of a
row is served by the same model call.

Everything is a fixed-shape array in the driver's loop carry, and fork, terminate and
refresh are masked array updates; one program per (settings, shapes).

One iteration (per row):
  1. Query set (shared-prefix lane batching). One cached call queries, against the K/V
     of the whole canvas: the generate window (B) and `extra_queries` (E) positions
     picked by priority: first the refine lanes' masked positions, earliest first, then
     *dirty* positions (committed since their cached K/V was computed: re-encoding them
     is the compact cache refresh).
  2. Full refresh. A row's first call is a full forward over the canvas; so is its call
     after the window moves to a new block, as Fast-dLLM's dual cache does, and once the
     window has moved `refresh_travel` positions (32 by default) since the last one, by
     forks or advances. Its logits decode that step. Rows that need no refresh wait for
     one iteration while a full forward serves the rows that do (so each row decodes
     exactly as it would alone).
  3. Commit. Window: every masked position with confidence >= threshold, and the most
     confident position, unless a refine lane is open (then the continuation commits
     only what it is sure of). Refine lanes: the same threshold; a lane older than
     refine_budget iterations also commits its most confident position each iteration.
     While a refine lane is open, one commit is forced every iteration: the refine
     lanes' most confident position, else the window's, so forking never idles. On a
     block-causal model (LLaDA2) only the first of its blocks with masks commits
     (`Context.commit_gate`): it predicts a block from a finished prefix only.
  4. Cascading termination. An end-of-text committed at p makes every later position
     end-of-text; lanes starting after p are terminated, a lane straddling p is cut
     there, and no call is spent on the tail.
  5. Fork (above) or advance: a window with no masks left moves on by B positions. A
     prefix forks only when its masks and its committed positions with stale cached K/V
     fit in the next call's extra query slots, so that call re-encodes every stale one
     (no full forward at a fork). A refine lane with no masks left is done. A row is
     finished when no generated position is masked.

Defaults (why each, with the measurements: docs/asynclane.md, "The options and their
defaults"): forking at newlines (one lane slot per 8 generated positions, at least 16),
a full forward once the window has travelled a block (refresh_travel=32), a threshold of
0.95 (Fast-dLLM publishes 0.9; the higher one rights math answers at the same speed on
both v4 testbed models), 4 extra query slots and a refine budget of 4 iterations, 8 and 8
from gen_length 512 up (the wider call trades full forwards for cached calls, which pays
on the longer canvas only), and the cascade. max_lanes=1 turns the lanes off. Lookahead
draft reuse and renewal calls (a refresh as a wide cached call) were options and are
removed: docs/asynclane.md, "Removed options".

Dream's logit shift: every query for a column c is made at c - 1 (schedule.py), in full
and cached calls alike, so every column of the window gets a prediction in every call.

With Fast-dLLM's threshold (0.9, or any other both are given), one lane, the cascade
off and extra_queries=0, AsyncLane decodes exactly as Fast-dLLM's threshold sampler
with a dual cache on LLaDA models (tests/decoding/asynclane/test_asynclane.py checks it
token for token).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.lanes import DONE, FREE, GENERATE, REFINE, TERMINATED, LaneStats
from asynclane_jax.decoding.schedule import CallOutput, Context, Plan, SamplerError, Schedule

# Lane slots when max_lanes is not given and the delimiters are known: one per
# LANE_SPACING generated positions, at least DEFAULT_MAX_LANES. Slots are never reused,
# so a row forks at most M - 1 times; lines of about LANE_SPACING tokens or more then
# fork at every line (the testbed's long answers run to 34 lines in 377 tokens).
DEFAULT_MAX_LANES = 16
LANE_SPACING = 8
# Extra query slots when extra_queries is not given: EXTRA_QUERIES_LONG from gen_length
# LONG_CANVAS up, else EXTRA_QUERIES_SHORT (docs/asynclane.md, "The options and their
# defaults": the wider call pays at 512 and costs calls at 256).
EXTRA_QUERIES_SHORT, EXTRA_QUERIES_LONG, LONG_CANVAS = 4, 8, 512


@struct.dataclass
class LaneState:
    """AsyncLane's part of the loop carry ([b] and [b, M] lane slots, [b, G] columns)."""

    win: jax.Array  # [b] generate window start (generated index)
    gen_slot: jax.Array  # [b] slot of the generate lane
    kind: jax.Array  # [b, M] lane kind codes (lanes.LANE_KINDS)
    start: jax.Array  # [b, M] span start (generated index)
    end: jax.Array  # [b, M] span end, exclusive
    parent: jax.Array  # [b, M] slot forked from, -1 for the root
    birth: jax.Array  # [b, M] row iteration of creation, -1 unused
    death: jax.Array  # [b, M] row iteration of finish or termination, -1 alive
    split: jax.Array  # [b, M] row iteration at which the lane forked (became refine), -1
    fresh: jax.Array  # [b, G] bool: the cached K/V of the column was computed from its token
    eos: jax.Array  # [b] first committed end-of-text (generated index), G if none
    need_full: jax.Array  # [b] bool: the row's next call must be a full forward
    full_win: jax.Array  # [b] window start after the row's last full forward (0 at first)
    steps: jax.Array  # [b] iterations that served the row
    forks: jax.Array  # [b]
    peak: jax.Array  # [b] most active lanes at once
    refreshes: jax.Array  # [b] full forwards that served the row
    cuts: jax.Array  # [b] lanes terminated or cut by an end-of-text
    idle: jax.Array  # [b] served iterations that committed no position


@functools.lru_cache(maxsize=8)
def newline_tokens(tokenizer) -> tuple[int, ...]:
    """Ids of every vocabulary token whose text contains a newline."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return tuple(i for i, text in enumerate(texts) if "\n" in text)


# -- one iteration's update, phase by phase ---------------------------------------------
# Each phase is a pure function of fixed-shape arrays: the row's generated region
# ([b, G]), its lanes (the LaneState, [b] and [b, M]) and the static settings it reads.
# `AsyncLaneSchedule.update` runs them in order: predictions, commit, cascade, retire,
# fork, advance, refresh. `lanes.steps` is the iteration's row step throughout (it is
# counted up only after the last phase).


def text_frontier(eos, G: int, cascade: bool):
    """[b] generated positions at and after this are the end-of-text tail.

    Args:
      eos: [b] first committed end-of-text (generated index), G if none.
      G: generated positions per row.
      cascade: cascading termination on; without it nothing is tail (G).
    """
    return jnp.minimum(eos + 1, G) if cascade else jnp.full_like(eos, G)


def lane_owner(lanes: LaneState, G: int, kinds):
    """[b, G] int32: the slot whose span [start, end) holds generated position j and
    whose kind is one of `kinds`; M where none does. The spans of a row's lanes are
    disjoint (they tile its region), so a position lies in at most one of them, and the
    owner is found in O(G + M) per row instead of over [b, G, M] membership masks:
    each chosen non-empty span marks its start, the latest start at or before j is
    carried forward (a running maximum), and j belongs to that span when it lies before
    its end. (Were two spans to overlap, the one with the latest start at or before j
    would be named when it holds j; were two to start at one position, the higher
    slot.) The phases then read lanes per position through this [b, G] array and per
    lane through segment reductions over it (`per_lane`, `at_owner`)."""
    b, M = lanes.kind.shape
    rows = jnp.arange(b)[:, None]
    slots = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32)[None, :], (b, M))
    chosen = jnp.isin(lanes.kind, jnp.asarray(kinds)) & (lanes.start < lanes.end)
    at = jnp.where(chosen, lanes.start, G)  # G: dropped
    mark = jnp.full((b, G), -1, jnp.int32).at[rows, at].max(slots, mode="drop")
    j = jnp.arange(G, dtype=jnp.int32)[None, :]
    last = jax.lax.cummax(jnp.where(mark >= 0, j, -1), axis=1)  # latest start <= j
    cand = jnp.take_along_axis(mark, jnp.maximum(last, 0), axis=1)
    end = jnp.take_along_axis(lanes.end, jnp.maximum(cand, 0), axis=1)
    return jnp.where((last >= 0) & (j < end), cand, M).astype(jnp.int32)


def per_lane(owner, values, M: int, fill):
    """[b, M] the maximum of `values` [b, G] over each slot's positions (owner [b, G]
    from `lane_owner`; positions owned by none are left out); `fill` where a slot owns
    none."""
    rows = jnp.arange(owner.shape[0])[:, None]
    base = jnp.full((owner.shape[0], M), fill, values.dtype)
    return base.at[rows, owner].max(values, mode="drop")


def at_owner(owner, lane_values, fill):
    """[b, G] each position's slot's value from `lane_values` [b, M] (`fill` where no
    slot owns it)."""
    M = lane_values.shape[-1]
    got = jnp.take_along_axis(lane_values, jnp.minimum(owner, M - 1), axis=1)
    return jnp.where(owner < M, got, fill)


def scatter_predictions(ctx: Context, out: CallOutput):
    """The call's greedy predictions, placed on the generated columns they predict.

    Args:
      ctx: the canvas facts (P, G, T, mask_id).
      out: the call's output: logits [b, n, V], targets [b, n] (T: none), serve [b].
    Returns:
      pred [b, G] int32 (never the mask token), pconf [b, G] float32 its probability,
      has [b, G] bool: the call predicted the column and serves the row (elsewhere pred
      and pconf are 0 and must not be used).
    """
    P, G, T = ctx.prompt_len, ctx.gen_length, ctx.length
    rows = jnp.arange(ctx.batch)[:, None]
    x0, conf = ops.greedy_confidence(out.logits)
    x0 = ops.never_the_mask(out.logits, x0, ctx.mask_id)
    # Prompt columns and padding slots (T) go to G, which mode="drop" drops.
    tgt = jnp.where((out.targets < T) & (out.targets >= P), out.targets - P, G)
    pred = jnp.zeros((ctx.batch, G), jnp.int32).at[rows, tgt].set(x0, mode="drop")
    pconf = jnp.zeros((ctx.batch, G), jnp.float32).at[rows, tgt].set(conf, mode="drop")
    has = jnp.zeros((ctx.batch, G), bool).at[rows, tgt].set(True, mode="drop")
    return pred, pconf, has & out.serve[:, None]


def commit_phase(ctx: Context, gen, pred, pconf, has, lanes: LaneState, frontier, *,
                 block_length: int, threshold: float, refine_budget: int, refine_owner=None):
    """Which masked positions commit this iteration, in the window and in refine lanes.

    Window [win, win + B) (before the tail): every masked position with pconf >=
    threshold. Refine lanes: the same threshold; a lane forked at least refine_budget
    iterations ago also commits its most confident position (ties: all of them).

    The forced commit that guarantees progress. While no refine lane of the row holds a
    mask, the window's most confident candidate always commits (block decoding). While
    one does (the row is *refining*), the window never forces its best, so the
    continuation commits only what it is sure of; instead the refine lanes' most
    confident candidate commits every iteration, or, when the call predicted none, the
    window's most confident candidate. Every served iteration that predicted a masked
    candidate commits at least one position.

    Args:
      ctx: the canvas facts (mask_id).
      gen: [b, G] int32 generated region before this iteration.
      pred, pconf, has: [b, G] from `scatter_predictions`.
      lanes: LaneState (win, kind, start, end, split, steps are read).
      frontier: [b] `text_frontier` of the end-of-text before this iteration.
      block_length .. refine_budget: the schedule's settings of those names (threshold
        a number, or [b, 1] per row: the schedule passes its traced per-row values).
      refine_owner: [b, G] `lane_owner(lanes, G, (REFINE,))` when the caller has it
        (computed here when None).
    Returns:
      new [b, G] int32 gen with the commits.
    """
    G = gen.shape[-1]
    j = jnp.arange(G)[None, :]
    masked = gen == ctx.mask_id
    lo = lanes.win[:, None]
    in_win = (j >= lo) & (j < lo + block_length) & (j < frontier[:, None])
    M = lanes.kind.shape[-1]
    owner_r = lane_owner(lanes, G, (REFINE,)) if refine_owner is None else refine_owner
    in_r = owner_r < M  # [b, G] the position lies in a refine lane
    refining = jnp.any(in_r & masked, axis=-1, keepdims=True)  # [b, 1]
    cand = masked & in_win & has

    def best_of(ok_):  # [b, G] the most confident position among ok_ (first on ties)
        c_ = jnp.where(ok_, pconf, ops.NEG_INF)
        return ok_ & (j == jnp.argmax(c_, axis=-1)[:, None])

    rcand = masked & has & in_r  # [b, G]
    top1 = best_of(cand) & ~refining
    ok = pconf >= threshold
    commit = (cand & ok) | top1

    lane_best = per_lane(owner_r, jnp.where(rcand, pconf, ops.NEG_INF), M,
                         ops.NEG_INF)  # [b, M]
    over = (lanes.steps[:, None] - lanes.split) >= refine_budget  # [b, M]
    is_best = (at_owner(owner_r, over, False)
               & (pconf >= at_owner(owner_r, lane_best, jnp.inf)))  # [b, G]
    commit = commit | (rcand & (ok | is_best))
    # Never an iteration without a commit while refining: the refine lanes first.
    has_r = jnp.any(rcand, axis=-1, keepdims=True)
    forced = jnp.where(has_r, best_of(rcand), best_of(cand))
    commit = commit | (refining & forced)
    return jnp.where(commit, pred, gen)


def cascade_phase(ctx: Context, new, lanes: LaneState, *, cascade: bool):
    """Cascading termination at the first committed end-of-text.

    The earliest committed end-of-text e (this iteration's or an earlier one) is always
    recorded. With the cascade, every position after e becomes end-of-text (ctx.eos_id),
    a placed lane (not free, not terminated) starting at or after e + 1 is terminated
    (death = this step unless it had died already), and one straddling e + 1 is cut to
    end there; each counts one cut.

    Args:
      ctx: the canvas facts (mask_id, eos_id, is_stop).
      new: [b, G] int32 generated region after the commit phase.
      lanes: LaneState (eos, kind, start, end, death, cuts, steps are read).
      cascade: the schedule's setting.
    Returns:
      (new [b, G] with the tail filled, lanes with eos [b] and (cascade) kind, end,
      death [b, M] and cuts [b] updated).
    """
    G = new.shape[-1]
    j = jnp.arange(G)[None, :]
    is_stop = ~(new == ctx.mask_id) & ctx.is_stop(new)
    eos = jnp.minimum(lanes.eos, jnp.min(jnp.where(is_stop, j, G), axis=-1)).astype(jnp.int32)
    lanes = lanes.replace(eos=eos)
    if not cascade:
        return new, lanes
    front = text_frontier(eos, G, cascade)[:, None]  # [b, 1]
    new = jnp.where(j > eos[:, None], ctx.eos_id, new)
    kind = lanes.kind
    placed = (kind != FREE) & (kind != TERMINATED)
    gone = placed & (lanes.start >= front)
    cut = placed & ~gone & (lanes.end > front)
    # A lane that finished before the end-of-text keeps the step it finished at.
    death = jnp.where(gone & (lanes.death < 0), lanes.steps[:, None], lanes.death)
    return new, lanes.replace(
        kind=jnp.where(gone, TERMINATED, kind).astype(jnp.int32),
        end=jnp.where(cut, front, lanes.end).astype(jnp.int32),
        death=death.astype(jnp.int32),
        cuts=(lanes.cuts + jnp.sum(gone | cut, axis=-1)).astype(jnp.int32))


def retire_phase(ctx: Context, new, lanes: LaneState, refine_owner=None) -> LaneState:
    """Refine lanes with no masked position left in their span are done (death = this
    step).

    Args:
      ctx: the canvas facts (mask_id).
      new: [b, G] int32 generated region after the cascade.
      lanes: LaneState (kind, start, end, death, steps are read).
      refine_owner: [b, G] `lane_owner(lanes, G, (REFINE,))` of these lanes when the
        caller has it (computed here when None).
    Returns:
      lanes with kind and death [b, M] updated.
    """
    G, M = new.shape[-1], lanes.kind.shape[-1]
    owner = lane_owner(lanes, G, (REFINE,)) if refine_owner is None else refine_owner
    masked = per_lane(owner, (new == ctx.mask_id).astype(jnp.int32), M, 0) > 0  # [b, M]
    finished = (lanes.kind == REFINE) & ~masked  # [b, M]
    return lanes.replace(kind=jnp.where(finished, DONE, lanes.kind).astype(jnp.int32),
                         death=jnp.where(finished, lanes.steps[:, None],
                                         lanes.death).astype(jnp.int32))


def fork_phase(ctx: Context, new, lanes: LaneState, frontier, serve, *, block_length: int,
               refine_window: int, stable_fraction: float, delimiter_ids: tuple[int, ...],
               fresh, query_slots: int):
    """A committed delimiter in the window forks the generate lane.

    The fork point d is the last committed delimiter in the window [win, win + B) whose
    prefix [win, d] holds at most refine_window masks and is at least stable_fraction
    committed, with a position left after it before the tail, and whose masks and
    committed positions with stale cached K/V together fit in `query_slots` (the next
    call's extra queries then re-encode every stale one while serving the masks, so no
    full forward is needed at a fork; a prefix committed in one go, as a row's first
    call does, forks a call later, once the window's own queries re-encoded it). A served row whose
    generate lane is live and that has a free slot forks there: the generate lane's span
    ends at d + 1 and it becomes a refine lane (done at once when the prefix holds no
    mask), split at this step; the first free slot becomes the generate lane, starting
    at d + 1 with the window, child of the old one, born this step. No fork with fewer
    than two slots or no delimiters.

    Args:
      ctx: the canvas facts (mask_id).
      new: [b, G] int32 generated region after the cascade.
      lanes: LaneState (win, gen_slot, kind, start, end, parent, birth, death, split,
        forks, steps are read).
      frontier: [b] `text_frontier` after the cascade.
      serve: [b] bool, the rows the call served.
      block_length, refine_window, stable_fraction: the schedule's settings
        (stable_fraction a number, or [b, 1] per row).
      delimiter_ids: the token ids that fork (empty: no forking).
      fresh: [b, G] bool, the columns whose cached K/V were computed from their
        current token after this call (`fresh_columns`).
      query_slots: the most masked and stale positions a prefix may hold (the
        schedule's extra_queries).
    Returns:
      (lanes with win, gen_slot, forks [b] and kind, start, end, parent, birth, death,
      split [b, M] updated; fork [b] bool: the row forked).
    """
    b, M = lanes.kind.shape
    if M == 1 or not delimiter_ids:
        return lanes, jnp.zeros((b,), bool)
    G = new.shape[-1]
    j = jnp.arange(G)[None, :]
    t = lanes.steps[:, None]
    lo, front = lanes.win[:, None], frontier[:, None]
    new_masked = new == ctx.mask_id
    in_win = (j >= lo) & (j < lo + block_length) & (j < front)
    delim = in_win & ~new_masked & jnp.isin(new, jnp.asarray(delimiter_ids))
    delim = delim & (j + 1 < front)  # the new lane must have a position to start at
    masks_upto = jnp.cumsum(in_win & new_masked, axis=-1)  # masks in [win, j]
    length = (j - lo + 1).astype(jnp.float32)
    stable = (masks_upto <= refine_window) & (1.0 - masks_upto / length >= stable_fraction)
    # The next call re-encodes every stale position of the prefix.
    stale_upto = jnp.cumsum(in_win & ~new_masked & ~fresh, axis=-1)
    stable = stable & (masks_upto + stale_upto <= query_slots)
    d = jnp.max(jnp.where(delim & stable, j, -1), axis=-1)  # [b], -1: no fork point

    kind = lanes.kind
    g = lanes.gen_slot[:, None]
    gen_live = jnp.take_along_axis(kind, g, axis=1)[:, 0] == GENERATE
    free = kind == FREE
    new_slot = jnp.argmax(free, axis=-1)  # slots are taken in order, never reused
    fork = serve & gen_live & (d >= 0) & jnp.any(free, axis=-1)
    prefix_masks = jnp.take_along_axis(masks_upto, jnp.maximum(d, 0)[:, None], 1)[:, 0]
    slots = jnp.arange(M)[None, :]
    at_g = (slots == g) & fork[:, None]
    at_n = (slots == new_slot[:, None]) & fork[:, None]
    kind = jnp.where(at_g, jnp.where(prefix_masks > 0, REFINE, DONE)[:, None], kind)
    kind = jnp.where(at_n, GENERATE, kind)
    return lanes.replace(
        kind=kind.astype(jnp.int32),
        start=jnp.where(at_n, (d + 1)[:, None], lanes.start).astype(jnp.int32),
        end=jnp.where(at_g, (d + 1)[:, None], lanes.end).astype(jnp.int32),
        parent=jnp.where(at_n, g, lanes.parent).astype(jnp.int32),
        birth=jnp.where(at_n, t, lanes.birth).astype(jnp.int32),
        death=jnp.where(at_g & (prefix_masks == 0)[:, None], t, lanes.death).astype(jnp.int32),
        split=jnp.where(at_g, t, lanes.split).astype(jnp.int32),
        win=jnp.where(fork, d + 1, lanes.win).astype(jnp.int32),
        gen_slot=jnp.where(fork, new_slot, lanes.gen_slot).astype(jnp.int32),
        forks=(lanes.forks + fork).astype(jnp.int32)), fork


def advance_phase(ctx: Context, new, lanes: LaneState, frontier, serve, fork, *,
                  block_length: int):
    """The window moves on, and the generate lane's span follows it.

    A served row whose generate lane is live, that did not fork, and whose window (up
    to the tail) holds no mask moves its window by B. The generate lane is then done
    when its window starts at or past the tail or nothing from it on is masked: its
    span ends at the tail. Otherwise a live generate lane's span ends at
    min(win + B, tail). peak counts the live lanes (generate and refine) afterwards.

    Args:
      ctx: the canvas facts (mask_id).
      new: [b, G] int32 generated region after the cascade.
      lanes: LaneState after the fork (win, gen_slot, kind, end, death, peak, steps).
      frontier: [b] `text_frontier` after the cascade.
      serve: [b] bool, the rows the call served.
      fork: [b] bool from `fork_phase`.
      block_length: B.
    Returns:
      (lanes with win, peak [b] and kind, end, death [b, M] updated; advance [b] bool:
      the window moved; gen_done [b] bool: the generate lane finished here).
    """
    M = lanes.kind.shape[-1]
    G = new.shape[-1]
    j = jnp.arange(G)[None, :]
    new_masked = new == ctx.mask_id
    front = frontier[:, None]
    g = lanes.gen_slot[:, None]
    kind = lanes.kind
    gen_live = jnp.take_along_axis(kind, g, axis=1)[:, 0] == GENERATE
    w = lanes.win[:, None]
    win_masks = jnp.any((j >= w) & (j < w + block_length) & (j < front) & new_masked, axis=-1)
    advance = serve & gen_live & ~fork & ~win_masks
    win = jnp.where(advance, lanes.win + block_length, lanes.win)
    # The generate lane is done when nothing from its window on is masked.
    rest = jnp.any((j >= win[:, None]) & (j < front) & new_masked, axis=-1)
    gen_done = gen_live & ((win >= frontier) | ~rest)
    at_gen = jnp.arange(M)[None, :] == g
    ends = at_gen & gen_done[:, None]
    kind = jnp.where(ends, DONE, kind)
    end = jnp.where(at_gen & (kind == GENERATE), jnp.minimum(win + block_length, frontier)[:, None],
                    lanes.end)
    end = jnp.where(ends, front, end)
    active = jnp.sum((kind == GENERATE) | (kind == REFINE), axis=-1)
    return lanes.replace(
        win=win.astype(jnp.int32), kind=kind.astype(jnp.int32), end=end.astype(jnp.int32),
        death=jnp.where(ends, lanes.steps[:, None], lanes.death).astype(jnp.int32),
        peak=jnp.maximum(lanes.peak, active).astype(jnp.int32)), advance, gen_done


def fresh_columns(ctx: Context, gen, new, lanes: LaneState, out: CallOutput):
    """[b, G] bool: the generated columns whose cached K/V are current after this call:
    the call encoded them (a full forward encodes every column; a query at column c
    encodes c) or they were fresh, and their token did not change (a commit makes a
    column dirty: its cached K/V were computed from the mask)."""
    P, G, T = ctx.prompt_len, ctx.gen_length, ctx.length
    rows = jnp.arange(ctx.batch)[:, None]
    # A query at column c encodes c (the target c + shift is what it predicts).
    enc = jnp.where(out.targets < T, out.targets - ctx.shift - P, G)
    encoded = jnp.zeros((ctx.batch, G), bool).at[rows, enc].set(True, mode="drop")
    encoded = jnp.where(jnp.reshape(out.full, (-1, 1)), True, encoded) & out.serve[:, None]
    return (lanes.fresh | encoded) & (new == gen)


def refresh_phase(ctx: Context, gen, new, lanes: LaneState, out: CallOutput, advance,
                  gen_done, *, refresh_travel: int, fresh=None) -> LaneState:
    """Cache bookkeeping: which cached K/V are current, and whether the next call of a
    row must be a full forward.

    A generated column is fresh when this call encoded it (a full forward encodes every
    column) or it was fresh, and its token did not change (a commit makes it dirty: its
    cached K/V were computed from the mask). A served full forward counts a refresh.
    The next call of a served row is a full forward when the window moved on without
    finishing the generate lane (Fast-dLLM's dual cache re-encodes at each new block),
    and, with refresh_travel, when the window has moved refresh_travel positions or
    more since the row's last full forward (by forks as well as advances: a fork moves
    the window without an advance).

    Args:
      ctx: the canvas facts (P, G, T, shift).
      gen: [b, G] int32 generated region before this iteration.
      new: [b, G] int32 after the cascade.
      lanes: LaneState after the advance (win, fresh, need_full, full_win, refreshes
        are read).
      out: the call's output (targets [b, n], full [], serve [b]).
      advance, gen_done: [b] bool from `advance_phase`.
      refresh_travel: the schedule's setting.
      fresh: [b, G] bool, `fresh_columns` of this call when the caller has it (computed
        here when None).
    Returns:
      lanes with fresh [b, G] and full_win, need_full, refreshes [b] updated.
    """
    if fresh is None:
        fresh = fresh_columns(ctx, gen, new, lanes, out)
    full = out.serve & out.full
    full_win = jnp.where(full, lanes.win, lanes.full_win)
    need = advance & ~gen_done  # a full forward at each new block
    if refresh_travel:  # the window moved a block's worth since the last full forward
        need = need | ((lanes.win - full_win >= refresh_travel) & ~gen_done)
    return lanes.replace(
        fresh=fresh, full_win=full_win.astype(jnp.int32),
        need_full=jnp.where(out.serve, need, lanes.need_full),
        refreshes=(lanes.refreshes + full).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class AsyncLaneSchedule(Schedule):
    """AsyncLane: lanes that fork at delimiters, refine and advance at once.

    A row's first call, and its call after each move of the window to a new block, are
    full forwards over the canvas (the dual cache of Fast-dLLM); the calls in between
    are cached calls. While a refine lane holds a mask, the refine lanes' most confident
    position commits every iteration (else the window's), so forking never idles; a
    prefix forks only when the next call's extra queries can re-encode every stale
    position in it.

    Attributes:
      block_length: B, positions in the generate window.
      threshold: confidence at which a masked position commits (window and refine lanes).
      max_lanes: lane slots per row (the lane tree's size); each fork takes one, and
        forking stops when they run out (1: no forking; the window works through
        the canvas block by block). Default (None): when the delimiters are known
        (a tokenizer, or delimiters given as ids), one slot per 8 generated
        positions and at least 16 (`lane_slots`: 64 at gen_length 512), so that
        forking does not run out of slots on long answers; else one lane, with a
        warning.
      delimiters: where lanes fork: newline (every token whose text contains a
        newline; needs the tokenizer when max_lanes > 1), none, or comma-separated
        token ids.
      refine_window: most masked positions a prefix may still hold when it forks.
      stable_fraction: least committed fraction of a prefix when it forks.
      refine_budget: iterations after a fork from which a refine lane also commits its
        own most confident position every iteration (before that, only the one commit
        forced per iteration, the refine lanes' most confident, serves it). Default
        (None): extra_queries, so that the budget grows with the refine-lane masks
        one call serves.
      extra_queries: E, query slots per call for dirty positions and refine lanes; a
        prefix forks only when its masks and stale positions fit in them. Default
        (None): 8 from gen_length 512 up, else 4.
      refresh_travel: a full forward once the window has moved this many positions
        since the row's last one, by forks or advances (0: off). Forks move the window
        without an advance, so with forking the cache of the canvas after the window
        is otherwise never renewed; refresh_travel=B renews it as often as the refresh
        at each new block does with one lane.
      cascade: cascading termination at the first committed end-of-text.
    """

    name = "asynclane"
    stats_type = LaneStats
    structural: ClassVar[tuple[str, ...]] = ("gen_length", "delimiter_ids")
    # The bench: the sampler under study; its rows meet the baselines of its footing.
    under_study: ClassVar[bool] = True
    # A refresh serves only the rows due one: the driver computes only those.
    compact_full: ClassVar[bool] = True
    mixes_calls: ClassVar[bool] = True
    footing_options: ClassVar[tuple[str, ...]] = ("cascade",)
    # Per-row arguments of the program (schedule.py): rows at different thresholds
    # decode in one program.
    traced_options: ClassVar[tuple[str, ...]] = ("threshold", "stable_fraction")
    # A block-causal model (LLaDA2) decoded with its own layout: lanes commit only in
    # the first of its blocks with masks (Context.commit_gate), so the continuation
    # waits at a block boundary until the refine lanes before it are done.
    gated_commits: ClassVar[bool] = True
    block_length: int = 32
    threshold: float = 0.95
    max_lanes: int | None = None
    delimiters: str = "newline"
    refine_window: int = 4
    stable_fraction: float = 0.5
    refine_budget: int | None = None
    extra_queries: int | None = None
    refresh_travel: int = 32
    cascade: bool = True
    # The delimiter token ids, resolved from `delimiters` (and the tokenizer) by `bind`.
    delimiter_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.name
        if self.extra_queries is None:
            object.__setattr__(self, "extra_queries", EXTRA_QUERIES_LONG
                               if self.gen_length >= LONG_CANVAS else EXTRA_QUERIES_SHORT)
        if self.refine_budget is None:
            object.__setattr__(self, "refine_budget", self.extra_queries)
        ops.check_threshold(n, self.threshold)
        for field, low in (("block_length", 1), ("max_lanes", 1), ("refine_window", 0),
                           ("refine_budget", 0), ("extra_queries", 0),
                           ("refresh_travel", 0)):
            if getattr(self, field) is not None and getattr(self, field) < low:
                raise SamplerError(f"{n}: {field}={getattr(self, field)} must be >= {low}")
        if not 0 <= self.stable_fraction <= 1:
            raise SamplerError(f"{n}: stable_fraction={self.stable_fraction} must be in [0, 1]")
        if self.max_lanes != 1 and self.extra_queries == 0:
            raise SamplerError(f"{n}: forking (max_lanes > 1) needs extra_queries >= 1 "
                               "to serve the refine lanes")
        if self.delimiter_ids is None and self.delimiters not in ("newline", "none"):
            object.__setattr__(self, "delimiter_ids", self._parse_ids(self.delimiters))
        if self.delimiters == "none":
            object.__setattr__(self, "delimiter_ids", ())

    def _parse_ids(self, text: str) -> tuple[int, ...]:
        try:
            ids = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
        except ValueError:
            raise SamplerError(
                f"{self.name}: delimiters={text!r}: expected newline, none, or "
                "comma-separated token ids") from None
        if any(i < 0 for i in ids):
            raise SamplerError(f"{self.name}: delimiters={text!r}: token ids are >= 0")
        return ids

    def bind(self, tokenizer, cfg) -> AsyncLaneSchedule:
        ids = self.delimiter_ids
        if ids is not None:
            bad = [i for i in ids if i >= cfg.vocab_size]
            if bad:
                raise SamplerError(f"{self.name}: delimiter ids {bad} are outside the "
                                   f"vocabulary of {cfg.vocab_size}")
        elif self.max_lanes == 1:  # no forking: no delimiters needed
            ids = ()
        elif tokenizer is not None:
            ids = newline_tokens(tokenizer)
        elif self.max_lanes is None:  # the default: fork when the newlines are known
            warnings.warn(
                f"{self.name}: no tokenizer to find the newline tokens it forks at, so "
                "it decodes with one lane; pass tokenizer=..., or delimiters as token "
                "ids, to fork (or max_lanes=1 to say so)", stacklevel=3)
            ids = ()
        else:
            raise SamplerError(
                f"{self.name}: delimiters='newline' needs the tokenizer (generate(..., "
                "tokenizer=...)); or give delimiters as token ids, or 'none'")
        bound = dataclasses.replace(self, delimiter_ids=ids)
        return dataclasses.replace(bound, max_lanes=bound.lane_slots)

    @property
    def lane_slots(self) -> int:
        """max_lanes, or its default for the delimiters known so far: when there are
        some, one slot per LANE_SPACING generated positions and at least
        DEFAULT_MAX_LANES (64 at gen_length 512, 32 at 256); else 1."""
        if self.max_lanes is not None:
            return self.max_lanes
        if not self.delimiter_ids:
            return 1
        return max(DEFAULT_MAX_LANES, self.gen_length // LANE_SPACING)

    # -- what the driver asks -------------------------------------------------------
    @property
    def uses_cache(self) -> bool:
        return True

    @property
    def forking(self) -> bool:
        return self.lane_slots > 1 and bool(self.delimiter_ids)

    def max_iterations(self) -> int:
        # A served iteration commits at least one window position, or re-encodes a
        # dirty position (each commit makes at most one), or ages a refine lane; rows
        # may also wait one iteration per refresh of another row.
        return 4 * self.gen_length + 2 * self.refine_budget + 16

    def init(self, ctx: Context) -> LaneState:
        b, G, M = ctx.batch, ctx.gen_length, self.lane_slots
        slots = jnp.arange(M)[None, :]
        zeros = jnp.zeros((b,), jnp.int32)
        first = slots == 0
        return LaneState(
            win=zeros, gen_slot=zeros,
            kind=jnp.broadcast_to(jnp.where(first, GENERATE, FREE), (b, M)).astype(jnp.int32),
            start=jnp.zeros((b, M), jnp.int32),
            end=jnp.broadcast_to(jnp.where(first, min(self.block_length, G), 0),
                                 (b, M)).astype(jnp.int32),
            parent=jnp.full((b, M), -1, jnp.int32),
            birth=jnp.broadcast_to(jnp.where(first, 0, -1), (b, M)).astype(jnp.int32),
            death=jnp.full((b, M), -1, jnp.int32),
            split=jnp.full((b, M), -1, jnp.int32),
            fresh=jnp.zeros((b, G), bool),
            eos=jnp.full((b,), G, jnp.int32),
            need_full=jnp.ones((b,), bool),  # the first call is a full forward
            full_win=zeros, steps=zeros, forks=zeros, peak=jnp.ones((b,), jnp.int32),
            refreshes=zeros, cuts=zeros, idle=zeros)

    # -- helpers ----------------------------------------------------------------------
    def _refine_owner(self, st: LaneState, G: int):
        """[b, G] `lane_owner` of the refine lanes; without forking there are none (no
        fork makes one), so it is the constant M and what reads it folds away."""
        if self.forking:
            return lane_owner(st, G, (REFINE,))
        b, M = st.kind.shape
        return jnp.full((b, G), M, jnp.int32)

    # -- the schedule -----------------------------------------------------------------
    def plan(self, ctx: Context, canvas, st: LaneState, live) -> Plan:
        P, G, T, s = ctx.prompt_len, ctx.gen_length, ctx.length, ctx.shift
        B, E = self.block_length, self.extra_queries
        frontier = text_frontier(st.eos, G, self.cascade)[:, None]
        gen = canvas[:, P:]
        masked = gen == ctx.mask_id
        j = jnp.arange(G)[None, :]

        def targets(first, n):  # generated targets first .. first + n - 1, as query columns
            t = first[:, None] + jnp.arange(n)[None, :]
            return jnp.where(t < frontier, P + t - s, T)  # nothing in the tail is queried

        parts = [targets(st.win, B)]
        if E:
            # Columns the window's queries encode (a target c is queried at c - s).
            win_enc = (j >= st.win[:, None] - s) & (j < st.win[:, None] + B - s)
            dirty = ~masked & ~st.fresh & (j < frontier) & ~win_enc
            # (Refine lanes lie before the window: the window's queries never cover them.)
            refine = masked & (self._refine_owner(st, G) < st.kind.shape[-1])
            order = (G - j).astype(jnp.float32) / (G + 1)  # earlier first
            score = jnp.where(refine, 2.0 + order, jnp.where(dirty, 1.0 + order, ops.NEG_INF))
            top, idx = jax.lax.top_k(score, min(E, G))
            col = P + idx - jnp.where(top >= 2.0, s, 0)  # a refine target is queried at c - s
            parts.append(jnp.where(jnp.isfinite(top), col, T))
        positions = jnp.concatenate(parts, axis=1).astype(jnp.int32)
        need = live & st.need_full
        full = jnp.any(need)
        if ctx.mixed:  # each row's call of its own kind, in one model call
            return Plan(positions=positions, full=full, serve=live, full_rows=need)
        return Plan(positions=positions, full=full, serve=jnp.where(full, need, live))

    def update(self, ctx: Context, canvas, st: LaneState, out: CallOutput, key):
        """One iteration's commits and lane moves: the phases above, in order. The
        cascade runs before the fork and the advance, which see the cut lanes and the
        new frontier; the commit phase sees the frontier before it."""
        del key
        P, G, B = ctx.prompt_len, ctx.gen_length, self.block_length
        gen = canvas[:, P:]  # [b, G]
        pred, pconf, has = scatter_predictions(ctx, out)
        has = has & ctx.commit_gate(gen)  # a block-causal model: its first unfinished block
        owner = self._refine_owner(st, G)  # once per iteration: the plan's lanes
        new = commit_phase(
            ctx, gen, pred, pconf, has, st, text_frontier(st.eos, G, self.cascade),
            block_length=B, threshold=self.row_option(ctx, "threshold")[:, None],
            refine_budget=self.refine_budget,
            refine_owner=owner)
        new, lanes = cascade_phase(ctx, new, st, cascade=self.cascade)
        # The cascade only terminates lanes and cuts their ends: a position keeps its
        # refine lane unless that lane is terminated or cut before it.
        M = lanes.kind.shape[-1]
        owner = jnp.where((at_owner(owner, lanes.kind, FREE) == REFINE)
                          & (jnp.arange(G)[None, :] < at_owner(owner, lanes.end, 0)),
                          owner, M)
        committed = jnp.any((gen == ctx.mask_id) & (new != ctx.mask_id), axis=-1)
        lanes = lanes.replace(idle=(lanes.idle + (out.serve & ~committed)).astype(jnp.int32))
        frontier = text_frontier(lanes.eos, G, self.cascade)
        lanes = retire_phase(ctx, new, lanes, refine_owner=owner)
        fresh = fresh_columns(ctx, gen, new, lanes, out)
        lanes, fork = fork_phase(
            ctx, new, lanes, frontier, out.serve, block_length=B,
            refine_window=self.refine_window,
            stable_fraction=self.row_option(ctx, "stable_fraction")[:, None],
            delimiter_ids=self.delimiter_ids if self.forking else (),
            fresh=fresh, query_slots=self.extra_queries)
        lanes, advance, gen_done = advance_phase(ctx, new, lanes, frontier, out.serve, fork,
                                                 block_length=B)
        lanes = refresh_phase(
            ctx, gen, new, lanes, out, advance, gen_done, refresh_travel=self.refresh_travel,
            fresh=fresh)
        return canvas.at[:, P:].set(new), lanes.replace(steps=st.steps + out.serve)

    def done(self, ctx: Context, canvas, st: LaneState):
        return ~jnp.any(canvas[:, ctx.prompt_len:] == ctx.mask_id, axis=-1)

    def summary(self, ctx: Context, st: LaneState) -> dict:
        return {"lane_kind": st.kind, "lane_start": st.start, "lane_end": st.end,
                "lane_parent": st.parent, "lane_birth": st.birth, "lane_death": st.death,
                "lane_split": st.split,
                "forks": st.forks, "peak_lanes": st.peak, "refreshes": st.refreshes,
                "cascade_cuts": st.cuts, "idle_steps": st.idle}
