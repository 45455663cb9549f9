"""The jitted decode driver and its sampler schedules."""

from asynclane_jax.decoding.api import GenerationResult, generate, make_schedule
from asynclane_jax.decoding.registry import samplers
from asynclane_jax.decoding.schedule import SamplerError, Schedule
from asynclane_jax.decoding.stats import DecodeStats

__all__ = ["DecodeStats", "GenerationResult", "SamplerError", "Schedule", "generate",
           "make_schedule", "samplers"]
