"""Shared test setup: float32 at highest matmul precision, small models."""

import os
import shutil
import tempfile

import jax
import pytest

from asynclane_jax import compile_cache

jax.config.update("jax_default_matmul_precision", "highest")

# The tests' programs are tiny and compiled once or twice each, so compiling is most of
# the suite's time. Two settings of the CPU backend compile them faster:
# - code generation without LLVM's optimisation passes: about two thirds of the compile
#   time, and slower programs (the same operations: a shipped model's logits and tokens
#   came out bit for bit the same both ways);
# - the fused computations emitted by XLA's older elemental emitters instead of its MLIR
#   fusion emitters: about a fifth less compile time again for the decode programs
#   (experiments/results/health/suite_time.md). The flag is jaxlib 0.10's (the version
#   the test extra pins), so it is given only to a jaxlib of that series: XLA stops at
#   a flag it does not know.
# Read when the backend starts, after this; the 8-device suite's process inherits them.
# ASYNCLANE_TEST_XLA_OPT=1 keeps XLA's defaults.
OPT_FLAGS = ["--xla_backend_optimization_level=0"]
if jax.__version_info__[:2] == (0, 10):
    OPT_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
if not os.environ.get("ASYNCLANE_TEST_XLA_OPT"):
    _flags = os.environ.get("XLA_FLAGS", "")
    _missing = [f for f in OPT_FLAGS if f.split("=")[0] + "=" not in _flags]
    os.environ["XLA_FLAGS"] = " ".join([_flags, *_missing]).strip()

# One persistent compilation cache for the whole run: the programs a test compiles
# again (a fresh engine, another test file, the 8-device suite's own process) are
# read back instead of compiled. The run's first process makes the folder; its
# workers and subprocesses inherit it through the environment; the first removes it.
CACHE_ENV = "ASYNCLANE_TEST_XLA_CACHE"


def pytest_configure(config):
    if os.environ.get("ASYNCLANE_TEST_NO_XLA_CACHE"):
        return
    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="asynclane-test-xla-")
        config._asynclane_cache_owner = True
    compile_cache.enable(os.environ[CACHE_ENV])


def pytest_unconfigure(config):
    if getattr(config, "_asynclane_cache_owner", False):
        shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llada_model():
    """A random tiny LLaDA, sharpened so that threshold samplers commit several tokens
    per step (see reference_samplers.make_model)."""
    from reference_samplers import make_model

    return make_model("llada", lm_scale=40.0)


@pytest.fixture(scope="session")
def tiny_dream_model():
    from reference_samplers import make_model

    return make_model("dream", lm_scale=30.0)


# The files that take longest (a run of the suite, 2026-12-05), in the order they should
# start: with the suite split across two workers one file at a time (pyproject addopts),
# a long file that starts last keeps one worker busy alone at the end.
LONGEST_FIRST = ("test_sharding.py", "test_early_bird.py", "test_testbed.py",
                 "test_serve_engine.py", "test_asynclane.py", "test_scan_layers.py",
                 "test_d2f_cached_logits.py", "test_decoding_exactness.py",
                 "test_llada2_samplers.py", "test_decoding.py", "test_serve_http.py",
                 "test_d2f.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable otherwise
