"""An OpenAI-compatible HTTP server over the compiled decode loop: `asynclane-jax serve`.

  engine    continuous batching over the row slots of the compiled decode loop (the
            `Engine`: submit, cancel, stats), on a thread of its own, at the smallest
            slot count that holds the rows, within a memory budget.
  budget    the budget's arithmetic and the host scheduler that decides each pool's
            slot count and admissions (`plan`; pure Python).
  footprint the server's memory from a model's config alone (`serve --dry-run`).
  protocol  OpenAI request bodies read and checked (every field either honoured or a
            400 naming it), and the response / stream chunk bodies.
  guard     the checks before the app: Host and Origin, the API key, JSON only, the
            body read with its bound.
  metrics   /metrics' Prometheus metrics: the requests (by endpoint and status, latency,
            time to first token, tokens) and the engine (queue, slots, pools, compiles).
  app       the ASGI app (FastAPI): /v1/completions, /v1/chat/completions (streaming as
            server-sent events), /v1/models, /health, /metrics.
  stream    the streamed response: server-sent events in batches, one write each.
  cli       the `serve` subcommand (entry point `asynclane_jax.commands`), on uvicorn.

FastAPI, uvicorn, httptools and prometheus-client are optional:
`pip install 'asynclane-jax[serve]'`.
"""

from __future__ import annotations

import importlib

INSTALL_HINT = "pip install 'asynclane-jax[serve]'"
# Distribution name of each optional module the server imports.
_DISTRIBUTIONS = {"fastapi": "fastapi", "uvicorn": "uvicorn", "starlette": "fastapi",
                  "httpx": "httpx", "openai": "openai",
                  "prometheus_client": "prometheus-client", "httptools": "httptools"}


def require(module: str):
    """Imports an optional dependency of the server, or raises a UsageError that says how
    to install it."""
    from asynclane_jax.errors import UsageError

    try:
        return importlib.import_module(module)
    except ImportError:
        name = _DISTRIBUTIONS.get(module.split(".")[0], module)
        raise UsageError(f"serving needs {name}: {INSTALL_HINT}") from None
