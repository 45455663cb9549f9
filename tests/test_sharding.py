"""Sharding: mesh specs and rules on one device here; everything that needs 8 devices
runs in tests/multidevice/ in a separate pytest process started below."""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.sharding
@pytest.mark.slow
def test_multidevice_suite():
    """Runs tests/multidevice on 8 fake CPU devices; every test there must pass."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "multidevice")], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=1500)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail
