"""Helpers shared by the hostile-input tests (tests/checkpoint/test_hostile_convert.py,
test_integrity.py, tests/commands/test_hostile_cli.py, tests/harness/test_hostile_data.py):
every bad input a user can hand the converter, the loader and the command lines is one
line on stderr and exit status 2, within a second, with nothing written.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time

import hf_reference as H
import pytest
from hypothesis import HealthCheck, settings

from asynclane_jax import checkpoint
from asynclane_jax.cli import build_parser, main

# Seconds: a bad input is refused within this (checks only, no imports), measured as the
# CPU time of this process (the machines running the suite are shared).
FAST = 1.0
# Every model shipped inside the package (its folders), not a list kept by hand.
SHIPPED = tuple(sorted(d.name for d in checkpoint.BUILTIN_MODELS_DIR.iterdir()
                       if (d / checkpoint.CONFIG_FILE).is_file()))
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def one_parser():
    """One parser for a module's hundreds of in-process `main` calls (building it,
    with every entry point and the sampler help, costs ~0.1-0.2 s a call), and the
    modules the commands import on first use imported once, outside the timings.
    Imported with `_one_parser`, which makes it autouse in the importing module."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401

    import asynclane_jax.cli as cli_module
    import asynclane_jax.decoding.registry  # noqa: F401
    import asynclane_jax.testbed.evaluate  # noqa: F401

    parser = build_parser()
    real = cli_module.build_parser
    cli_module.build_parser = lambda: parser
    yield
    cli_module.build_parser = real


@pytest.fixture(scope="module", autouse=True)
def _one_parser(one_parser):
    """Autouse in every module that imports it."""


def one_line(err: str) -> None:
    assert "Traceback" not in err and err.strip().count("\n") == 0 and err.strip(), err


def leftovers(parent: pathlib.Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def cli(capsys, *argv):
    """(exit status, stdout, stderr, CPU seconds) of `asynclane-jax ARGV` in-process."""
    t = time.process_time()
    rc = main([str(a) for a in argv])
    seconds = time.process_time() - t
    out = capsys.readouterr()
    return rc, out.out, out.err, seconds


def refused(capsys, *argv, needle: str, fast: bool = True) -> str:
    """Runs `asynclane-jax ARGV`: exit 2, one line naming `needle`, within FAST."""
    rc, _, err, seconds = cli(capsys, *argv)
    assert rc == 2, err
    one_line(err)
    assert needle in err, err
    if fast:
        assert seconds < FAST, f"{seconds:.2f} s"
    return err


def snapshot(root: pathlib.Path, family: str = "llada", layout: str = "single",
             seed: int = 9, **hf_overrides):
    hf = (H.llada_hf_config if family == "llada" else H.dream_hf_config)(**hf_overrides)
    tensors = H.random_tensors(hf, seed=seed)
    return H.write_checkpoint(root / "src", hf, tensors, layout=layout), hf, tensors


def convert_refused(capsys, src, dst, *extra, needle: str, fast: bool = True) -> str:
    err = refused(capsys, "convert", src, dst, "--no-progress", *extra, needle=needle,
                  fast=fast)
    assert not os.path.lexists(dst)
    assert leftovers(pathlib.Path(dst).parent) == []
    return err



def converted_copy(tmp_path, name="tiny-llada") -> pathlib.Path:
    dst = tmp_path / name
    shutil.copytree(checkpoint.resolve(name), dst)
    return dst
