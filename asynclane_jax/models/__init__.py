"""Model configs and the Flax NNX diffusion LM."""

from asynclane_jax.models.config import (
    PRESETS,
    ConfigError,
    ModelConfig,
    dream_7b_base,
    dream_7b_instruct,
    from_hf_config,
    llada_8b_base,
    llada_8b_instruct,
    preset,
    tiny_dream,
    tiny_llada,
)
from asynclane_jax.models.model import (
    DiffusionLM,
    KVCache,
    abstract_model,
    init_model,
    param_stats,
)

__all__ = [
    "PRESETS", "ConfigError", "ModelConfig", "dream_7b_base", "dream_7b_instruct",
    "from_hf_config", "llada_8b_base", "llada_8b_instruct", "preset", "tiny_dream",
    "tiny_llada", "DiffusionLM", "KVCache", "abstract_model", "init_model", "param_stats",
]
