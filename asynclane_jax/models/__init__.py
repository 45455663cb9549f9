"""Model configs and the Flax NNX diffusion LM."""

from asynclane_jax.models.config import (
    PRESETS,
    ConfigError,
    LLaDA2Config,
    ModelConfig,
    dream_7b_base,
    dream_7b_instruct,
    from_hf_config,
    llada2_mini,
    llada_8b_base,
    llada_8b_instruct,
    preset,
    tiny_dream,
    tiny_llada,
    tiny_llada2,
)
from asynclane_jax.models.model import (
    DiffusionLM,
    KVCache,
    abstract_model,
    init_model,
    param_stats,
)

__all__ = [
    "PRESETS", "ConfigError", "LLaDA2Config", "ModelConfig", "dream_7b_base",
    "dream_7b_instruct", "from_hf_config", "llada_8b_base", "llada_8b_instruct", "preset",
    "tiny_dream", "tiny_llada", "llada2_mini", "tiny_llada2", "DiffusionLM", "KVCache",
    "abstract_model", "init_model", "param_stats",
]
