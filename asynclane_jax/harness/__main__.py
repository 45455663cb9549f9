"""`python -m asynclane_jax.harness ARGS`: lm-eval's own command line, with the model
"asynclane" registered and this package's task folder included.

  python -m asynclane_jax.harness run --model asynclane \\
      --model_args model=tiny-llada,sampler=fast-dllm,gen_length=256 \\
      --tasks testbed --limit 32 --output_path results/
  python -m asynclane_jax.harness run --model asynclane --model_args model=/models/llada \\
      --tasks gsm8k --metadata '{"gsm8k_path": "/data/gsm8k/test.jsonl"}' --apply_chat_template

Every lm-eval flag works; model_args are AsyncLaneLM's keyword arguments (sampler options
included). The local data of a task is given as metadata `<name>_path`
(asynclane_jax.harness.data).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asynclane_jax.harness import TASKS_DIR, require

    require("lm_eval")
    from lm_eval.__main__ import cli_evaluate

    import asynclane_jax.harness.model  # noqa: F401  (registers "asynclane")

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv and argv and argv[0] in ("run", "ls", "validate"):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
