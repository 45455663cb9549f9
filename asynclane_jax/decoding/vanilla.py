"""LLaDA's reference sampler: block-wise, a fixed number of commits per step.

Restates ML-GSAI/LLaDA generate.py: `steps` spread evenly over the G/B blocks; in each
block the n masked positions are committed over steps/num_blocks steps, the first
n % steps_per_block steps committing one more than the rest; each step commits the
top-k masked positions of the block by confidence (softmax probability of the chosen
token, or a uniform random score for `random` remasking).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.block import FixedStepsSchedule
from asynclane_jax.decoding.schedule import SamplerError

REMASKING = ("low_confidence", "random")


@dataclasses.dataclass(frozen=True)
class VanillaSchedule(FixedStepsSchedule):
    """LLaDA's reference sampler.

    Attributes:
      remasking: "low_confidence" or "random".
      temperature: Gumbel-max temperature; 0 is greedy argmax.
      cfg_scale: classifier-free guidance scale; 0 disables it.
    """

    name = "vanilla"
    remasking: str = "low_confidence"
    temperature: float = 0.0
    cfg_scale: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.remasking not in REMASKING:
            raise SamplerError(f"vanilla: remasking={self.remasking!r}: expected {REMASKING}")
        if self.temperature < 0:
            raise SamplerError(f"vanilla: temperature={self.temperature} must be >= 0")
        if self.cfg_scale < 0:
            raise SamplerError(f"vanilla: cfg_scale={self.cfg_scale} must be >= 0")

    @property
    def guidance_scale(self) -> float:
        return self.cfg_scale

    def select(self, logits, masked, step_in_block, key, pstate):
        k_sample, k_remask = jax.random.split(key)
        x0 = ops.gumbel_argmax(logits, self.temperature, k_sample)
        if self.remasking == "low_confidence":
            probs = jax.nn.softmax(logits, axis=-1)
            conf = ops.gather_last(probs, x0)
        else:
            conf = jax.random.uniform(k_remask, masked.shape)
        conf = jnp.where(masked, conf, ops.NEG_INF)
        # The block is fully masked when it starts (nothing outside the current block is
        # ever committed), so the per-step counts depend only on B and steps_per_block.
        spb = self.steps_per_block
        base, rem = self.block_length // spb, self.block_length % spb
        k = base + (step_in_block < rem).astype(jnp.int32)
        return ops.topk_mask(conf, k), x0, pstate
