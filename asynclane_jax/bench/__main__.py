"""`python -m asynclane_jax.bench ARGS`: the same as `asynclane-jax bench ARGS`."""

import sys

from asynclane_jax.bench.cli import main

sys.exit(main())
