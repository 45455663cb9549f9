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

The visible horizon. A row's first call is not a full forward over the whole canvas
but a cached call over the prompt and the first block_length + horizon generated
positions, which attend only to each other; the rest of the canvas stays out of
attention (its K/V are never computed) until the window comes within horizon/2 of the
visible end, when one full forward makes the whole canvas visible. An answer that ends
inside the horizon costs no computation over the tail at all, whatever gen_length is:
while a row's view is within the first block_length + horizon positions, its cached
calls read and attend only that part of the cache (`Schedule.key_bound`).

One iteration (per row):
  1. Query set (shared-prefix lane batching). One cached call queries, against the K/V
     of the visible canvas: the generate window (B), a lookahead window after it (W),
     and `extra_queries` (E) positions picked by priority: first the refine lanes'
     masked positions, earliest first, then *dirty* positions (committed since their
     cached K/V was computed: re-encoding them is the compact cache refresh).
  2. Full refresh. A full forward serves a row when its window nears the horizon (it
     then shows the whole canvas), every `refresh_every`-th call when that is set, and,
     with `refresh_at_advance` (the default), after the window moves to a new block, as
     Fast-dLLM's dual cache does; under the horizon these re-encode only the visible
     part. With horizon 0 the row's first call is one too. Its logits decode that
     step. Rows that need no refresh wait for one iteration while a full forward serves
     the rows that do (so each row decodes exactly as it would alone).
  3. Commit. Window: every masked position with confidence >= threshold; within
     `radius` of such an anchor, >= relaxed_threshold (LocalLeap's rule); lookahead
     draft reuse: a position whose prediction equals the draft made for it while it
     was in the lookahead window commits at draft_threshold; and the most confident
     position, unless a refine lane is open (then the continuation commits only what
     it is sure of). Refine lanes: confidence >= threshold; a lane older than
     refine_budget iterations also commits its most confident position each
     iteration. Lookahead positions never commit; their predictions become drafts.
  4. Cascading termination. An end-of-text committed at p makes every later position
     end-of-text; lanes starting after p are terminated, a lane straddling p is cut
     there, and no call is spent on the tail.
  5. Fork (above) or advance: a window with no masks left moves on by B positions.
     A refine lane with no masks left is done. A row is finished when no generated
     position is masked.

Defaults are the settings measured fastest at the baselines' accuracy on the shipped
models (experiments/results/asynclane.md): one lane (max_lanes=1: on the testbed's
chained arithmetic every line needs the previous line's result, and forking cost calls
and accuracy), no lookahead, the visible horizon, the cascade, compact refresh, and a
refresh of the visible part when the window moves to a new block (without it tiny-dream
lost 4 points). Set max_lanes (e.g. 16) to fork at delimiters.

Dream's logit shift: every query for a column c is made at c - 1 (schedule.py), in full
and cached calls alike, so every column of the window gets a prediction in every call.

With one lane, no lookahead, no relaxation (relaxed_threshold = threshold), horizon 0,
the cascade off and refresh_at_advance on, AsyncLane decodes exactly as Fast-dLLM's
threshold sampler with a dual cache on LLaDA models (tests/test_asynclane.py checks it
token for token).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.lanes import DONE, FREE, GENERATE, REFINE, TERMINATED, LaneStats
from asynclane_jax.decoding.schedule import CallOutput, Context, Plan, SamplerError, Schedule


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
    draft: jax.Array  # [b, G] int32 lookahead prediction, -1 none
    eos: jax.Array  # [b] first committed end-of-text (generated index), G if none
    visible: jax.Array  # [b] generated positions [0, visible) are attended (the horizon)
    extend: jax.Array  # [b] bool: the window nears the horizon; the next (full) call shows all
    need_full: jax.Array  # [b] bool: the row's next call must be a full forward
    since_full: jax.Array  # [b] calls serving the row since its last full forward
    steps: jax.Array  # [b] iterations that served the row
    forks: jax.Array  # [b]
    peak: jax.Array  # [b] most active lanes at once
    refreshes: jax.Array  # [b] full forwards that served the row
    cuts: jax.Array  # [b] lanes terminated or cut by an end-of-text


@functools.lru_cache(maxsize=8)
def newline_tokens(tokenizer) -> tuple[int, ...]:
    """Ids of every vocabulary token whose text contains a newline."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return tuple(i for i, text in enumerate(texts) if "\n" in text)


@dataclasses.dataclass(frozen=True)
class AsyncLaneSchedule(Schedule):
    """AsyncLane: lanes that fork at delimiters, refine and advance at once.

    Attributes:
      block_length: B, positions in the generate window.
      threshold: confidence at which a masked position commits (window and refine lanes).
      relaxed_threshold: confidence at which a window position within `radius` of an
        anchor (a position committing at threshold this step) commits, as LocalLeap
        does (capped at threshold; equal to it: no relaxation).
      radius: an anchor's neighbourhood, in positions.
      lookahead: W, positions after the window whose predictions are kept as drafts
        (0: no lookahead).
      draft_threshold: confidence at which a window position commits when its
        prediction equals its lookahead draft (capped at threshold).
      max_lanes: lane slots per row (the lane tree's size); each fork takes one, and
        forking stops when they run out (1: no forking; the window works through
        the canvas block by block).
      delimiters: where lanes fork: newline (every token whose text contains a
        newline; needs the tokenizer when max_lanes > 1), none, or comma-separated
        token ids.
      refine_window: most masked positions a prefix may still hold when it forks.
      stable_fraction: least committed fraction of a prefix when it forks.
      refine_budget: iterations a refine lane commits by threshold only; after that
        it also commits its most confident position every iteration.
      extra_queries: E, query slots per call for dirty positions and refine lanes.
      horizon: generated positions visible beyond the window's end (0: the whole
        canvas, always). The first call is a cached call over the prompt and the first
        block_length + horizon positions only, with the rest of the canvas out of
        attention; when the window comes within horizon/2 of the visible end, a full
        forward makes the whole canvas visible from then on. Other full forwards
        (refresh_every, refresh_at_advance) keep the horizon and re-encode only the
        visible part.
      refresh_every: a full forward every this many calls of a row (0: none).
      refresh_at_advance: a full forward whenever the window moves to a new block
        (Fast-dLLM's dual-cache schedule); under the horizon it re-encodes only the
        visible part.
      cascade: cascading termination at the first committed end-of-text.
      cache: dual (cached calls between full forwards) or none (every call a full
        forward).
    """

    name = "asynclane"
    stats_type = LaneStats
    structural: ClassVar[tuple[str, ...]] = ("gen_length", "delimiter_ids")
    block_length: int = 32
    threshold: float = 0.9
    relaxed_threshold: float = 0.75
    radius: int = 4
    lookahead: int = 0
    draft_threshold: float = 0.7
    max_lanes: int = 1
    delimiters: str = "newline"
    refine_window: int = 4
    stable_fraction: float = 0.5
    refine_budget: int = 4
    extra_queries: int = 4
    horizon: int = 96
    refresh_every: int = 0
    refresh_at_advance: bool = True
    cascade: bool = True
    cache: str = "dual"
    # The delimiter token ids, resolved from `delimiters` (and the tokenizer) by `bind`.
    delimiter_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.name
        ops.check_threshold(n, self.threshold)
        ops.check_threshold(n, self.draft_threshold, "draft_threshold")
        ops.check_threshold(n, self.relaxed_threshold, "relaxed_threshold")
        for field, low in (("block_length", 1), ("radius", 0), ("lookahead", 0), ("max_lanes", 1),
                           ("refine_window", 0), ("refine_budget", 0), ("extra_queries", 0),
                           ("horizon", 0), ("refresh_every", 0)):
            if getattr(self, field) < low:
                raise SamplerError(f"{n}: {field}={getattr(self, field)} must be >= {low}")
        if not 0 <= self.stable_fraction <= 1:
            raise SamplerError(f"{n}: stable_fraction={self.stable_fraction} must be in [0, 1]")
        if self.cache not in ("dual", "none"):
            raise SamplerError(f"{n}: cache={self.cache!r}: expected dual or none")
        if self.max_lanes > 1 and self.extra_queries == 0:
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
        if self.delimiter_ids is not None:
            bad = [i for i in self.delimiter_ids if i >= cfg.vocab_size]
            if bad:
                raise SamplerError(f"{self.name}: delimiter ids {bad} are outside the "
                                   f"vocabulary of {cfg.vocab_size}")
            return self
        if self.max_lanes == 1:  # no forking: no delimiters needed
            return dataclasses.replace(self, delimiter_ids=())
        if tokenizer is None:
            raise SamplerError(
                f"{self.name}: delimiters='newline' needs the tokenizer (generate(..., "
                "tokenizer=...)); or give delimiters as token ids, or 'none'")
        return dataclasses.replace(self, delimiter_ids=newline_tokens(tokenizer))

    # -- what the driver asks -------------------------------------------------------
    @property
    def uses_cache(self) -> bool:
        return self.cache != "none"

    @property
    def forking(self) -> bool:
        return self.max_lanes > 1 and bool(self.delimiter_ids)

    def max_iterations(self) -> int:
        # A served iteration commits at least one window position, or re-encodes a
        # dirty position (each commit makes at most one), or ages a refine lane; rows
        # may also wait one iteration per refresh of another row.
        return 4 * self.gen_length + 2 * self.refine_budget + 16

    def init(self, ctx: Context) -> LaneState:
        b, G, M = ctx.batch, ctx.gen_length, self.max_lanes
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
            draft=jnp.full((b, G), -1, jnp.int32),
            eos=jnp.full((b,), G, jnp.int32),
            visible=jnp.full((b,), self._first_visible(G), jnp.int32),
            extend=jnp.zeros((b,), bool),
            need_full=jnp.full((b,), self._first_visible(G) == G),
            since_full=zeros, steps=zeros, forks=zeros,
            peak=jnp.ones((b,), jnp.int32), refreshes=zeros, cuts=zeros)

    # -- helpers ----------------------------------------------------------------------
    def _first_visible(self, G: int) -> int:
        """Generated positions the first call encodes and attends (G: a full forward)."""
        if not self.horizon or not self.uses_cache:
            return G
        return min(G, self.block_length + self.horizon)

    def _frontier(self, st: LaneState, G: int):
        """[b] generated positions at and after this are the end-of-text tail."""
        return jnp.minimum(st.eos + 1, G) if self.cascade else jnp.full_like(st.eos, G)

    def _windows(self, st: LaneState, shift: int, G: int):
        """[b, G] masks of the generated columns that the window's and the lookahead's
        queries encode (a target c is queried at c - shift)."""
        B, W = self.block_length, self.lookahead
        j = jnp.arange(G)[None, :]
        win_lo, la_hi = st.win[:, None], st.win[:, None] + B + W
        win_enc = (j >= win_lo - shift) & (j < win_lo + B - shift)
        la_enc = (j >= win_lo + B - shift) & (j < la_hi - shift)
        return win_enc, la_enc

    def _members(self, st: LaneState, G: int, kinds):
        """[b, G, M] whether generated position j lies in slot m's span and m's kind is
        one of `kinds`."""
        j = jnp.arange(G)[None, :, None]
        live = jnp.isin(st.kind, jnp.asarray(kinds))[:, None, :]
        return live & (j >= st.start[:, None, :]) & (j < st.end[:, None, :])

    # -- the schedule -----------------------------------------------------------------
    def key_bound(self, ctx: Context) -> int | None:
        V = self._first_visible(ctx.gen_length)
        return None if V == ctx.gen_length else ctx.prompt_len + V

    def first_plan(self, ctx: Context, canvas, st: LaneState, live) -> Plan | None:
        V = self._first_visible(ctx.gen_length)
        if V == ctx.gen_length:
            return None  # the loop's first call is a full forward
        # A cached call over [0, P + V): the prompt and the first V generated positions
        # are encoded, and attend only to each other. Logits are computed only for the
        # queries a regular plan would read (query index = column here).
        cols = jnp.arange(ctx.prompt_len + V, dtype=jnp.int32)
        read = self.plan(ctx, canvas, st, live).positions
        return Plan(positions=jnp.broadcast_to(cols, (ctx.batch, cols.size)),
                    full=jnp.asarray(False), serve=live,
                    visible=jnp.full((ctx.batch,), ctx.prompt_len + V, jnp.int32),
                    logits_at=jnp.where(read < cols.size, read, cols.size))

    def plan(self, ctx: Context, canvas, st: LaneState, live) -> Plan:
        P, G, T, s = ctx.prompt_len, ctx.gen_length, ctx.length, ctx.shift
        B, W, E = self.block_length, self.lookahead, self.extra_queries
        frontier = self._frontier(st, G)[:, None]
        gen = canvas[:, P:]
        masked = gen == ctx.mask_id
        j = jnp.arange(G)[None, :]

        seen = jnp.minimum(frontier, st.visible[:, None])  # nothing hidden is queried

        def targets(first, n):  # generated targets first .. first + n - 1, as query columns
            t = first[:, None] + jnp.arange(n)[None, :]
            return jnp.where(t < seen, P + t - s, T)

        parts = [targets(st.win, B)]
        if W:
            parts.append(targets(st.win + B, W))
        if E:
            win_enc, la_enc = self._windows(st, s, G)
            dirty = ~masked & ~st.fresh & (j < frontier) & ~win_enc & ~la_enc
            refine = masked & jnp.any(self._members(st, G, (REFINE,)), axis=-1)
            order = (G - j).astype(jnp.float32) / (G + 1)  # earlier first
            score = jnp.where(refine, 2.0 + order, jnp.where(dirty, 1.0 + order, ops.NEG_INF))
            top, idx = jax.lax.top_k(score, min(E, G))
            col = P + idx - jnp.where(top >= 2.0, s, 0)  # a refine target is queried at c - s
            parts.append(jnp.where(jnp.isfinite(top), col, T))
        positions = jnp.concatenate(parts, axis=1).astype(jnp.int32)
        if not self.uses_cache:
            return Plan(positions=positions, full=jnp.asarray(True), serve=live)
        need = live & st.need_full
        full = jnp.any(need)
        visible = None
        if self._first_visible(G) < G:  # a row nearing its horizon is shown everything
            visible = jnp.where(st.extend, T, P + st.visible).astype(jnp.int32)
        return Plan(positions=positions, full=full, serve=jnp.where(full, need, live),
                    visible=visible)

    def update(self, ctx: Context, canvas, st: LaneState, out: CallOutput, key):
        del key
        P, G, T = ctx.prompt_len, ctx.gen_length, ctx.length
        B, M = self.block_length, self.max_lanes
        b = ctx.batch
        rows = jnp.arange(b)[:, None]
        j = jnp.arange(G)[None, :]
        srv = out.serve[:, None]
        t = st.steps[:, None]  # this iteration's row step, per row

        # Predictions scattered onto generated columns.
        x0, conf = ops.greedy_confidence(out.logits)
        x0 = ops.never_the_mask(out.logits, x0, ctx.mask_id)
        tgt = jnp.where((out.targets < T) & (out.targets >= P), out.targets - P, G)
        pred = jnp.zeros((b, G), jnp.int32).at[rows, tgt].set(x0, mode="drop")
        pconf = jnp.zeros((b, G), jnp.float32).at[rows, tgt].set(conf, mode="drop")
        has = jnp.zeros((b, G), bool).at[rows, tgt].set(True, mode="drop") & srv

        gen = canvas[:, P:]
        masked = gen == ctx.mask_id
        frontier = self._frontier(st, G)[:, None]
        lo = st.win[:, None]
        in_win = (j >= lo) & (j < lo + B) & (j < frontier)

        # Window: threshold, draft reuse, and the most confident position, unless a
        # refine lane is still open: then the continuation commits only what it is sure
        # of, and the refine lanes (which force their best after refine_budget) go first.
        member_r = self._members(st, G, (REFINE,))  # [b, G, M]
        refining = jnp.any(member_r & masked[..., None], axis=(1, 2))[:, None]
        cand = masked & in_win & has
        c = jnp.where(cand, pconf, ops.NEG_INF)
        top1 = cand & (j == jnp.argmax(c, axis=-1)[:, None]) & ~refining
        ok = pconf >= self.threshold
        if self.relaxed_threshold < self.threshold:  # LocalLeap's anchors
            by_anchor = ops.near_anchor(cand & ok, self.radius)
            ok = ok | (by_anchor & (pconf >= self.relaxed_threshold))
        if self.lookahead:
            ok = ok | ((st.draft == pred) & (pconf >= min(self.draft_threshold, self.threshold)))
        commit = (cand & ok) | top1

        # Refine lanes: threshold; past their budget, also their most confident position.
        rcand = masked & has & jnp.any(member_r, axis=-1)
        lane_best = jnp.max(jnp.where(member_r & rcand[..., None], pconf[..., None], ops.NEG_INF),
                            axis=1)  # [b, M]
        over = (st.steps[:, None] - st.split) >= self.refine_budget  # [b, M]
        is_best = jnp.any(member_r & over[:, None, :]
                          & (pconf[..., None] >= lane_best[:, None, :]), axis=-1)
        commit = commit | (rcand & ((pconf >= self.threshold) | is_best))
        new = jnp.where(commit, pred, gen)

        # Drafts from the lookahead window.
        if self.lookahead:
            in_la = (j >= lo + B) & (j < lo + B + self.lookahead)
            st = st.replace(draft=jnp.where(in_la & masked & has, pred, st.draft))

        # Cascading termination.
        is_stop = ~(new == ctx.mask_id) & ctx.is_stop(new)
        eos = jnp.minimum(st.eos, jnp.min(jnp.where(is_stop, j, G), axis=-1))
        kind, start, end, death = st.kind, st.start, st.end, st.death
        cuts = st.cuts
        frontier = self._frontier(st.replace(eos=eos), G)[:, None]
        if self.cascade:
            new = jnp.where(j > eos[:, None], ctx.eos_id, new)
            front = frontier
            placed = (kind != FREE) & (kind != TERMINATED)
            gone = placed & (start >= front)
            cut = placed & ~gone & (end > front)
            cuts = cuts + jnp.sum(gone | cut, axis=-1)
            death = jnp.where(gone & (death < 0), t, death)
            kind = jnp.where(gone, TERMINATED, kind)
            end = jnp.where(cut, front, end)

        # The cache: served columns encoded by this call are fresh, changed ones are not.
        enc = jnp.where(out.targets < T, out.targets - ctx.shift - P, G)
        encoded = jnp.zeros((b, G), bool).at[rows, enc].set(True, mode="drop")
        encoded = jnp.where(out.full, True, encoded) & srv
        fresh = (st.fresh | encoded) & (new == gen)

        # Refine lanes with no masks left are done.
        new_masked = new == ctx.mask_id
        member = self._members(st.replace(kind=kind, end=end), G, (REFINE,))
        finished = (kind == REFINE) & ~jnp.any(member & new_masked[..., None], axis=1)
        death = jnp.where(finished, t, death)
        kind = jnp.where(finished, DONE, kind)

        # Fork: the last committed delimiter in the window whose prefix is stable.
        slots = jnp.arange(M)[None, :]
        g = st.gen_slot[:, None]
        gen_live = jnp.take_along_axis(kind, g, axis=1)[:, 0] == GENERATE
        win = st.win
        if self.forking:
            in_win = (j >= lo) & (j < lo + B) & (j < frontier)
            delim = in_win & ~new_masked & jnp.isin(new, jnp.asarray(self.delimiter_ids))
            delim = delim & (j + 1 < frontier)
            masks_upto = jnp.cumsum(in_win & new_masked, axis=-1)  # masks in [win, j]
            length = (j - lo + 1).astype(jnp.float32)
            stable = (masks_upto <= self.refine_window) & (
                1.0 - masks_upto / length >= self.stable_fraction)
            d = jnp.max(jnp.where(delim & stable, j, -1), axis=-1)  # [b]
            free = kind == FREE
            new_slot = jnp.argmax(free, axis=-1)
            fork = out.serve & gen_live & (d >= 0) & jnp.any(free, axis=-1)
            prefix_masks = jnp.take_along_axis(masks_upto, jnp.maximum(d, 0)[:, None], 1)[:, 0]
            at_g = (slots == g) & fork[:, None]
            at_n = (slots == new_slot[:, None]) & fork[:, None]
            kind = jnp.where(at_g, jnp.where(prefix_masks > 0, REFINE, DONE)[:, None], kind)
            death = jnp.where(at_g & (prefix_masks == 0)[:, None], t, death)
            end = jnp.where(at_g, (d + 1)[:, None], end)
            split = jnp.where(at_g, t, st.split)
            kind = jnp.where(at_n, GENERATE, kind)
            start = jnp.where(at_n, (d + 1)[:, None], start)
            parent = jnp.where(at_n, g, st.parent)
            birth = jnp.where(at_n, t, st.birth)
            win = jnp.where(fork, d + 1, win)
            gen_slot = jnp.where(fork, new_slot, st.gen_slot).astype(jnp.int32)
            forks = st.forks + fork
        else:
            parent, birth, gen_slot, forks = st.parent, st.birth, st.gen_slot, st.forks
            split = st.split
            fork = jnp.zeros((b,), bool)

        # Advance: a window with no masks left moves on by B.
        g = gen_slot[:, None]
        gen_live = jnp.take_along_axis(kind, g, axis=1)[:, 0] == GENERATE
        w = win[:, None]
        win_masks = jnp.any((j >= w) & (j < w + B) & (j < frontier) & new_masked, axis=-1)
        advance = out.serve & gen_live & ~fork & ~win_masks
        win = jnp.where(advance, win + B, win)
        front = frontier[:, 0]
        # The generate lane is done when nothing from its window on is masked.
        rest = jnp.any((j >= win[:, None]) & (j < frontier) & new_masked, axis=-1)
        gen_done = gen_live & ((win >= front) | ~rest)
        at_gen = slots == g
        kind = jnp.where(at_gen & gen_done[:, None], DONE, kind)
        death = jnp.where(at_gen & gen_done[:, None], t, death)
        end = jnp.where(at_gen & (kind == GENERATE),
                        jnp.minimum(win + B, front)[:, None], end)
        end = jnp.where(at_gen & gen_done[:, None], front[:, None], end)

        active = jnp.sum((kind == GENERATE) | (kind == REFINE), axis=-1)
        since = jnp.where(out.serve & out.full, 0, st.since_full + out.serve)
        need = jnp.zeros((b,), bool)
        if self.refresh_every:
            need = need | (since >= self.refresh_every)
        if self.refresh_at_advance:
            need = need | (advance & ~gen_done)
        shown = out.serve & out.full & st.extend
        visible = jnp.where(shown, G, st.visible)
        extend = st.extend & ~shown
        if self._first_visible(G) < G:  # the window nears the horizon: show everything
            near = (win + B + self.horizon // 2 > visible) & (visible < G) & ~gen_done
            extend = jnp.where(out.serve, extend | near, extend)
            need = need | near
        canvas = canvas.at[:, P:].set(new)
        return canvas, st.replace(
            win=win.astype(jnp.int32), gen_slot=gen_slot, kind=kind.astype(jnp.int32),
            start=start.astype(jnp.int32), end=end.astype(jnp.int32),
            parent=parent.astype(jnp.int32), birth=birth.astype(jnp.int32),
            death=death.astype(jnp.int32), split=split.astype(jnp.int32), fresh=fresh,
            visible=visible.astype(jnp.int32), extend=extend, eos=eos.astype(jnp.int32),
            need_full=jnp.where(out.serve, need, st.need_full),
            since_full=since.astype(jnp.int32), steps=st.steps + out.serve,
            forks=forks.astype(jnp.int32), peak=jnp.maximum(st.peak, active).astype(jnp.int32),
            refreshes=(st.refreshes + (out.serve & out.full)).astype(jnp.int32),
            cuts=cuts.astype(jnp.int32))

    def done(self, ctx: Context, canvas, st: LaneState):
        return ~jnp.any(canvas[:, ctx.prompt_len:] == ctx.mask_id, axis=-1)

    def summary(self, ctx: Context, st: LaneState) -> dict:
        return {"lane_kind": st.kind, "lane_start": st.start, "lane_end": st.end,
                "lane_parent": st.parent, "lane_birth": st.birth, "lane_death": st.death,
                "lane_split": st.split,
                "forks": st.forks, "peak_lanes": st.peak, "refreshes": st.refreshes,
                "cascade_cuts": st.cuts}
