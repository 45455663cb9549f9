"""JAX's persistent compilation cache, so a second process with the same program loads
it instead of compiling it.

`enable(DIR)` (or the environment variable ASYNCLANE_COMPILE_CACHE=DIR, read by the
command line) points JAX at a folder; every program is cached there whatever its
compile time or size (JAX's defaults skip programs that compile in under a second,
which is every program of the tiny models).
"""

from __future__ import annotations

import contextlib
import os
import pathlib

ENV = "ASYNCLANE_COMPILE_CACHE"


def enable(folder: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Caches compiled programs in folder (created if missing); None: the folder named
    by ASYNCLANE_COMPILE_CACHE, or nothing when it is unset.

    Returns:
      The folder in use, or None.
    """
    import jax

    folder = folder or os.environ.get(ENV)
    if not folder:
        return None
    path = pathlib.Path(folder).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"compile cache {path}: cannot create it ({e.strerror})") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# The commands that compile a decode (each takes --compact-full).
COMMANDS = ("generate", "eval", "bench", "aot", "lm-eval", "serve")
# Those whose programs the cache keeps (--compile-cache). Not `aot`: it compiles for a
# TPU topology with no device client, and JAX cannot load such a program back from the
# cache (it warns and compiles again), so the cache is off while it compiles (`off`).
CACHED_COMMANDS = tuple(c for c in COMMANDS if c != "aot")


@contextlib.contextmanager
def off():
    """The persistent cache neither read nor written inside (then as it was). JAX
    decides once per process whether it uses the cache, so the decision is reset on
    the way in and out (not for compiles running meanwhile in other threads)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        cc.reset_cache()


def add_flag(parser) -> None:
    """Adds --compile-cache DIR to a subcommand's parser (once: a command that declares
    it itself keeps its own)."""
    import argparse

    try:
        parser.add_argument("--compile-cache", default=None, metavar="DIR",
                            help="keep compiled programs in DIR, so that a later process "
                                 f"does not compile them again (default: ${ENV})")
    except argparse.ArgumentError:
        pass
