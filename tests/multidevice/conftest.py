"""Tests that need 8 devices: they run in their own pytest process, started by
tests/models/test_sharding.py with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the
flag must be set before JAX starts, so it cannot be set inside the main run).

Collected only in a process that has the 8 devices; the main run starts that process
and fails when any test in it fails, or when none ran.
"""

import os
import sys

import pytest

DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/ helpers

if FLAG not in os.environ.get("XLA_FLAGS", ""):
    collect_ignore_glob = ["test_*.py"]
else:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")

    @pytest.fixture(scope="session", autouse=True)
    def _eight_devices():
        assert jax.device_count() == DEVICES, jax.devices()
