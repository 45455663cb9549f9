"""One frozen model config covering the LLaDA (OLMo-style) and Dream (Qwen2-style) families.

Notation used across the package: b batch, T canvas length, Q queried positions,
d model width, H query heads, K key/value heads, h head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

FAMILIES = ("llada", "dream")
DTYPES = ("float32", "bfloat16", "float16")

# Sanity bounds on a config's sizes, checked before any shape is built: a config past
# them is corrupt or hostile, not a real model (the largest published dense models have
# ~126 layers, widths ~16k-50k and vocabularies ~256k). Without them a config.json with
# 10^9 layers would have the converter build 10^9 abstract blocks before anything else.
SIZE_LIMITS = {
    "vocab_size": 2**24, "d_model": 2**17, "n_layers": 1024, "n_heads": 2**12,
    "n_kv_heads": 2**12, "head_dim": 2**12, "mlp_hidden": 2**20, "max_seq_len": 2**24,
}
MAX_PARAMS = 10**12  # parameters (a 1T-parameter dense model is 2 TB in bfloat16)
INT_FIELDS = tuple(SIZE_LIMITS)
TOKEN_FIELDS = ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id")
BOOL_FIELDS = ("qkv_bias", "tie_embeddings", "logit_shift", "block_causal", "scan_layers",
               "causal")


def show(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (error messages stay one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_int(value) -> bool:
    """A JSON integer: an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite JSON number (int or float, not a bool, not NaN or infinite)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def n_params(cfg_fields: Mapping[str, Any]) -> int:
    """The parameter count of the model a config describes, by arithmetic (no shapes
    built): equal to `param_stats(cfg)["params"]`."""
    c = cfg_fields
    d, h = c["d_model"], c["head_dim"]
    q, kv = c["n_heads"] * h, c["n_kv_heads"] * h
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if c.get("qkv_bias") else 0)
    block = attn + 3 * d * c["mlp_hidden"] + 2 * d
    head = 0 if c.get("tie_embeddings") else d * c["vocab_size"]
    return c["vocab_size"] * d + c["n_layers"] * block + d + head


