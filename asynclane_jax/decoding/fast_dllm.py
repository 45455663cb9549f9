"""Fast-dLLM (arXiv 2505.22618): confidence-aware parallel decoding, with prefix or dual
K/V caching chosen by the policy's `cache` field (the loop implements the caches).

Threshold rule: commit every masked position of the block whose confidence is at least
`threshold`, and always the most confident one. Factor rule: with the N masked
confidences sorted c(1) >= c(2) >= ..., commit the leading run that satisfies
c(n) >= 1 - factor / (n + 1) (the first always; all N when only c(N) fails, as the
public code does). `steps` does not exist: a block loops until it has no masks.

`cache="none"` is block-wise threshold decoding with a full forward per step, on LLaDA
and Dream alike. That is Fast-dLLM's LLaDA no-cache code; its only no-cache Dream code is
blockless threshold decoding over the whole generation, which this sampler does not
reproduce exactly (the nearest setting is `block_length=gen_length`), so on Dream
`fast-dllm` with `cache="none"` is our block-wise variant, not a published one.

`threshold` is a traced option (schedule.py: `traced_options`): each row's value is an
argument of the compiled program, kept in the row's block state from its start, so
rows at different thresholds decode in one program.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.block import BlockSchedule
from asynclane_jax.decoding.ops import check_threshold, greedy_confidence
from asynclane_jax.decoding.schedule import SamplerError


@dataclasses.dataclass(frozen=True)
class FastDllmSchedule(BlockSchedule):
    """Fast-dLLM threshold or factor decoding.

    Attributes:
      threshold: confidence threshold (used when factor is None).
      factor: the factor rule's f; when set, replaces the threshold rule.
    """

    name = "fast-dllm"
    shift_commits_block_start = True
    traced_options = ("threshold",)
    threshold: float = 0.9
    factor: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_threshold(self.name, self.threshold)
        if self.factor is not None and not self.factor > 0:
            raise SamplerError(f"fast-dllm: factor={self.factor} must be positive")

    def select(self, logits, masked, step_in_block, key, pstate):
        x0, conf = greedy_confidence(logits)
        conf = jnp.where(masked, conf, ops.NEG_INF)
        rank = ops.rank_of(conf)
        first = (rank == 0) & masked
        if self.factor is None:
            commit = first | (masked & (conf >= pstate["threshold"][:, None]))
        else:
            # Threshold for the n-th most confident (n = rank + 1): 1 - f / (n + 1).
            th = 1.0 - self.factor / (rank.astype(jnp.float32) + 2.0)
            passes = (conf >= th) | (rank == 0)
            # Leading run in rank order: k = the lowest failing rank. As in the public
            # get_transfer_index_dynamic, when no rank fails or only the last one (of
            # the N masked) does, all N commit.
            n = jnp.sum(masked, axis=-1)
            fail_rank = jnp.min(jnp.where(masked & ~passes, rank, conf.shape[-1]), axis=-1)
            k = jnp.where(fail_rank >= n - 1, n, fail_rank)
            commit = masked & (rank < k[:, None])
        return commit, x0, pstate
