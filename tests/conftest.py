"""Shared test setup: float32 at highest matmul precision, small models."""

import os
import shutil
import tempfile

import jax
import pytest

from asynclane_jax import compile_cache

jax.config.update("jax_default_matmul_precision", "highest")

# The tests' programs are tiny and compiled once or twice each, so compiling is most of
# the suite's time: the CPU backend's code generation without LLVM's optimisation passes
# compiles them in about two thirds of the time and runs them slower (the same
# operations: a shipped model's logits and tokens came out bit for bit the same both
# ways). Read when the backend starts, after this; the 8-device suite's process
# inherits it. ASYNCLANE_TEST_XLA_OPT=1 keeps XLA's default.
OPT_FLAG = "--xla_backend_optimization_level=0"
if not os.environ.get("ASYNCLANE_TEST_XLA_OPT") and OPT_FLAG not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + OPT_FLAG).strip()

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
