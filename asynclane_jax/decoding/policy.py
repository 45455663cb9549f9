"""The sampler-policy interface of the decode loop.

A policy is a frozen, hashable dataclass: its fields are static settings (they are part
of the compiled program). The one driver in loop.py asks it:
  - how long a block is and which cache mode it uses (which positions a call queries);
  - `select`: given the logits of the row's current block, what to commit;
  - `max_iterations`: the loop's step cap (hitting it is a bug signal, reported).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

CACHE_MODES = ("none", "prefix", "dual")


class SamplerError(ValueError):
    """Bad sampler name or options."""


@dataclasses.dataclass(frozen=True)
class BlockPolicy:
    """Semi-autoregressive block decoding: a row works on one block at a time and moves
    to the next once the block has no masks left.

    Attributes:
      gen_length: G, generated tokens per row.
      block_length: B; G % B == 0.
      cache: "none" (every call a full forward), "prefix" (refresh at block start, then
        query [block start, T) against cached K/V of the prefix) or "dual" (refresh at
        block start, then query only the block against cached K/V of everything else).
    """

    name: ClassVar[str] = "block"
    # With a logit-shifted model (Dream), the block-start step commits exactly the
    # block's first column by argmax (Fast-dLLM's Dream block decoding); see loop.py.
    shift_commits_block_start: ClassVar[bool] = False
    gen_length: int
    block_length: int
    cache: str = "none"

    def __post_init__(self):
        if self.gen_length <= 0:
            raise SamplerError(f"gen_length={self.gen_length}: must be positive")
        if self.block_length <= 0:
            raise SamplerError(f"block_length={self.block_length}: must be positive")
        if self.gen_length % self.block_length:
            raise SamplerError(
                f"gen_length={self.gen_length} is not a multiple of "
                f"block_length={self.block_length}")
        if self.cache not in CACHE_MODES:
            raise SamplerError(f"cache={self.cache!r}: expected one of {CACHE_MODES}")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    def max_iterations(self) -> int:
        # Every served iteration commits at least one token; with a cache a row may also
        # wait while its batch mates finish their blocks (at most G iterations in all).
        return 2 * self.gen_length + self.num_blocks + 2

    def init_state(self, batch: int) -> Any:
        del batch
        return ()

    def select(self, logits, masked, step_in_block, key, pstate):
        """Chooses what to commit in each row's current block.

        Args:
          logits: [b, B, V] float32, the logits predicting each block position (Dream's
            shift already applied).
          masked: [b, B] bool, still masked positions of the block.
          step_in_block: [b] int32 iterations already spent on this block.
          key: PRNG key for this iteration.
          pstate: the policy's state.
        Returns:
          (commit [b, B] bool (a subset of masked), tokens [b, B] int32, new pstate).
        """
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FixedStepsPolicy(BlockPolicy):
    """A block policy with a fixed step budget (LLaDA's and Dream's reference samplers):
    `steps` spread evenly over the blocks, every call a full forward.

    Attributes (beyond BlockPolicy):
      steps: total steps over all blocks; a positive multiple of the number of blocks.
    """

    steps: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.cache != "none":
            raise SamplerError(
                f"{self.name}: cache must be 'none' (use fast-dllm for caching)")
        if self.steps <= 0 or self.steps % self.num_blocks:
            raise SamplerError(
                f"{self.name}: steps={self.steps} must be a positive multiple of the number "
                f"of blocks gen_length/block_length={self.num_blocks}")

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def max_iterations(self) -> int:
        return self.steps + 2


def greedy_confidence(logits):
    """argmax token and its softmax probability; [b, n, V] -> ([b, n] int32, [b, n] f32)."""
    x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)
    conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    return x0, conf
