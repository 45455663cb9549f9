"""Errors a user can cause, shared by the library and every command line that uses it."""

from __future__ import annotations

from asynclane_jax.checkpoint import CheckpointError
from asynclane_jax.decoding.schedule import SamplerError
from asynclane_jax.models.config import ConfigError
from asynclane_jax.sharding import ShardingError


class UsageError(ValueError):
    """A bad command-line request; printed without a traceback."""


# Printed as one line on stderr with exit status 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (UsageError, ConfigError, CheckpointError,
                                                SamplerError, ShardingError,
                                                FileNotFoundError)
