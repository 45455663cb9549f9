"""Early-Bird decoding, EB-Decode (arXiv 2609.16450): a learned block size and a learned
commit rule, as one schedule (sampler "eb").

By default (cache=none) every call is a full forward over the whole canvas (no cache, the
paper's G=512, B=32 setting); the schedule reads the logits of every generated position.
cache=dual adds Fast-dLLM's dual K/V cache (below). Per row:

  1. Block (LBS router, eb_routers.py). When the row has no current block, or its
     block has no masks left, the LBS router scores every generated position from this
     call's logits (normalised entropy and top-1 token; a committed position enters as
     entropy 0 and its token): p = sigmoid(O). Candidates are the masked positions with
     p > lbs_threshold (0.5) whose top-1 is not end-of-text. Walking the masked
     positions from the leftmost candidate, the block runs to the last candidate before
     the first gap of more than g_max (5) masked non-candidates; committed positions
     neither count as gap nor break the run. A block of fewer than l_min (8) masked
     positions falls back to the first fallback_length (32) masked positions. The
     block is chosen from this call's logits and decoded in the same call (no call is
     spent on choosing), then kept until it has no masks left.
  2. Commit (LPS router). Over the block's masked positions (attention restricted to
     them) the LPS router reads five features (top-1 probability, normalised entropy,
     top-1 minus top-2 probability, the block's masked share, relative place in the
     block) and gives p_psi. A position commits its top-1 when its probability is at
     least `threshold` (0.9) or p_psi > tau_psi (stored with the routers: the smallest
     tau_psi at which at most max_fpr, 0.01, of a validation split's negatives pass;
     testbed/routers.py, `choose_tau`); when none does, the most confident
     one commits. p_psi decides only positions below the threshold, so the router is
     not run in a call where no block position is below it.
  3. The row is done when no generated position is masked.

Router weights as operands of the compiled program. The schedule needs no model
parameters: the LBS router reads the top-1 token through the frozen base embedding and
a Linear, and the two are folded into one [V, d_feat] table stored with the router.
`bind` loads the weights (0.38M numbers at the paper's shape, 55k for the testbed's
smaller LBS) into a field outside the schedule's hash (`weights`), and records their
router configs (hashed: they fix the modules' structure) and digest (reported, not
hashed). `operands()` hands the arrays to the driver, which passes them into the
program as arguments; `lbs_probs` / `lps_probs` rebuild the routers around them inside
the trace. Routers of equal configs share one compiled program whatever their values.

Where the weights come from. `routers=FOLDER` (a model folder holding routers/, or the
routers folder itself); by default the routers shipped beside the shipped model whose
config is this model's (dtypes aside): `bind` gets the model config, not the folder,
and no shipped model shares another's config, so `generate(model, prompts,
sampler="eb")` needs no extra argument on tiny-llada and tiny-dream. A model of the
same config but other weights would need its own routers (pass routers=).

Ablation switches: lbs=false never runs the LBS router (every block is the fallback:
blocks of fallback_length consecutive masked positions, i.e. threshold decoding without
a cache); lps=false never runs the LPS router (commit at `threshold`, else the top-1).
The router traces of testbed/routers.py are decoded with these switches, through the
driver's `tap` and `decide`.

Dual cache (cache=dual; not in the paper, which has no cache). A row that needs a new
block gets a refresh: a full forward whose K/V become the row's cache and whose logits
both choose the block (the LBS router reads every generated position, as without a
cache) and decode that step, so no call is spent on choosing. While the block has masks,
cached calls query only the block's positions (each member column minus the logit
shift, so a Dream model predicts every member too) against the cache of everything
else, as Fast-dLLM's dual cache does; the LPS commit rule is unchanged. Refreshes are
per row (block.py's `row_refresh`): a full forward serves the rows that need a block as
soon as one does (computed over those rows alone, `compact_full`), the others wait that
iteration, so every row decodes as it would alone. Deviation from the paper: a cached
call's query width is static while LBS blocks have any length, so every block (the
fallback included) is cut to its first `max_block` masked positions (`row_cut` counts
the blocks cut); the rest stays masked for later blocks. With lbs=false lps=false and
max_block >= fallback_length this is Fast-dLLM's dual-cache threshold decoding with
blocks of fallback_length on a LLaDA model (tests/decoding/test_early_bird_cache.py); on a
logit-shifted (Dream) model it is not, by design: Fast-dLLM's Dream code commits only
the block's first column at the refresh, because its cached window does not predict it.

Query width: a cached call queries max_block columns (the block's members, then unused
slots), while a refresh reads all G generated positions' logits for the LBS
(`Plan.full_read`: a full forward encodes every column anyway, and reads those), so a
cached call costs max_block queries, not G.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from asynclane_jax import checkpoint
from asynclane_jax.decoding import ops
from asynclane_jax.decoding.block import ROW_REFRESH_MAX_ROWS
from asynclane_jax.decoding.eb_routers import (
    LBSRouter,
    LPSRouter,
    RouterError,
    RouterWeights,
    build_module,
    has_routers,
    lbs_inputs,
    load_routers,
    lps_features,
)
from asynclane_jax.decoding.ops import greedy_confidence, never_the_mask
from asynclane_jax.decoding.schedule import CallOutput, Context, Plan, SamplerError, Schedule
from asynclane_jax.decoding.stats import DecodeStats

# cache=none: the paper's; dual: Fast-dLLM's dual cache (module docstring).
CACHE_MODES = ("none", "dual")


@dataclasses.dataclass
class EarlyBirdStats(DecodeStats):
    """DecodeStats plus, per row: row_blocks (blocks chosen), row_fallbacks (blocks
    that fell back to the first fallback_length masked positions) and row_cut (blocks
    cut to their first max_block masked positions; cache=dual only, else 0)."""

    row_blocks: np.ndarray | None = None
    row_fallbacks: np.ndarray | None = None
    row_cut: np.ndarray | None = None


@struct.dataclass
class EarlyBirdState:
    block: jax.Array  # [b, G] bool: members of the current block (generated positions)
    size: jax.Array  # [b] int32 members when the block was chosen (0: none yet)
    index: jax.Array  # [b, G] int32 each member's index in its block, by position
    blocks: jax.Array  # [b] int32 blocks chosen so far
    fallbacks: jax.Array  # [b] int32 of which fell back
    cut: jax.Array  # [b] int32 of which were cut to max_block (cache=dual)


def choose_block(masked, candidate, *, g_max: int, l_min: int, fallback_length: int):
    """The LBS block of each row.

    Args:
      masked: [b, G] bool, masked generated positions.
      candidate: [b, G] bool, a subset of masked: the router's candidates.
      g_max: largest gap (masked non-candidates between two candidates) inside a block.
      l_min: a block of fewer masked positions falls back.
      fallback_length: the fallback block is the first this many masked positions.
    Returns:
      (block [b, G] bool, a subset of masked; fell_back [b] bool).
    """
    G = masked.shape[-1]
    pos = jnp.arange(G)[None, :]
    rank = jnp.cumsum(masked, axis=-1) - 1  # index among the row's masked positions
    cand_rank = jnp.where(candidate, rank, -1)
    before = jnp.concatenate([jnp.full_like(cand_rank[:, :1], -1),
                              jax.lax.cummax(cand_rank, axis=1)[:, :-1]], axis=1)
    gap = rank - before - 1  # masked non-candidates since the previous candidate
    breaks = candidate & (before >= 0) & (gap > g_max)
    first_break = jnp.min(jnp.where(breaks, pos, G), axis=-1, keepdims=True)
    run = candidate & (pos < first_break)
    first = jnp.min(jnp.where(run, pos, G), axis=-1, keepdims=True)
    last = jnp.max(jnp.where(run, pos, -1), axis=-1, keepdims=True)
    block = masked & (pos >= first) & (pos <= last)
    fell_back = jnp.sum(block, axis=-1) < l_min
    fallback = masked & (rank < fallback_length)
    return jnp.where(fell_back[:, None], fallback, block), fell_back


def lps_commit(block_masked, conf, p_psi, *, threshold: float, tau_psi: float):
    """The combined commit rule: conf >= threshold or p_psi > tau_psi; none -> top-1.

    Args:
      block_masked: [b, n] bool, the block's masked positions.
      conf: [b, n] top-1 probability; p_psi: [b, n] the LPS router's probability.
    Returns:
      [b, n] bool, a subset of block_masked, non-empty where block_masked is.
    """
    commit = block_masked & ((conf >= threshold) | (p_psi > tau_psi))
    none = ~jnp.any(commit, axis=-1, keepdims=True)
    top1 = ops.topk_mask(jnp.where(block_masked, conf, ops.NEG_INF),
                         jnp.ones(conf.shape[:1], jnp.int32))
    return commit | (none & top1)


def _same_architecture(a, b) -> bool:  # dtypes and the layer layout aside
    same = dict(dtype="float32", param_dtype="float32", scan_layers=False)
    return dataclasses.replace(a, **same) == dataclasses.replace(b, **same)


def default_router_folder(cfg) -> pathlib.Path:
    """The routers of the shipped model whose config is cfg (dtypes aside)."""
    matches, with_routers = [], []
    for name, folder in checkpoint.shipped_registry().items():
        try:
            shipped, _ = checkpoint.read_config(folder)
        except (checkpoint.CheckpointError, TypeError, ValueError):
            continue
        if _same_architecture(shipped, cfg):
            matches.append(name)
            if has_routers(folder):
                with_routers.append(folder)
    if len(with_routers) == 1:
        return with_routers[0]
    if len(with_routers) > 1:
        raise SamplerError(f"eb: several shipped models have this model's config "
                           f"({matches}); pass routers=FOLDER")
    have = [n for n, f in checkpoint.shipped_registry().items() if has_routers(f)]
    raise SamplerError(
        "eb: no router weights for this model (shipped models with routers: "
        f"{have or 'none'}); train them (experiments/train_eb.py) and pass routers=FOLDER, "
        "or decode without them: lbs=false lps=false")


@dataclasses.dataclass(frozen=True)
class EarlyBirdSchedule(Schedule):
    """EB-Decode: LBS-chosen variable-length blocks, LPS-assisted commits.

    cache=none (the default) is the paper's setting: every call a full forward. cache=dual
    refreshes a row's K/V with a full forward when it needs a block (that call's logits
    choose the block and decode that step), then queries only the block's columns in
    cached calls; blocks are cut to their first max_block masked positions (the paper's
    are uncapped: it has no cache). See the module docstring.

    Attributes:
      g_max: largest run of masked non-candidates inside an LBS block.
      l_min: an LBS block of fewer masked positions falls back.
      fallback_length: the fallback block: the first this many masked positions.
      threshold: a block position commits when its top-1 probability is at least this.
      lbs_threshold: LBS candidates have p above this.
      tau_psi: a block position also commits when the LPS router's p_psi exceeds this
        (default: the value stored with the routers).
      routers: folder of the router weights (a model folder with routers/, or that
        folder); default: the shipped routers of this model.
      lbs: run the LBS router (false: every block is the fallback).
      lps: run the LPS router (false: commit at threshold, else the top-1).
      cache: none (every call a full forward, as in the paper) | dual (a full forward
        when a row needs a block, then cached calls that query only the block against
        the cache of everything else).
      max_block: with cache=dual, a block (LBS or fallback) is cut to its first this many
        masked positions, the cached calls' query width; ignored with cache=none.
    """

    name = "eb"
    stats_type = EarlyBirdStats
    structural = ("gen_length", "router_configs", "router_digest", "weights")
    g_max: int = 5
    l_min: int = 8
    fallback_length: int = 32
    threshold: float = 0.9
    lbs_threshold: float = 0.5
    tau_psi: float | None = None
    # Where the weights came from; the program reads them as operands, so the folder is
    # not part of the schedule's hash.
    routers: str | None = dataclasses.field(default=None, compare=False)
    lbs: bool = True
    lps: bool = True
    cache: str = "none"
    max_block: int = 64
    # Set by `bind` / `with_weights`: the (LBSConfig, LPSConfig) of the weights (hashed:
    # they fix the routers' structure in the program), the digest naming the weights
    # (reported), and the weights (handed to the program by `operands`).
    router_configs: tuple | None = None
    router_digest: str | None = dataclasses.field(default=None, compare=False)
    weights: RouterWeights | None = dataclasses.field(default=None, compare=False,
                                                      repr=False)

    def __post_init__(self):
        super().__post_init__()
        for field in ("g_max", "l_min"):
            if getattr(self, field) < 0:
                raise SamplerError(f"eb: {field}={getattr(self, field)} must be >= 0")
        if self.fallback_length < 1:
            raise SamplerError(f"eb: fallback_length={self.fallback_length} must be >= 1")
        for field in ("threshold", "lbs_threshold"):
            if not 0 < getattr(self, field) <= 1:
                raise SamplerError(f"eb: {field}={getattr(self, field)} must be in (0, 1]")
        if self.tau_psi is not None and not 0 <= self.tau_psi <= 1:
            raise SamplerError(f"eb: tau_psi={self.tau_psi} must be in [0, 1]")
        if self.cache not in CACHE_MODES:
            raise SamplerError(f"eb: cache={self.cache!r} must be one of {CACHE_MODES}")
        if isinstance(self.max_block, bool) or not isinstance(self.max_block, int) \
                or self.max_block < 1:
            raise SamplerError(f"eb: max_block={self.max_block!r} must be an integer >= 1")
        for field in ("lbs", "lps"):
            if getattr(self, field) not in (True, False):
                raise SamplerError(f"eb: {field}={getattr(self, field)!r} must be true or "
                                   "false")

    @property
    def uses_cache(self) -> bool:
        return self.cache == "dual"

    @property
    def compact_full(self) -> bool:  # Schedule.compact_full, per instance
        # The update commits, and changes state, only in served rows, and reads nothing
        # of a row it does not serve; a refresh serving few rows is computed over those.
        return self.cache == "dual"

    @property
    def width(self) -> int:
        """The most members a block may have: max_block with cache=dual, else G."""
        return min(self.max_block, self.gen_length) if self.uses_cache else self.gen_length

    def query_size(self) -> int:
        """Q of every call: G without a cache (every call a full forward reading every
        generated position); max_block with cache=dual (a cached call queries the
        block; a refresh reads all G through `Plan.full_read`)."""
        return self.width

    @property
    def needs_routers(self) -> bool:
        return self.lbs or self.lps

    def bind(self, tokenizer, cfg) -> EarlyBirdSchedule:
        del tokenizer
        if not self.needs_routers or self.weights is not None:
            return self
        folder = (pathlib.Path(self.routers).expanduser().absolute() if self.routers
                  else default_router_folder(cfg))
        try:
            weights = load_routers(folder)
        except RouterError as e:
            raise SamplerError(f"eb: {e}") from None
        lc = weights.lbs_config
        if (lc.vocab_size, lc.d_base) != (cfg.vocab_size, cfg.d_model):
            raise SamplerError(
                f"eb: the routers in {folder} were trained for a model of vocabulary "
                f"{lc.vocab_size} and width {lc.d_base}, not {cfg.vocab_size} and "
                f"{cfg.d_model}")
        if self.gen_length > lc.max_len:
            raise SamplerError(f"eb: gen_length={self.gen_length} exceeds the LBS "
                               f"router's {lc.max_len} positions")
        tau = self.tau_psi if self.tau_psi is not None else weights.meta.get("tau_psi")
        if tau is None:
            raise SamplerError(f"eb: the routers in {folder} store no tau_psi; pass tau_psi=")
        return dataclasses.replace(self.with_weights(weights), routers=str(folder),
                                   tau_psi=float(tau))

    def with_weights(self, weights: RouterWeights) -> EarlyBirdSchedule:
        """The schedule holding these router weights (either router may be absent
        when the schedule does not run it)."""
        for run, arrays, which in ((self.lbs, weights.lbs, "LBS"),
                                   (self.lps, weights.lps, "LPS")):
            if run and arrays is None:
                raise SamplerError(f"eb: the router weights {weights.digest} have no "
                                   f"{which} router, and {which.lower()}=true runs it")
        return dataclasses.replace(self, weights=weights, router_digest=weights.digest,
                                   router_configs=(weights.lbs_config, weights.lps_config))

    def _weights(self) -> RouterWeights:
        if self.weights is None:
            raise SamplerError("eb: the schedule is not bound to its routers (generate "
                               "binds it: schedule.bind(tokenizer, cfg))")
        return self.weights

    def operands(self):
        """{"lbs": ..., "lps": ...}: the flat arrays of the routers this schedule runs."""
        if not self.needs_routers:
            return None
        w = self._weights()
        return {name: arrays for name, run, arrays in (("lbs", self.lbs, w.lbs),
                                                        ("lps", self.lps, w.lps)) if run}

    # -- the routers (tests replace these with hand-made probabilities) -----------------
    def lbs_probs(self, operands, entropy, top1):
        """[b, G] p = sigmoid(O) of the LBS router (operands: `ctx.operands`)."""
        router = build_module(LBSRouter, self.router_configs[0], operands["lbs"])
        return jax.nn.sigmoid(router(entropy, top1))

    def lps_probs(self, operands, features, block_masked):
        """[b, G] p_psi of the LPS router over the block's masked positions."""
        router = build_module(LPSRouter, self.router_configs[1], operands["lps"])
        return jax.nn.sigmoid(router(features, block_masked))

    # -- what the driver asks -------------------------------------------------------------
    def max_iterations(self) -> int:
        G = self.gen_length
        if not self.uses_cache:
            return G + 2  # every call commits at least one position per row
        # Every served row commits at least one position per call. A cached call serves
        # every live row (at most G of them); a refresh serves at least one row that
        # starts a block (at most G blocks per row, ROW_REFRESH_MAX_ROWS rows).
        return G * (ROW_REFRESH_MAX_ROWS + 1) + 2

    def init(self, ctx: Context) -> EarlyBirdState:
        b, G = ctx.batch, self.gen_length
        if self.uses_cache and b > ROW_REFRESH_MAX_ROWS:
            raise SamplerError(f"eb: cache=dual decodes at most {ROW_REFRESH_MAX_ROWS} "
                               f"rows at once, not {b}")
        zeros = jnp.zeros((b,), jnp.int32)
        return EarlyBirdState(block=jnp.zeros((b, G), bool), size=zeros,
                              index=jnp.zeros((b, G), jnp.int32), blocks=zeros,
                              fallbacks=zeros, cut=zeros)

    def _columns(self, ctx: Context):
        cols = ctx.prompt_len + jnp.arange(self.gen_length, dtype=jnp.int32)
        return jnp.broadcast_to(cols, (ctx.batch, self.gen_length))

    def _block_queries(self, ctx: Context, block):
        """[b, width] the columns a cached call queries: each member of the row's block
        (minus the shift, so the member is predicted), in position order, then T (a
        block has at most `width` members)."""
        W = self.width
        order = jnp.argsort((~block).astype(jnp.int32), axis=-1, stable=True)[:, :W]
        members = jnp.sum(block, axis=-1, keepdims=True)
        cols = ctx.prompt_len + order.astype(jnp.int32) - ctx.shift
        return jnp.where(jnp.arange(W)[None, :] < members, cols, ctx.length).astype(jnp.int32)

    def plan(self, ctx: Context, canvas, state, live) -> Plan:
        # Every generated column is predicted (a logit-shifted model: one column earlier).
        full_q = self._columns(ctx) - ctx.shift
        if not self.uses_cache:
            return Plan(positions=full_q, full=jnp.asarray(True), serve=live)
        # Dual cache: a row whose block has no masks left needs a refresh (a full forward
        # that also chooses its next block); one is made as soon as any row needs it,
        # serving those rows (the others wait). Else a cached call queries the blocks.
        gen = canvas[:, ctx.prompt_len:]
        need = live & ~jnp.any(state.block & (gen == ctx.mask_id), axis=-1)
        refresh = jnp.any(need)
        return Plan(positions=self._block_queries(ctx, state.block), full=refresh,
                    serve=jnp.where(refresh, need, live), full_read=full_q)

    def decide(self, ctx: Context, canvas, state: EarlyBirdState, out: CallOutput, key):
        """`update`, plus what the routers read (for decode traces).

        Args:
          as `update`.
        Returns:
          (canvas, state, info): info holds [b, G] arrays logits ([b, G, V]), x0, conf,
          masked, lbs_entropy, lbs_top1, block_masked (the block's masked positions this
          call decided on), lps_features ([b, G, 5]), commit.
        """
        del key
        P = ctx.prompt_len
        logits, has = out.at(self._columns(ctx))
        gen = canvas[:, P:]
        masked = (gen == ctx.mask_id) & has & out.serve[:, None]
        x0, conf = greedy_confidence(logits)
        x0 = never_the_mask(logits, x0, ctx.mask_id)
        entropy, top1 = lbs_inputs(logits, gen, ctx.mask_id)

        need = out.serve & ~jnp.any(state.block & masked, axis=-1)
        if self.lbs:
            # Only when some row starts a block; the block is kept until resolved.
            p = jax.lax.cond(jnp.any(need),
                             lambda: self.lbs_probs(ctx.operands, entropy, top1),
                             lambda: jnp.zeros(masked.shape, jnp.float32))
            candidate = masked & (p > self.lbs_threshold) & ~ctx.is_stop(x0)
        else:
            candidate = jnp.zeros_like(masked)
        new_block, fell_back = choose_block(masked, candidate, g_max=self.g_max,
                                            l_min=self.l_min,
                                            fallback_length=self.fallback_length)
        cut = jnp.zeros_like(fell_back)
        if self.uses_cache:  # the cached calls' query width: the first max_block members
            cut = jnp.sum(new_block, axis=-1) > self.width
            new_block = new_block & (jnp.cumsum(new_block, axis=-1) <= self.width)
        block = jnp.where(need[:, None], new_block, state.block)
        size = jnp.where(need, jnp.sum(new_block, axis=-1), state.size).astype(jnp.int32)
        index = jnp.where(need[:, None], jnp.cumsum(new_block, axis=-1) - 1,
                          state.index).astype(jnp.int32)

        block_masked = block & masked
        features = lps_features(logits, block_masked, size, index)
        if self.lps:
            # p_psi decides only block positions below the threshold: when no row has
            # one, the router's answer cannot change the commit and it is not run.
            p_psi = jax.lax.cond(jnp.any(block_masked & (conf < self.threshold)),
                                 lambda: self.lps_probs(ctx.operands, features, block_masked),
                                 lambda: jnp.zeros(masked.shape, jnp.float32))
            tau = self.tau_psi if self.tau_psi is not None else math.inf
        else:
            p_psi, tau = jnp.zeros(masked.shape, jnp.float32), math.inf
        commit = lps_commit(block_masked, conf, p_psi, threshold=self.threshold,
                            tau_psi=tau)
        canvas = canvas.at[:, P:].set(jnp.where(commit, x0, gen))
        state = EarlyBirdState(block=block, size=size, index=index,
                               blocks=state.blocks + need,
                               fallbacks=state.fallbacks + (need & fell_back),
                               cut=state.cut + (need & cut))
        info = {"logits": logits, "x0": x0, "conf": conf, "masked": masked,
                "lbs_entropy": entropy, "lbs_top1": top1, "block_masked": block_masked,
                "lps_features": features, "commit": commit}
        return canvas, state, info

    def update(self, ctx: Context, canvas, state, out: CallOutput, key):
        canvas, state, _ = self.decide(ctx, canvas, state, out, key)
        return canvas, state

    def done(self, ctx: Context, canvas, state):
        return ~jnp.any(canvas[:, ctx.prompt_len:] == ctx.mask_id, axis=-1)

    def summary(self, ctx: Context, state: EarlyBirdState) -> dict:
        return {"row_blocks": np.asarray(state.blocks),
                "row_fallbacks": np.asarray(state.fallbacks),
                "row_cut": np.asarray(state.cut)}
