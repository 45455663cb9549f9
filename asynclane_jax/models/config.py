"""One frozen model config covering the LLaDA (OLMo-style) and Dream (Qwen2-style) families.

Notation used across the package: b batch, T canvas length, Q queried positions,
d model width, H query heads, K key/value heads, h head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

FAMILIES = ("llada", "dream")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A model config is invalid or asks for something this library does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and token ids of one diffusion LM.

    Attributes:
      family: "llada" (no logit shift, OLMo tensor names) or "dream" (Qwen2 names).
      vocab_size: rows of the embedding / columns of the output head.
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads: query heads.
      n_kv_heads: key/value heads (grouped-query attention when < n_heads).
      head_dim: width of one head.
      mlp_hidden: SwiGLU hidden width.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      qkv_bias: q/k/v projections carry a bias (Dream does, LLaDA does not).
      tie_embeddings: the output head reuses the embedding matrix.
      logit_shift: the token at position i is read from the output at i - 1 (Dream).
        The model's forward never applies it; decoding does.
      mask_token_id, eos_token_id, pad_token_id: special ids.
      eot_token_id: end-of-turn id of chat models (decoding treats it like EOS), or None.
      max_seq_len: longest canvas (prompt + generation) the model accepts.
      dtype: activation / compute dtype.
      param_dtype: parameter storage dtype.
      block_causal: trained with block-causal attention (a D2F student): the prompt is
        bidirectional and each generated block sees the prompt, earlier blocks and
        itself, so a finished block's K/V never change. The model's forward attends
        as it is told (`block_ids`); this says what the weights were trained for.
    """

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    logit_shift: bool = False
    mask_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 1
    eot_token_id: int | None = None
    max_seq_len: int = 4096
    dtype: str = "float32"
    param_dtype: str = "float32"
    block_causal: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}: expected one of {FAMILIES}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "mlp_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim}: RoPE needs an even head width")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta!r}: must be positive")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r}: must be positive")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id"):
            value = getattr(self, name)
            if value is None and name == "eot_token_id":
                continue
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value!r}: must be an id in [0, {self.vocab_size})")
        if not isinstance(self.block_causal, bool):
            raise ConfigError(f"block_causal={self.block_causal!r}: must be true or false")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {DTYPES}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: EOS, and end-of-turn for chat models."""
        ids = [self.eos_token_id]
        if self.eot_token_id is not None and self.eot_token_id != self.eos_token_id:
            ids.append(self.eot_token_id)
        return tuple(ids)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# --------------------------------------------------------------------------- presets

def llada_8b_instruct() -> ModelConfig:
    """GSAI-ML/LLaDA-8B-Instruct."""
    return ModelConfig(
        family="llada", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32,
        n_kv_heads=32, head_dim=128, mlp_hidden=12288, rope_theta=500000.0, norm_eps=1e-5,
        qkv_bias=False, tie_embeddings=False, logit_shift=False, mask_token_id=126336,
        eos_token_id=126081, pad_token_id=126081, eot_token_id=126348, max_seq_len=4096,
        dtype="bfloat16", param_dtype="bfloat16")


def llada_8b_base() -> ModelConfig:
    """GSAI-ML/LLaDA-8B-Base (same architecture; no chat end-of-turn token)."""
    return llada_8b_instruct().replace(eot_token_id=None)


def dream_7b_instruct() -> ModelConfig:
    """Dream-org/Dream-v0-Instruct-7B (Qwen2.5-7B architecture)."""
    return ModelConfig(
        family="dream", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
        n_kv_heads=4, head_dim=128, mlp_hidden=18944, rope_theta=1000000.0, norm_eps=1e-6,
        qkv_bias=True, tie_embeddings=False, logit_shift=True, mask_token_id=151666,
        eos_token_id=151643, pad_token_id=151643, eot_token_id=151645, max_seq_len=131072,
        dtype="bfloat16", param_dtype="bfloat16")


def dream_7b_base() -> ModelConfig:
    """Dream-org/Dream-v0-Base-7B."""
    return dream_7b_instruct().replace(eot_token_id=None)


def tiny_llada(vocab_size: int = 64) -> ModelConfig:
    """A small LLaDA-shaped config for tests (MHA, no biases, untied head)."""
    return ModelConfig(
        family="llada", vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4,
        n_kv_heads=4, head_dim=8, mlp_hidden=64, rope_theta=10000.0, norm_eps=1e-5,
        mask_token_id=vocab_size - 1, eos_token_id=vocab_size - 2,
        pad_token_id=vocab_size - 2, max_seq_len=256)


def tiny_dream(vocab_size: int = 64) -> ModelConfig:
    """A small Dream-shaped config for tests (GQA, q/k/v biases, logit shift)."""
    return ModelConfig(
        family="dream", vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4,
        n_kv_heads=2, head_dim=8, mlp_hidden=64, rope_theta=10000.0, norm_eps=1e-6,
        qkv_bias=True, tie_embeddings=False, logit_shift=True,
        mask_token_id=vocab_size - 1, eos_token_id=vocab_size - 2,
        pad_token_id=vocab_size - 2, max_seq_len=256)


PRESETS = {
    "llada-8b-instruct": llada_8b_instruct,
    "llada-8b-base": llada_8b_base,
    "dream-7b-instruct": dream_7b_instruct,
    "dream-7b-base": dream_7b_base,
    "tiny-llada-test": tiny_llada,
    "tiny-dream-test": tiny_dream,
}


def preset(name: str) -> ModelConfig:
    """Returns the named preset config."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------- HF configs

