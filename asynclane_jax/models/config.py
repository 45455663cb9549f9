"""One frozen model config covering the LLaDA (OLMo-style) and Dream (Qwen2-style) families,
and its subclass `LLaDA2Config` for the LLaDA2 mixture-of-experts family (`llada2_moe`).

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

FAMILIES = ("llada", "dream", "llada2")
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
# The names of a scanned model's stacks when its layers differ (`layer_stacks`): the
# dense first layers and the expert layers of a LLaDA2 model.
STACK_NAMES = ("dense", "moe")
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
    if c.get("family") == "llada2":
        return c["vocab_size"] * d + _moe_layers_params(c, attn) + d + head
    return c["vocab_size"] * d + c["n_layers"] * block + d + head


def n_active_params(cfg_fields: Mapping[str, Any], *, embeddings: bool = True) -> int:
    """The parameters one token's forward uses: `n_params` for a dense config; for a
    mixture-of-experts one, every parameter but the routed experts a token does not
    choose (each expert layer uses n_experts_per_tok of its n_experts). embeddings=False
    leaves out the embedding table and the untied output head (the "non-embedding"
    count model cards give)."""
    c = cfg_fields
    total = n_params(c)
    if c.get("family") == "llada2":
        unused = c["n_experts"] - c["n_experts_per_tok"]
        total -= (c["n_layers"] - c["first_dense_layers"]) * unused * _expert_params(c)
    if not embeddings:
        total -= c["vocab_size"] * c["d_model"] * (1 if c.get("tie_embeddings") else 2)
    return total


def _expert_params(c: Mapping[str, Any]) -> int:
    """One routed expert of a LLaDA2 config: a SwiGLU of width moe_hidden."""
    return 3 * c["d_model"] * c["moe_hidden"]


def _moe_layers_params(c: Mapping[str, Any], attn: int) -> int:
    """The layers of a LLaDA2 config: attention (plus the per-head q/k norms), the first
    `first_dense_layers` with a dense SwiGLU, the rest with a router (kernel and
    expert_bias), the routed experts and the shared expert(s)."""
    d, h, E = c["d_model"], c["head_dim"], c["n_experts"]
    shared = c["moe_hidden"] * c["n_shared_experts"]
    common = attn + 2 * h + 2 * d
    dense = common + 3 * d * c["mlp_hidden"]
    moe = common + d * E + E + E * _expert_params(c) + 3 * d * shared
    first = c["first_dense_layers"]
    return first * dense + (c["n_layers"] - first) * moe


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
    moe_ok = True
    if c.get("family") == "llada2":
        moe = moe_problems(c)
        problems.extend(moe)
        moe_ok = not moe
    if sizes_ok and moe_ok:
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


# The mixture-of-experts fields of a LLaDA2Config and their bounds (a routed expert count
# past 2^14 or a top-k past 2^10 is no published model).
MOE_SIZE_LIMITS = {"n_experts": 2**14, "n_experts_per_tok": 2**10, "moe_hidden": 2**20,
                   "n_expert_groups": 2**14, "n_topk_groups": 2**14, "rotary_dim": 2**12}
MOE_FIELDS = tuple(MOE_SIZE_LIMITS) + ("n_shared_experts", "first_dense_layers",
                                       "routed_scaling")


def moe_problems(c: Mapping[str, Any]) -> list[str]:
    """Everything wrong with the mixture-of-experts fields of a LLaDA2Config's fields."""
    if any(name not in c for name in MOE_FIELDS):
        return [f"family='llada2' is a mixture-of-experts model: its config is a "
                f"LLaDA2Config with {list(MOE_FIELDS)}"]
    problems = []
    ok = True
    for name, limit in MOE_SIZE_LIMITS.items():
        value = c[name]
        if not is_int(value) or value <= 0:
            problems.append(f"{name}={show(value)}: must be a positive integer")
            ok = False
        elif value > limit:
            problems.append(f"{name}={value}: larger than {limit:,}; the config is corrupt")
            ok = False
    for name in ("n_shared_experts", "first_dense_layers"):
        value = c[name]
        if not is_int(value) or not 0 <= value <= 2**10:
            problems.append(f"{name}={show(value)}: must be an integer in [0, 1024]")
            ok = False
    value = c["routed_scaling"]
    if not is_real(value) or value <= 0:
        problems.append(f"routed_scaling={show(value)}: must be a finite positive number")
    if not ok:
        return problems
    E, k, G, g = (c["n_experts"], c["n_experts_per_tok"], c["n_expert_groups"],
                  c["n_topk_groups"])
    if E % G:
        problems.append(f"n_experts={E} is not a multiple of n_expert_groups={G}")
    elif E // G < 2:
        problems.append(f"n_experts={E} in n_expert_groups={G}: a group's score is the sum "
                        "of its two best experts, so each group needs at least 2")
    elif g > G:
        problems.append(f"n_topk_groups={g} is more than n_expert_groups={G}")
    elif k > g * (E // G):
        problems.append(f"n_experts_per_tok={k}: more than the {g * (E // G)} experts of "
                        f"the n_topk_groups={g} chosen groups")
    head_dim, n_layers = c.get("head_dim"), c.get("n_layers")
    if c["rotary_dim"] % 2:
        problems.append(f"rotary_dim={c['rotary_dim']}: RoPE needs an even width")
    if is_int(head_dim) and c["rotary_dim"] > head_dim:
        problems.append(f"rotary_dim={c['rotary_dim']} is more than head_dim={head_dim}")
    if is_int(n_layers) and c["first_dense_layers"] > n_layers:
        problems.append(f"first_dense_layers={c['first_dense_layers']} is more than "
                        f"n_layers={n_layers}")
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
        (`layers.<name>`), run by a scan, so a compiled call holds one layer body
        (a LLaDA2 model with dense first layers: two such stacks, `layer_stacks`). A
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
    def rope_dim(self) -> int:
        """The leading channels of a head that RoPE rotates (all of them here)."""
        return self.head_dim

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model (`LLaDA2Config`)."""
        return False

    def moe_layer(self, index: int) -> bool:
        """Whether layer `index` has routed experts instead of a dense SwiGLU."""
        del index
        return False

    def layer_stacks(self) -> tuple[tuple[str | None, int, int], ...]:
        """The scanned layout's stacks (`scan_layers`): runs of consecutive layers of
        one structure, each (name, first, stop), each stacked along its own leading
        axis and run by its own scan. One stack of every layer, named None (its arrays
        directly under `layers`), unless the layers differ (`LLaDA2Config`)."""
        return ((None, 0, self.n_layers),)

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
        if cls is ModelConfig and data.get("family") == "llada2":
            cls = LLaDA2Config
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


@dataclasses.dataclass(frozen=True)
class LLaDA2Config(ModelConfig):
    """A LLaDA2 mixture-of-experts model (Hugging Face model_type `llada2_moe`): the
    ModelConfig fields (family "llada2"; `mlp_hidden` is the dense layers' SwiGLU width)
    plus the experts, routing and partial rotary ones. Every LLaDA2 attention has a fused
    q/k/v projection and a per-head RMSNorm of queries and keys (QK-norm). See
    docs/llada2.md.

    Attributes:
      n_experts: routed experts of a mixture-of-experts layer.
      n_experts_per_tok: experts chosen per token (top-k).
      moe_hidden: SwiGLU width of one routed expert.
      n_shared_experts: shared experts, run on every token, fused into one SwiGLU of
        width moe_hidden * n_shared_experts (0: none).
      first_dense_layers: the first layers have a dense SwiGLU instead of experts
        (`first_k_dense_replace`).
      n_expert_groups, n_topk_groups: group-limited routing: the experts are split into
        n_expert_groups consecutive groups, each scored by the sum of its two best
        (bias-corrected) expert scores, and only the n_topk_groups best groups' experts
        may be chosen.
      routed_scaling: the normalised top-k weights are multiplied by it.
      rotary_dim: the leading channels of each head that RoPE rotates (partial rotary:
        head_dim * partial_rotary_factor); the rest pass unrotated.
    """

    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_hidden: int = 0
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    n_expert_groups: int = 1
    n_topk_groups: int = 1
    routed_scaling: float = 1.0
    rotary_dim: int = 0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim

    @property
    def is_moe(self) -> bool:
        return True

    def moe_layer(self, index: int) -> bool:
        return index >= self.first_dense_layers

    def layer_stacks(self) -> tuple[tuple[str | None, int, int], ...]:
        """Two stacks when the first layers are dense and the rest have experts:
        ("dense", 0, F) and ("moe", F, L) (`layers.dense.<name>` [F, ...] and
        `layers.moe.<name>` [L - F, ...]); one otherwise."""
        first, n = self.first_dense_layers, self.n_layers
        if 0 < first < n:
            return ((STACK_NAMES[0], 0, first), (STACK_NAMES[1], first, n))
        return ((None, 0, n),)


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


def llada2_mini() -> LLaDA2Config:
    """inclusionAI/LLaDA2.0-mini (its published config.json; docs/llada2.md). The
    config names no mask, end-of-sequence or end-of-turn token: the mask id 156895 and
    the end-of-sequence id 156892 (also its pad_token_id) are those of the authors'
    generate code."""
    return LLaDA2Config(
        family="llada2", vocab_size=157184, d_model=2048, n_layers=20, n_heads=16,
        n_kv_heads=4, head_dim=128, mlp_hidden=5120, rope_theta=600000.0, norm_eps=1e-6,
        qkv_bias=False, tie_embeddings=False, logit_shift=False, mask_token_id=156895,
        eos_token_id=156892, pad_token_id=156892, eot_token_id=None, max_seq_len=32768,
        dtype="bfloat16", param_dtype="bfloat16", block_causal=True, n_experts=256,
        n_experts_per_tok=8, moe_hidden=512, n_shared_experts=1, first_dense_layers=1,
        n_expert_groups=8, n_topk_groups=4, routed_scaling=2.5, rotary_dim=64)


def llada2_flash() -> LLaDA2Config:
    """inclusionAI/LLaDA2.0-flash (100B total). Its dimensions are those of the flash
    config.json that the authors' training framework (github.com/inclusionAI/dFactory,
    configs/model_configs/llada2_flash) ships; that framework's mini config equals the
    published LLaDA2.0-mini config in every field this model reads except the context
    length (16384 there, 32768 published), so the context length, the tokens and the
    routing, which the two sizes share, are taken from `llada2_mini`. Not checked
    against the published flash checkpoint's own config or index (docs/llada2.md)."""
    return llada2_mini().replace(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=4, head_dim=128,
        mlp_hidden=9216, moe_hidden=1024)


def tiny_llada2(vocab_size: int = 64) -> LLaDA2Config:
    """A small LLaDA2-shaped config for tests: 3 layers (the first dense), 8 experts in
    4 groups, top-2 of the best 2 groups, one shared expert, half-rotary heads."""
    return LLaDA2Config(
        family="llada2", vocab_size=vocab_size, d_model=32, n_layers=3, n_heads=4,
        n_kv_heads=2, head_dim=8, mlp_hidden=64, rope_theta=600000.0, norm_eps=1e-6,
        mask_token_id=vocab_size - 1, eos_token_id=vocab_size - 2,
        pad_token_id=vocab_size - 2, max_seq_len=256, block_causal=True, n_experts=8,
        n_experts_per_tok=2, moe_hidden=16, n_shared_experts=1, first_dense_layers=1,
        n_expert_groups=4, n_topk_groups=2, routed_scaling=2.5, rotary_dim=4)


PRESETS = {
    "llada-8b-instruct": llada_8b_instruct,
    "llada-8b-base": llada_8b_base,
    "dream-7b-instruct": dream_7b_instruct,
    "dream-7b-base": dream_7b_base,
    "tiny-llada-test": tiny_llada,
    "tiny-dream-test": tiny_dream,
    "llada2-mini": llada2_mini,
    "llada2-flash": llada2_flash,
    "tiny-llada2-test": tiny_llada2,
}


def preset(name: str) -> ModelConfig:
    """Returns the named preset config."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------- HF configs

def from_hf_config(hf: Mapping[str, Any], *, dtype: str | None = None) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json of LLaDA, Dream or LLaDA2
    (`llada2_moe`, a LLaDA2Config).

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
    if family == "llada2":
        return _from_llada2(hf, dtype)
    return _from_llada(hf, dtype) if family == "llada" else _from_dream(hf, dtype)


# The model_type and model classes of the published checkpoints, matched exactly: relatives
# with other architectures share name fragments (LLaDA-MoE is "lladamoe" / LLaDAMoEModelLM)
# and would otherwise be read with the wrong schema and fail on a missing field.
HF_MODEL_TYPES = {"llada": "llada", "dream": "dream", "llada2_moe": "llada2"}
HF_ARCHITECTURES = {"LLaDAModelLM": "llada", "DreamModel": "dream",
                    "LLaDA2MoeModelLM": "llada2"}


def hf_family(hf: Mapping[str, Any]) -> str:
    """The family ("llada", "dream" or "llada2") a Hugging Face config.json describes.

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
    expected = ("expected a LLaDA (model_type 'llada', LLaDAModelLM), Dream "
                "('Dream', DreamModel) or LLaDA2 ('llada2_moe', LLaDA2MoeModelLM) config")
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


def _build(label: str, f: _Fields, cls=None, **fields) -> ModelConfig:
    if f.problems:
        raise ConfigError(f"{label} config: " + "; ".join(f.problems))
    try:
        return (cls or ModelConfig)(**fields)
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
    f.fail_if(hf.get("clip_qkv") is not None,
              f"clip_qkv={show(hf.get('clip_qkv'))} is not supported")
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
              f"rope_scaling={show(hf.get('rope_scaling'))} is not supported")
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


