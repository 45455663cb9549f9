"""LocalLeap (arXiv 2510.07081): threshold decoding that relaxes the threshold next to
confident anchors.

In the current block: the most confident masked position always commits; anchors are
masked positions with confidence >= threshold; within `radius` of any anchor a masked
position commits at confidence >= relaxed_threshold, elsewhere at >= threshold. With no
anchor this is Fast-dLLM threshold decoding.

`threshold` and `relaxed_threshold` are traced options (schedule.py: `traced_options`),
kept per row in the block state from the row's start.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.block import BlockSchedule
from asynclane_jax.decoding.ops import check_threshold, greedy_confidence
from asynclane_jax.decoding.schedule import SamplerError


@dataclasses.dataclass(frozen=True)
class LocalLeapSchedule(BlockSchedule):
    """LocalLeap: a relaxed threshold next to confident anchors.

    Attributes:
      threshold: confidence at which a masked position commits (and becomes an anchor).
      relaxed_threshold: confidence at which a position within `radius` of an anchor
        commits; at most threshold.
      radius: neighbourhood of an anchor, in positions.
    """

    name = "localleap"
    shift_commits_block_start = True
    traced_options = ("threshold", "relaxed_threshold")
    threshold: float = 0.9
    relaxed_threshold: float = 0.75
    radius: int = 4

    def __post_init__(self):
        super().__post_init__()
        check_threshold(self.name, self.threshold)
        check_threshold(self.name, self.relaxed_threshold, "relaxed_threshold")
        if self.relaxed_threshold > self.threshold:
            raise SamplerError(
                f"localleap: relaxed_threshold={self.relaxed_threshold} must not exceed "
                f"threshold={self.threshold}")
        if self.radius < 0:
            raise SamplerError(f"localleap: radius={self.radius} must be >= 0")

    def select(self, logits, masked, step_in_block, key, pstate):
        x0, conf = greedy_confidence(logits)
        conf = jnp.where(masked, conf, ops.NEG_INF)
        first = (ops.rank_of(conf) == 0) & masked
        anchor = masked & (conf >= pstate["threshold"][:, None])  # [b, B]
        in_hood = ops.near_anchor(anchor, self.radius)  # [b, B]
        relaxed = pstate["relaxed_threshold"][:, None]
        commit = first | anchor | (masked & in_hood & (conf >= relaxed))
        return commit, x0, pstate