def _fail_if(cond: bool, problems: list[str], message: str):
    if cond:
        problems.append(message)


def from_hf_config(hf: Mapping[str, Any], *, dtype: str | None = None) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json of LLaDA or Dream.

    Fields that would change the computation and that this library does not implement
    (alibi, biases other than q/k/v, clip_qkv, sliding windows, RoPE scaling, ...) raise
    ConfigError listing every problem, rather than being ignored.

    Args:
      hf: the parsed config.json.
      dtype: compute/param dtype to use; defaults to the config's torch_dtype.

    Returns:
      The ModelConfig.
    """
    family = hf_family(hf)
    return _from_llada(hf, dtype) if family == "llada" else _from_dream(hf, dtype)


# The model_type and model classes of the published checkpoints, matched exactly: relatives
# with other architectures share name fragments (LLaDA-MoE is "lladamoe" / LLaDAMoEModelLM)
# and would otherwise be read with the wrong schema and fail on a missing field.
HF_MODEL_TYPES = {"llada": "llada", "dream": "dream"}
HF_ARCHITECTURES = {"LLaDAModelLM": "llada", "DreamModel": "dream"}


def hf_family(hf: Mapping[str, Any]) -> str:
    """The family ("llada" or "dream") a Hugging Face config.json describes.

    model_type decides (case-insensitively, as Dream writes "Dream"); a config without
    one is recognised by its architectures. Listed architectures must be the family's
    own model class.

    Args:
      hf: the parsed config.json.
    Returns:
      The family name.
    Raises:
      ConfigError naming the unsupported model_type / architectures.
    """
    model_type = hf.get("model_type")
    archs = [str(a) for a in hf.get("architectures") or []]
    arch_families = {HF_ARCHITECTURES.get(a) for a in archs}
    expected = ("expected a LLaDA (model_type 'llada', LLaDAModelLM) or Dream "
                "('Dream', DreamModel) config")
    if not model_type:
        if len(arch_families) == 1 and None not in arch_families:
            return arch_families.pop()
        raise ConfigError(f"unsupported model: no model_type, architectures {archs}; {expected}")
    family = HF_MODEL_TYPES.get(str(model_type).lower())
    if family is None:
        raise ConfigError(
            f"unsupported model_type {model_type!r} (architectures {archs}); {expected}")
    if archs and arch_families != {family}:
        raise ConfigError(f"unsupported architectures {archs} for model_type {model_type!r}; "
                          f"{expected}")
    return family


def _dtype_of(hf, dtype):
    if dtype is not None:
        return dtype
    torch_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    torch_dtype = torch_dtype.replace("torch.", "")
    return torch_dtype if torch_dtype in DTYPES else "float32"


def _req(hf, key, problems):
    if key not in hf or hf[key] is None:
        problems.append(f"missing required field {key!r}")
        return None
    return hf[key]


def _from_llada(hf, dtype):
    problems: list[str] = []
    d_model = _req(hf, "d_model", problems)
    n_layers = _req(hf, "n_layers", problems)
    n_heads = _req(hf, "n_heads", problems)
    n_kv = hf.get("n_kv_heads") or n_heads
    mlp_hidden = hf.get("mlp_hidden_size")
    if mlp_hidden is None and d_model is not None:
        mlp_hidden = int(hf.get("mlp_ratio", 4) * d_model)
    vocab = hf.get("embedding_size") or hf.get("vocab_size")
    _fail_if(vocab is None, problems, "missing 'vocab_size' / 'embedding_size'")
    _fail_if(bool(hf.get("alibi")), problems, "alibi=true is not supported (RoPE only)")
    _fail_if(hf.get("rope") is False, problems, "rope=false is not supported")
    _fail_if(bool(hf.get("include_bias")), problems, "include_bias=true is not supported")
    _fail_if(hf.get("clip_qkv") is not None, problems,
             f"clip_qkv={hf.get('clip_qkv')} is not supported")
    _fail_if(bool(hf.get("rope_full_precision") is False), problems,
             "rope_full_precision=false is not supported")
    _fail_if(bool(hf.get("attention_layer_norm")), problems,
             "attention_layer_norm=true is not supported")
    _fail_if(bool(hf.get("multi_query_attention")) and n_kv not in (1, None), problems,
             "multi_query_attention conflicts with n_kv_heads")
    if hf.get("multi_query_attention"):
        n_kv = 1
    ln = hf.get("layer_norm_type", "rms")
    _fail_if(str(ln).lower() not in ("rms", "rmsnorm", "rms_norm"), problems,
             f"layer_norm_type={ln!r} is not supported (RMSNorm only)")
    # LLaDA's llama block computes ff_out(act(ff_proj(x)) * up_proj(x)); only act=silu
    # makes that SwiGLU ("swiglu" would halve ff_proj's output, "sequential" blocks use
    # fused att_proj / ff_proj tensors).
    act = hf.get("activation_type", "silu")
    _fail_if(str(act).lower() != "silu", problems,
             f"activation_type={act!r} is not supported (silu in a llama block only)")
    block = hf.get("block_type", "llama")
    _fail_if(str(block).lower() != "llama", problems,
             f"block_type={block!r} is not supported (llama only)")
    _fail_if(hf.get("layer_norm_with_affine") is False, problems,
             "layer_norm_with_affine=false is not supported")
    _fail_if(bool(hf.get("bias_for_layer_norm")), problems,
             "bias_for_layer_norm=true is not supported")
    _fail_if(bool(hf.get("input_emb_norm")), problems, "input_emb_norm=true is not supported")
    _fail_if(hf.get("rope_scaling") not in (None, {}), problems, "rope_scaling is not supported")
    _fail_if(bool(hf.get("scale_logits")), problems, "scale_logits=true is not supported")
    if problems:
        raise ConfigError("LLaDA config: " + "; ".join(problems))
    mask_id = hf.get("mask_token_id", 126336)
    eos_id = hf.get("eos_token_id", 126081)
    pad_id = hf.get("pad_token_id", eos_id)
    dt = _dtype_of(hf, dtype)
    return ModelConfig(
        family="llada", vocab_size=int(vocab), d_model=int(d_model), n_layers=int(n_layers),
        n_heads=int(n_heads), n_kv_heads=int(n_kv), head_dim=int(d_model) // int(n_heads),
        mlp_hidden=int(mlp_hidden), rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", hf.get("layer_norm_eps", 1e-5))),
        qkv_bias=bool(hf.get("include_qkv_bias", False)),
        tie_embeddings=bool(hf.get("weight_tying", False)), logit_shift=False,
        mask_token_id=int(mask_id), eos_token_id=int(eos_id),
        pad_token_id=int(pad_id if pad_id is not None else eos_id),
        eot_token_id=hf.get("eot_token_id", None),
        max_seq_len=int(hf.get("max_sequence_length", 4096)), dtype=dt, param_dtype=dt)


def _from_dream(hf, dtype):
    problems: list[str] = []
    d_model = _req(hf, "hidden_size", problems)
    n_layers = _req(hf, "num_hidden_layers", problems)
    n_heads = _req(hf, "num_attention_heads", problems)
    mlp_hidden = _req(hf, "intermediate_size", problems)
    vocab = _req(hf, "vocab_size", problems)
    n_kv = hf.get("num_key_value_heads") or n_heads
    _fail_if(bool(hf.get("use_sliding_window")), problems,
             "use_sliding_window=true is not supported")
    _fail_if(hf.get("rope_scaling") not in (None, {}), problems,
             f"rope_scaling={hf.get('rope_scaling')} is not supported")
    act = hf.get("hidden_act", "silu")
    _fail_if(act != "silu", problems, f"hidden_act={act!r} is not supported (SwiGLU/silu only)")
    if problems:
        raise ConfigError("Dream config: " + "; ".join(problems))
    mask_id = hf.get("mask_token_id", 151666)
    eos_id = hf.get("eos_token_id", 151643)
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    pad_id = hf.get("pad_token_id", eos_id)
    head_dim = hf.get("head_dim") or int(d_model) // int(n_heads)
    dt = _dtype_of(hf, dtype)
    return ModelConfig(
        family="dream", vocab_size=int(vocab), d_model=int(d_model), n_layers=int(n_layers),
        n_heads=int(n_heads), n_kv_heads=int(n_kv), head_dim=int(head_dim),
        mlp_hidden=int(mlp_hidden), rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), logit_shift=True,
        mask_token_id=int(mask_id), eos_token_id=int(eos_id),
        pad_token_id=int(pad_id if pad_id is not None else eos_id),
        eot_token_id=hf.get("eot_token_id", None),
        max_seq_len=int(hf.get("max_position_embeddings", 32768)), dtype=dt, param_dtype=dt)
