"""The jitted decode loop and its sampler policies."""

from asynclane_jax.decoding.api import SAMPLERS, GenerationResult, generate, make_policy
from asynclane_jax.decoding.policy import BlockPolicy, SamplerError

__all__ = ["SAMPLERS", "BlockPolicy", "GenerationResult", "SamplerError", "generate",
           "make_policy"]
