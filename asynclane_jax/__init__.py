"""asynclane-jax: diffusion language models (LLaDA, Dream) in JAX/Flax NNX.

Public API:
  load(path_or_name)           -> (model, tokenizer, config)
  generate(model, prompts, ...) -> GenerationResult   (asynclane_jax.decoding)
  ModelConfig, preset(name), from_hf_config(dict), init_model(cfg)
"""

from asynclane_jax.checkpoint import (
    CheckpointError,
    load,
    register_shipped,
    save,
    shipped_models,
)
from asynclane_jax.models import (
    ConfigError,
    DiffusionLM,
    KVCache,
    ModelConfig,
    from_hf_config,
    init_model,
    param_stats,
    preset,
)

__version__ = "0.1.0"


def __getattr__(name):
    # The decoding package pulls in more modules; import it on first use.
    if name in ("generate", "GenerationResult", "DecodeStats"):
        from asynclane_jax import decoding

        return getattr(decoding, name)
    raise AttributeError(f"module 'asynclane_jax' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "ConfigError", "DecodeStats", "DiffusionLM", "KVCache", "ModelConfig",
    "from_hf_config", "generate", "GenerationResult", "init_model", "load", "param_stats",
    "preset", "register_shipped", "save", "shipped_models",
]
