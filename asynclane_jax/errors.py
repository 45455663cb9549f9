"""Errors a user can cause, shared by the library and every command line that uses it."""

from __future__ import annotations

import sys

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


def run_command(args) -> int:
    """Runs a parsed subcommand (`args.func(args)`): its exit status, or 2 with one line
    on stderr for a user error, 130 when interrupted."""
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        print(f"asynclane-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"asynclane-jax {args.command}: interrupted", file=sys.stderr)
        return 130
