"""The lane tree AsyncLane returns with every result.

Lanes live in fixed-shape slots, one set per row; a slot is used by at most one lane for
the whole decode, so the final slots *are* the lane tree. Spans are generated-region
indices [start, end) (end exclusive).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asynclane_jax.decoding.stats import DecodeStats

# Slot kinds, by code.
FREE, GENERATE, REFINE, DONE, TERMINATED = range(5)
LANE_KINDS = ("free", "generate", "refine", "done", "terminated")


@dataclasses.dataclass
class LaneStats(DecodeStats):
    """DecodeStats plus the lane tree and AsyncLane's counters.

    Attributes:
      lane_kind: [b, M] slot kind codes (LANE_KINDS: free, generate, refine, done,
        terminated); a row's generate lane is slot 0 at first, and each fork takes the
        next free slot.
      lane_start, lane_end: [b, M] the lane's span of generated positions [start, end).
      lane_parent: [b, M] the slot the lane was forked from (-1: the root).
      lane_birth, lane_death: [b, M] the row iteration at which the lane was created and
        at which it finished or was terminated (-1: never).
      lane_split: [b, M] the row iteration at which a generate lane forked and its span
        became a refine lane (-1: never).
      forks: [b] forks per row; peak_lanes: [b] most lanes active at once;
      refreshes: [b] full forwards that served the row;
      cascade_cuts: [b] lanes terminated or cut by an end-of-text;
      idle_steps: [b] iterations that served the row and committed no position.
    """

    lane_kind: np.ndarray = None
    lane_start: np.ndarray = None
    lane_end: np.ndarray = None
    lane_parent: np.ndarray = None
    lane_birth: np.ndarray = None
    lane_death: np.ndarray = None
    lane_split: np.ndarray = None
    forks: np.ndarray = None
    peak_lanes: np.ndarray = None
    refreshes: np.ndarray = None
    cascade_cuts: np.ndarray = None
    idle_steps: np.ndarray = None

    def lane_tree(self, row: int = 0) -> list[dict]:
        """The lanes of one row in slot order (free slots left out): dicts with slot,
        kind, start, end, parent, birth, death, split (-1 where not recorded)."""
        out = []
        for s in range(self.lane_kind.shape[1]):
            kind = int(self.lane_kind[row, s])
            if kind == FREE:
                continue
            out.append({"slot": s, "kind": LANE_KINDS[kind],
                        "start": int(self.lane_start[row, s]),
                        "end": int(self.lane_end[row, s]),
                        "parent": int(self.lane_parent[row, s]),
                        "birth": int(self.lane_birth[row, s]),
                        "death": int(self.lane_death[row, s]),
                        "split": (-1 if self.lane_split is None
                                  else int(self.lane_split[row, s]))})
        return out