def config_problems(c: Mapping[str, Any]) -> list[str]:
    """Everything wrong with a ModelConfig's fields, field by field (types, ranges,
    integrality, divisibility, size bounds), without building anything."""
    problems = []
    if c.get("family") not in FAMILIES:
        problems.append(f"family={show(c.get('family'))}: expected one of {FAMILIES}")
    sizes_ok = True
    for name, limit in SIZE_LIMITS.items():
        value = c.get(name)
        if not is_int(value) or value <= 0:
            problems.append(f"{name}={show(value)}: must be a positive integer")
            sizes_ok = False
        elif value > limit:
            problems.append(f"{name}={value}: larger than {limit:,}, which no real model "
                            "is; the config is corrupt")
            sizes_ok = False
    if sizes_ok:
        if c["n_heads"] % c["n_kv_heads"]:
            problems.append(f"n_heads={c['n_heads']} is not a multiple of "
                            f"n_kv_heads={c['n_kv_heads']}")
        if c["head_dim"] % 2:
            problems.append(f"head_dim={c['head_dim']}: RoPE needs an even head width")
        total = n_params(c)
        if total > MAX_PARAMS:
            problems.append(f"{total:,} parameters: more than {MAX_PARAMS:,}; the config "
                            "is corrupt")
    for name in ("rope_theta", "norm_eps"):
        value = c.get(name)
        if not is_real(value) or value <= 0:
            problems.append(f"{name}={show(value)}: must be a finite positive number")
    if is_real(c.get("norm_eps")) and c["norm_eps"] >= 1:
        problems.append(f"norm_eps={show(c['norm_eps'])}: must be below 1")
    vocab = c.get("vocab_size")
    for name in TOKEN_FIELDS:
        value = c.get(name)
        if value is None and name == "eot_token_id":
            continue
        if not is_int(value) or (is_int(vocab) and not 0 <= value < vocab) or value < 0:
            problems.append(f"{name}={show(value)}: must be an id in [0, {vocab})")
    for name in BOOL_FIELDS:
        if not isinstance(c.get(name), bool):
            problems.append(f"{name}={show(c.get(name))}: must be true or false")
    if c.get("causal") is True:
        if c.get("logit_shift") is not True:
            problems.append("causal=true needs logit_shift=true: a causal model's output "
                            "at column c predicts column c + 1")
        if c.get("block_causal") is True:
            problems.append("causal=true and block_causal=true: a model is trained one "
                            "way or the other")
    for name in ("dtype", "param_dtype"):
        if c.get(name) not in DTYPES:
            problems.append(f"{name}={show(c.get(name))}: expected one of {DTYPES}")
    return problems


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
      scan_layers: the parameter layout and the layer loop. False: one Block per layer
        (parameters `layers.<i>.<name>`), unrolled in every compiled call. True: one
        Block whose parameters are the layers' stacked along a leading [L] axis
        (`layers.<name>`), run by a scan, so a compiled call holds one layer body. A
        converted folder stores the layout its config names; `checkpoint.load(...,
        scan_layers=)` reads either into either.
      causal: trained as an autoregressive LM (next-token loss, causal attention over
        the whole canvas, the prompt included): decoded by the `ar` sampler, whose
        attention is the block-causal path with blocks of one column. It needs
        logit_shift (the output at column c predicts c + 1) and excludes block_causal.
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
    scan_layers: bool = False
    causal: bool = False

    def __post_init__(self):
        problems = config_problems(dataclasses.asdict(self))
        if problems:
            raise ConfigError("; ".join(problems))

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
        if not isinstance(data, Mapping):
            raise ConfigError(f"the model config is a {type(data).__name__}, not an object")
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING
                   and f.name not in data]
        if missing:
            raise ConfigError(f"missing model config fields {missing}")
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
    if not isinstance(hf, Mapping):
        raise ConfigError(f"the config is a {type(hf).__name__}, not a JSON object")
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"architectures={show(archs)}: expected a list of class names")
    arch_families = {HF_ARCHITECTURES.get(a) for a in archs}
    expected = ("expected a LLaDA (model_type 'llada', LLaDAModelLM) or Dream "
                "('Dream', DreamModel) config")
    if not model_type:
        if len(arch_families) == 1 and None not in arch_families:
            return arch_families.pop()
        raise ConfigError(f"unsupported model: no model_type, architectures {show(archs)}; "
                          f"{expected}")
    family = HF_MODEL_TYPES.get(model_type.lower()) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(
            f"unsupported model_type {show(model_type)} (architectures {show(archs)}); {expected}")
    if archs and arch_families != {family}:
        raise ConfigError(f"unsupported architectures {show(archs)} for model_type "
                          f"{show(model_type)}; {expected}")
    return family


def _dtype_of(hf, dtype):
    if dtype is not None:
        return dtype
    torch_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    torch_dtype = torch_dtype.replace("torch.", "")
    return torch_dtype if torch_dtype in DTYPES else "float32"


_ABSENT = object()


class _Fields:
    """Reads a Hugging Face config.json field by field, checking each value's type,
    integrality and range, and collecting every problem (nothing is converted by
    truncation: 32.9 is not 32)."""

    def __init__(self, hf: Mapping[str, Any]):
        self.hf = hf
        self.problems: list[str] = []

    def _get(self, key, default):
        value = self.hf.get(key, _ABSENT)
        return default if value is _ABSENT or value is None else value

    def size(self, key, default=_ABSENT, *, ours: str | None = None):
        """A positive integer (an integral float such as 4096.0 is accepted), bounded by
        SIZE_LIMITS[ours]; None when absent without a default or invalid."""
        value = self._get(key, default)
        if value is _ABSENT:
            self.problems.append(f"missing required field {key!r}")
            return None
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not is_int(value):
            self.problems.append(f"{key}={show(value)}: must be an integer")
            return None
        if value <= 0:
            self.problems.append(f"{key}={value}: must be positive")
            return None
        limit = SIZE_LIMITS.get(ours or key)
        if limit is not None and value > limit:
            self.problems.append(f"{key}={value}: larger than {limit:,}, which no real model "
                                 "is; the config is corrupt")
            return None
        return value

    def token(self, key, default=None):
        """A token id (>= 0), or None; a list of ids (eos_token_id of some configs) gives
        its first."""
        value = self._get(key, default)
        if value is None:
            return None
        if isinstance(value, list):
            if not value:
                self.problems.append(f"{key}=[]: an empty list of token ids")
                return None
            value = value[0]
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not is_int(value) or value < 0:
            self.problems.append(f"{key}={show(value)}: must be a token id (an integer >= 0)")
            return None
        return value

    def number(self, key, default):
        """A finite positive number."""
        value = self._get(key, default)
        if not is_real(value) or value <= 0:
            self.problems.append(f"{key}={show(value)}: must be a finite positive number")
            return None
        return float(value)

    def flag(self, key, default: bool = False) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{key}={show(value)}: must be true or false")
            return default
        return value

    def fail_if(self, cond: bool, message: str) -> None:
        if cond:
            self.problems.append(message)


