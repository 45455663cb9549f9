"""--compile-cache: a second process that builds the same decode program reads it from
the cache folder (it adds no entry), and a folder that cannot be made is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _generate(cache, *extra):
    cmd = [sys.executable, "-m", "asynclane_jax.cli", "generate", "--json", "--sampler",
           "vanilla", "--gen-length", "32", "--compile-cache", str(cache), *extra,
           "ann has 7 coins ."]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_a_second_process_reads_the_program_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _generate(cache)
    assert first.returncode == 0, first.stderr
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "nothing was written to the compile cache"
    second = _generate(cache)
    assert second.returncode == 0, second.stderr
    assert sorted(p.name for p in cache.iterdir()) == entries  # every program was found
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]


def test_an_unusable_cache_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = _generate(blocker / "cache")
    assert out.returncode == 2
    assert "compile cache" in out.stderr and "Traceback" not in out.stderr
