"""Dream's reference sampler (diffusion_generate), optionally applied block-wise.

Restates Dream's generation_utils: timesteps linspace(1, eps, steps + 1); at step s
with t = timesteps[s] and t' = timesteps[s + 1], k = floor(n_masked * (1 - t'/t)) (all
remaining masks at the last step). `origin` commits each mask with probability
1 - t'/t; the confidence algorithms commit the top-k by confidence (or sample k by
softmax(confidence / alg_temp) when alg_temp > 0). The logit shift is applied by the
loop. Dream's own sampler is one block (block_length = gen_length); smaller blocks split
`steps` evenly over the blocks, as in the block-wise Dream evaluations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asynclane_jax.decoding import ops
from asynclane_jax.decoding.block import FixedStepsSchedule
from asynclane_jax.decoding.schedule import SamplerError

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def dream_timesteps(steps: int, eps: float) -> np.ndarray:
    """[steps + 1] float32 timesteps from 1 down to eps."""
    return np.linspace(1.0, eps, steps + 1, dtype=np.float64).astype(np.float32)


def neg_entropy(probs):
    """Dream's `entropy` confidence, sum p * log(p + 1e-10) over the vocabulary ([..., V]
    -> [...]), as its public code computes it: the 1e-10 inside the log moves the sum
    by up to ~1e-5 at Dream-7B's 152,064 tokens, enough to reorder two positions."""
    return jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)


@dataclasses.dataclass(frozen=True)
class DreamSchedule(FixedStepsSchedule):
    """Dream's reference sampler (one block unless block_length is given).

    Attributes:
      alg: origin | maskgit_plus | topk_margin | entropy.
      alg_temp: > 0 samples the positions to commit from softmax(confidence / alg_temp).
      temperature: token sampling temperature; 0 is greedy.
      top_p: nucleus sampling mass (None: off).
      top_k: sample among the k most likely tokens (None: off).
      eps: final timestep.
    """

    name = "dream"
    default_block_length = None
    alg: str = "maskgit_plus"
    alg_temp: float = 0.0
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    eps: float = 1e-3

    def __post_init__(self):
        super().__post_init__()
        if self.alg not in ALGS:
            raise SamplerError(f"dream: alg={self.alg!r}: expected one of {ALGS}")
        if self.alg_temp < 0 or self.temperature < 0:
            raise SamplerError("dream: alg_temp and temperature must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise SamplerError(f"dream: top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k <= 0:
            raise SamplerError(f"dream: top_k={self.top_k} must be positive")
        if not 0 < self.eps < 1:
            raise SamplerError(f"dream: eps={self.eps} must be in (0, 1)")

    def _sample(self, logits, key):
        if self.temperature > 0:
            logits = logits / self.temperature
        if self.top_p is not None and self.top_p < 1:
            logits = ops.top_p_filter(logits, self.top_p)
        if self.top_k is not None:
            logits = ops.top_k_filter(logits, self.top_k)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.temperature > 0:
            x0 = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
        else:
            x0 = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        return x0, probs

    def select(self, logits, masked, step_in_block, key, pstate):
        k_tok, k_pos = jax.random.split(key)
        x0, probs = self._sample(logits, k_tok)
        spb = self.steps_per_block
        ts = jnp.asarray(dream_timesteps(spb, self.eps))
        t = ts[step_in_block]  # [b]
        s = ts[jnp.minimum(step_in_block + 1, spb)]
        last = step_in_block >= spb - 1
        ratio = 1.0 - s / t  # float32, as the reference computes it
        if self.alg == "origin":
            u = jax.random.uniform(k_pos, masked.shape)
            commit = masked & ((u < ratio[:, None]) | last[:, None])
            return commit, x0, pstate
        n_masked = jnp.sum(masked, axis=1)
        k = jnp.where(last, n_masked,
                      jnp.floor(n_masked.astype(jnp.float32) * ratio).astype(jnp.int32))
        if self.alg == "maskgit_plus":
            conf = ops.gather_last(probs, x0)
        elif self.alg == "topk_margin":
            top2 = jax.lax.top_k(probs, 2)[0]
            conf = top2[..., 0] - top2[..., 1]
        else:  # entropy: sum p log p (higher = more certain)
            conf = neg_entropy(probs)
        conf = jnp.where(masked, conf, ops.NEG_INF)
        if self.alg_temp > 0:
            # Sampling k positions without replacement from softmax(conf / alg_temp) is
            # top-k of conf / alg_temp + Gumbel noise.
            g = jax.random.gumbel(k_pos, conf.shape)
            conf = jnp.where(masked, conf / self.alg_temp + g, ops.NEG_INF)
        return ops.topk_mask(conf, k), x0, pstate