def _check_ids(f: _Fields, vocab, ids: Mapping[str, Any]) -> None:
    if vocab is None:
        return
    for key, value in ids.items():
        if value is not None and value >= vocab:
            f.problems.append(f"{key}={value}: not an id of the vocabulary [0, {vocab})")


def _build(label: str, f: _Fields, **fields) -> ModelConfig:
    if f.problems:
        raise ConfigError(f"{label} config: " + "; ".join(f.problems))
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"{label} config: {e}") from None


def _from_llada(hf, dtype):
    f = _Fields(hf)
    d_model = f.size("d_model")
    n_layers = f.size("n_layers")
    n_heads = f.size("n_heads")
    n_kv = f.size("n_kv_heads", n_heads, ours="n_kv_heads") if n_heads else None
    if hf.get("mlp_hidden_size") is not None:
        mlp_hidden = f.size("mlp_hidden_size", ours="mlp_hidden")
    else:
        ratio = f.number("mlp_ratio", 4)
        mlp_hidden = (int(ratio * d_model) if ratio is not None and d_model is not None
                      else None)
        if mlp_hidden is not None and not 0 < mlp_hidden <= SIZE_LIMITS["mlp_hidden"]:
            f.problems.append(f"mlp_ratio={ratio} gives an MLP width of {mlp_hidden}")
            mlp_hidden = None
    vocab_key = "embedding_size" if hf.get("embedding_size") is not None else "vocab_size"
    vocab = f.size(vocab_key, ours="vocab_size")
    if hf.get("multi_query_attention"):
        f.fail_if(hf.get("n_kv_heads") not in (1, None),
                  "multi_query_attention conflicts with n_kv_heads")
        n_kv = 1
    f.fail_if(d_model is not None and n_heads is not None and d_model % n_heads != 0,
              f"d_model={d_model} is not a multiple of n_heads={n_heads}")
    f.fail_if(bool(hf.get("alibi")), "alibi=true is not supported (RoPE only)")
    f.fail_if(hf.get("rope") is False, "rope=false is not supported")
    f.fail_if(bool(hf.get("include_bias")), "include_bias=true is not supported")
    f.fail_if(hf.get("clip_qkv") is not None, f"clip_qkv={hf.get('clip_qkv')} is not supported")
    f.fail_if(bool(hf.get("rope_full_precision") is False),
              "rope_full_precision=false is not supported")
    f.fail_if(bool(hf.get("attention_layer_norm")), "attention_layer_norm=true is not supported")
    ln = hf.get("layer_norm_type", "rms")
    f.fail_if(str(ln).lower() not in ("rms", "rmsnorm", "rms_norm"),
              f"layer_norm_type={show(ln)} is not supported (RMSNorm only)")
    # LLaDA's llama block computes ff_out(act(ff_proj(x)) * up_proj(x)); only act=silu
    # makes that SwiGLU ("swiglu" would halve ff_proj's output, "sequential" blocks use
    # fused att_proj / ff_proj tensors).
    act = hf.get("activation_type", "silu")
    f.fail_if(str(act).lower() != "silu",
              f"activation_type={show(act)} is not supported (silu in a llama block only)")
    block = hf.get("block_type", "llama")
    f.fail_if(str(block).lower() != "llama",
              f"block_type={show(block)} is not supported (llama only)")
    f.fail_if(hf.get("layer_norm_with_affine") is False,
              "layer_norm_with_affine=false is not supported")
    f.fail_if(bool(hf.get("bias_for_layer_norm")), "bias_for_layer_norm=true is not supported")
    f.fail_if(bool(hf.get("input_emb_norm")), "input_emb_norm=true is not supported")
    f.fail_if(hf.get("rope_scaling") not in (None, {}), "rope_scaling is not supported")
    f.fail_if(bool(hf.get("scale_logits")), "scale_logits=true is not supported")
    rope_theta = f.number("rope_theta", 10000.0)
    norm_eps = f.number("rms_norm_eps" if hf.get("rms_norm_eps") is not None
                        else "layer_norm_eps", 1e-5)
    qkv_bias = f.flag("include_qkv_bias")
    tie = f.flag("weight_tying")
    ids = {"mask_token_id": f.token("mask_token_id", 126336),
           "eos_token_id": f.token("eos_token_id", 126081)}
    ids["pad_token_id"] = f.token("pad_token_id", ids["eos_token_id"])
    ids["eot_token_id"] = f.token("eot_token_id")
    _check_ids(f, vocab, ids)
    max_len = f.size("max_sequence_length", 4096, ours="max_seq_len")
    dt = _dtype_of(hf, dtype)
    return _build("LLaDA", f,
                  family="llada", vocab_size=vocab, d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, n_kv_heads=n_kv,
                  head_dim=d_model // n_heads if d_model and n_heads else None,
                  mlp_hidden=mlp_hidden, rope_theta=rope_theta, norm_eps=norm_eps,
                  qkv_bias=qkv_bias, tie_embeddings=tie, logit_shift=False, **ids,
                  max_seq_len=max_len, dtype=dt, param_dtype=dt)