# Every field of a published llada2_moe config.json and what reading it means. Fields not
# named here are refused: the converter reads what it knows and does not guess at the rest.
# Fields that change nothing the forward computes (training, caching, bookkeeping):
LLADA2_IGNORED = frozenset({
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype",
    "transformers_version", "initializer_range", "output_router_logits", "use_cache",
    "attention_dropout", "embedding_dropout", "output_dropout", "max_window_layers",
    "mtp_loss_scaling_factor", "bos_token_id", "router_dtype", "sliding_window",
})
# Fields accepted only at the value the published code implements (or that must agree
# with what it derives), refused otherwise (`_from_llada2`):
LLADA2_CHECKED = frozenset({
    "moe_router_enable_expert_bias", "rope_scaling", "use_sliding_window",
    "num_nextn_predict_layers", "norm_head", "use_qk_norm", "use_qkv_bias", "use_bias",
    "use_rmsnorm", "score_function", "norm_topk_prob", "hidden_act",
    "moe_shared_expert_intermediate_size", "rotary_dim", "partial_rotary_factor",
    "using_split_qkv_in_self_attention",
})
# Fields read into the LLaDA2Config.
LLADA2_READ = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
    "num_experts_per_tok", "num_shared_experts", "first_k_dense_replace", "n_group",
    "topk_group", "routed_scaling_factor", "rope_theta", "rms_norm_eps", "vocab_size",
    "tie_word_embeddings", "max_position_embeddings", "pad_token_id", "eos_token_id",
    "mask_token_id", "eot_token_id",
})
LLADA2_FIELDS = LLADA2_IGNORED | LLADA2_CHECKED | LLADA2_READ


def _from_llada2(hf, dtype):
    f = _Fields(hf)
    unknown = sorted(str(k) for k in hf if k not in LLADA2_FIELDS)
    f.fail_if(bool(unknown), f"unknown llada2_moe config fields {unknown[:8]}: not read, "
              "and refused rather than ignored (they may change the computation)")
    d_model = f.size("hidden_size", ours="d_model")
    n_layers = f.size("num_hidden_layers", ours="n_layers")
    n_heads = f.size("num_attention_heads", ours="n_heads")
    n_kv = f.size("num_key_value_heads", n_heads, ours="n_kv_heads") if n_heads else None
    mlp_hidden = f.size("intermediate_size", ours="mlp_hidden")
    moe_hidden = f.size("moe_intermediate_size", ours="mlp_hidden")
    vocab = f.size("vocab_size")
    n_experts = f.size("num_experts")
    top_k = f.size("num_experts_per_tok")
    n_group = f.size("n_group")
    topk_group = f.size("topk_group")
    if hf.get("head_dim") is not None:
        head_dim = f.size("head_dim")
    else:
        f.fail_if(d_model is not None and n_heads is not None and d_model % n_heads != 0,
                  f"hidden_size={d_model} is not a multiple of num_attention_heads={n_heads}")
        head_dim = d_model // n_heads if d_model and n_heads else None
    shared = hf.get("num_shared_experts")
    if shared is None or shared == 0:
        n_shared = 0
    else:
        n_shared = f.size("num_shared_experts")
    first = hf.get("first_k_dense_replace", _ABSENT)
    if first is _ABSENT or first is None:
        f.problems.append("missing required field 'first_k_dense_replace'")
    elif first != 0:
        first = f.size("first_k_dense_replace")
    scaling = None
    if hf.get("routed_scaling_factor") is None:
        f.problems.append("missing required field 'routed_scaling_factor'")
    else:
        scaling = f.number("routed_scaling_factor", None)
    factor = hf.get("partial_rotary_factor", 1.0)
    rotary_dim = None
    if not is_real(factor) or not 0 < factor <= 1:
        f.problems.append(f"partial_rotary_factor={show(factor)}: must be in (0, 1]")
    elif head_dim is not None:
        rotary_dim = int(head_dim * factor)  # as the published code computes it
        f.fail_if(rotary_dim < 2 or rotary_dim % 2 != 0,
                  f"partial_rotary_factor={factor} gives {rotary_dim} rotary channels of "
                  f"head_dim={head_dim}: RoPE needs an even, positive width")
        given = hf.get("rotary_dim")
        f.fail_if(given is not None and given != rotary_dim,
                  f"rotary_dim={show(given)} disagrees with head_dim * partial_rotary_factor "
                  f"= {rotary_dim}, which the published code uses")
    if n_shared and moe_hidden is not None:
        given = hf.get("moe_shared_expert_intermediate_size")
        f.fail_if(given is not None and given != moe_hidden * n_shared,
                  f"moe_shared_expert_intermediate_size={show(given)} is not "
                  f"moe_intermediate_size * num_shared_experts = {moe_hidden * n_shared}")
    # Fields whose other values would change the computation in ways not built here.
    act = hf.get("hidden_act", "silu")
    f.fail_if(act != "silu", f"hidden_act={show(act)} is not supported (SwiGLU/silu only)")
    score = hf.get("score_function", "sigmoid")
    f.fail_if(score != "sigmoid",
              f"score_function={show(score)} is not supported (sigmoid routing only)")
    # The published code normalises the top-k weights whenever top-k > 1 and always
    # applies the QK-norm, whatever these flags say; a config that says otherwise is
    # refused rather than read either way.
    f.fail_if(hf.get("norm_topk_prob", True) is not True,
              f"norm_topk_prob={show(hf.get('norm_topk_prob'))}: the published code "
              "normalises the top-k weights; only true is supported")
    f.fail_if(hf.get("use_qk_norm", True) is not True,
              f"use_qk_norm={show(hf.get('use_qk_norm'))}: the published code always "
              "normalises queries and keys; only true is supported")
    f.fail_if(bool(hf.get("use_qkv_bias")), "use_qkv_bias=true is not supported")
    f.fail_if(bool(hf.get("use_bias")), "use_bias=true is not supported")
    f.fail_if(bool(hf.get("norm_head")), "norm_head=true is not supported")
    f.fail_if(hf.get("use_rmsnorm", True) is not True, "use_rmsnorm=false is not supported")
    f.fail_if(bool(hf.get("use_sliding_window")), "use_sliding_window=true is not supported")
    f.fail_if(bool(hf.get("using_split_qkv_in_self_attention")),
              "using_split_qkv_in_self_attention=true is not supported (fused "
              "query_key_value only)")
    f.fail_if(hf.get("rope_scaling") not in (None, {}),
              f"rope_scaling={show(hf.get('rope_scaling'))} is not supported")
    f.fail_if(hf.get("num_nextn_predict_layers") not in (None, 0),
              f"num_nextn_predict_layers={show(hf.get('num_nextn_predict_layers'))}: "
              "multi-token-prediction layers are not supported")
    bias_flag = hf.get("moe_router_enable_expert_bias", True)
    f.fail_if(not isinstance(bias_flag, bool),
              f"moe_router_enable_expert_bias={show(bias_flag)}: must be true or false")
    rope_theta = f.number("rope_theta", 10000.0)
    norm_eps = f.number("rms_norm_eps", 1e-6)
    tie = f.flag("tie_word_embeddings")
    ids = {"mask_token_id": f.token("mask_token_id", 156895),
           "eos_token_id": f.token("eos_token_id", hf.get("pad_token_id", 156892))}
    ids["pad_token_id"] = f.token("pad_token_id", ids["eos_token_id"])
    ids["eot_token_id"] = f.token("eot_token_id")
    _check_ids(f, vocab, ids)
    max_len = f.size("max_position_embeddings", 32768, ours="max_seq_len")
    dt = _dtype_of(hf, dtype)
    return _build("LLaDA2", f, LLaDA2Config,
                  family="llada2", vocab_size=vocab, d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, mlp_hidden=mlp_hidden,
                  rope_theta=rope_theta, norm_eps=norm_eps, qkv_bias=False,
                  tie_embeddings=tie, logit_shift=False, **ids, max_seq_len=max_len,
                  dtype=dt, param_dtype=dt, block_causal=True, n_experts=n_experts,
                  n_experts_per_tok=top_k, moe_hidden=moe_hidden, n_shared_experts=n_shared,
                  first_dense_layers=first, n_expert_groups=n_group, n_topk_groups=topk_group,
                  routed_scaling=scaling, rotary_dim=rotary_dim)