def _from_dream(hf, dtype):
    f = _Fields(hf)
    d_model = f.size("hidden_size", ours="d_model")
    n_layers = f.size("num_hidden_layers", ours="n_layers")
    n_heads = f.size("num_attention_heads", ours="n_heads")
    mlp_hidden = f.size("intermediate_size", ours="mlp_hidden")
    vocab = f.size("vocab_size")
    n_kv = f.size("num_key_value_heads", n_heads, ours="n_kv_heads") if n_heads else None
    if hf.get("head_dim") is not None:
        head_dim = f.size("head_dim")
    else:
        f.fail_if(d_model is not None and n_heads is not None and d_model % n_heads != 0,
                  f"hidden_size={d_model} is not a multiple of num_attention_heads={n_heads}")
        head_dim = d_model // n_heads if d_model and n_heads else None
    f.fail_if(bool(hf.get("use_sliding_window")), "use_sliding_window=true is not supported")
    f.fail_if(hf.get("rope_scaling") not in (None, {}),
              f"rope_scaling={hf.get('rope_scaling')} is not supported")
    act = hf.get("hidden_act", "silu")
    f.fail_if(act != "silu", f"hidden_act={show(act)} is not supported (SwiGLU/silu only)")
    rope_theta = f.number("rope_theta", 10000.0)
    norm_eps = f.number("rms_norm_eps", 1e-6)
    tie = f.flag("tie_word_embeddings")
    ids = {"mask_token_id": f.token("mask_token_id", 151666),
           "eos_token_id": f.token("eos_token_id", 151643)}
    ids["pad_token_id"] = f.token("pad_token_id", ids["eos_token_id"])
    ids["eot_token_id"] = f.token("eot_token_id")
    _check_ids(f, vocab, ids)
    max_len = f.size("max_position_embeddings", 32768, ours="max_seq_len")
    dt = _dtype_of(hf, dtype)
    return _build("Dream", f,
                  family="dream", vocab_size=vocab, d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, mlp_hidden=mlp_hidden,
                  rope_theta=rope_theta, norm_eps=norm_eps, qkv_bias=True,
                  tie_embeddings=tie, logit_shift=True, **ids, max_seq_len=max_len,
                  dtype=dt, param_dtype=dt)
