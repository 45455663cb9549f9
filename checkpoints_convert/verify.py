"""The independent reference: transformers' Llama / Qwen2 run bidirectionally.

LLaDA is a LLaMA-architecture transformer under OLMo tensor names, Dream is Qwen2.5;
both attend bidirectionally. transformers (>= 5.2) builds a bidirectional mask when
`config.is_causal = False`, so `LlamaForCausalLM` / `Qwen2ForCausalLM` with that flag,
loaded with the snapshot's own tensors, is a reference that shares no code with this
package: its config is built from the Hugging Face config.json (not from ModelConfig)
and its renaming table below is separate from checkpoints_convert.names.

Used by `asynclane-jax convert --verify` and by the parity tests. Needs torch and
transformers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

import numpy as np

# LLaDA (OLMo names) -> Llama names. Dream already uses Qwen2 names.
_LLADA_TO_LLAMA = (
    (r"model\.transformer\.wte\.weight", "model.embed_tokens.weight"),
    (r"model\.transformer\.ln_f\.weight", "model.norm.weight"),
    (r"model\.transformer\.ff_out\.weight", "lm_head.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_norm\.weight",
     r"model.layers.\1.input_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.([qkv])_proj\.(weight|bias)",
     r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_out\.weight",
     r"model.layers.\1.self_attn.o_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_norm\.weight",
     r"model.layers.\1.post_attention_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_proj\.weight",
     r"model.layers.\1.mlp.gate_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.up_proj\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_out\.weight", r"model.layers.\1.mlp.down_proj.weight"),
)


def family_of(hf_config: Mapping) -> str:
    """The family of a config.json, by the converter's own exact detection.

    Raises:
      ConfigError (a ValueError) for any other model_type or architecture.
    """
    from asynclane_jax.models.config import hf_family

    return hf_family(hf_config)


def reference_name(family: str, name: str) -> str | None:
    """The transformers name of a snapshot tensor, or None for a non-parameter buffer."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if family == "dream":
        return name
    for pattern, repl in _LLADA_TO_LLAMA:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    raise KeyError(f"no Llama name for LLaDA tensor {name}")


def reference_config(hf_config: Mapping):
    """A bidirectional LlamaConfig (LLaDA) or Qwen2Config (Dream) from config.json."""
    from transformers import LlamaConfig, Qwen2Config

    hf = dict(hf_config)
    family = family_of(hf)
    if family == "llada":
        n_heads = hf["n_heads"]
        cfg = LlamaConfig(
            vocab_size=hf.get("embedding_size") or hf["vocab_size"], hidden_size=hf["d_model"],
            intermediate_size=hf["mlp_hidden_size"], num_hidden_layers=hf["n_layers"],
            num_attention_heads=n_heads, num_key_value_heads=hf.get("n_kv_heads") or n_heads,
            head_dim=hf["d_model"] // n_heads, rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            attention_bias=bool(hf.get("include_qkv_bias", False)), mlp_bias=False,
            tie_word_embeddings=bool(hf.get("weight_tying", False)),
            max_position_embeddings=hf.get("max_sequence_length", 4096), hidden_act="silu",
            attn_implementation="eager")
    else:
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings", "hidden_act")
        kwargs = {k: hf[k] for k in keys if hf.get(k) is not None}
        if hf.get("head_dim"):
            kwargs["head_dim"] = hf["head_dim"]
        cfg = Qwen2Config(**kwargs, use_sliding_window=False, attn_implementation="eager")
    cfg.is_causal = False  # the whole point: diffusion LMs attend both ways
    return cfg


def build_reference(hf_config: Mapping, tensors: Iterable[tuple[str, np.ndarray]],
                    *, dtype: str = "float32"):
    """A transformers model holding exactly the given tensors.

    Args:
      hf_config: the snapshot's config.json.
      tensors: (snapshot name, numpy array) pairs, e.g. streamed from a snapshot; each
        is cast to `dtype` as it arrives, so only the reference's own copy is kept.
      dtype: "float32" or "bfloat16".
    Returns:
      The model in eval mode.
    """
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    family = family_of(hf_config)
    cfg = reference_config(hf_config)
    tdtype = getattr(torch, dtype)
    cls = LlamaForCausalLM if family == "llada" else Qwen2ForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    state = {}
    for name, array in tensors:
        ref = reference_name(family, name)
        if ref is not None:
            state[ref] = torch.from_numpy(np.asarray(array, dtype=np.float32)).to(tdtype)
    if family == "llada" and cfg.attention_bias:  # LLaDA has q/k/v biases only
        for i in range(cfg.num_hidden_layers):
            state[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(
                cfg.hidden_size, dtype=tdtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise KeyError(f"reference does not have {result.unexpected_keys}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [k for k in result.missing_keys
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise KeyError(f"reference is missing {missing}")
    # RoPE inverse frequencies are a non-persistent buffer: rebuild it off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t.is_meta]
    if leftover:
        raise RuntimeError(f"reference tensors left on the meta device: {leftover}")
    return model.eval()


def reference_logits(model, tokens: np.ndarray, *, attention_mask: np.ndarray | None = None,
                     position_ids: np.ndarray | None = None) -> np.ndarray:
    """[b, T] ids -> [b, T, V] float32 logits of the reference."""
    import torch

    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.from_numpy(np.asarray(attention_mask, np.int64))
    if position_ids is not None:
        kwargs["position_ids"] = torch.from_numpy(np.asarray(position_ids, np.int64))
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)), **kwargs)
    return out.logits.float().numpy()


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    max_abs_diff: float
    top1_agree: int
    positions: int
    dtype: str
    reference: str
    nonfinite_params: int = 0  # NaN / inf values in the converted model's weights
    nonfinite_logits: int = 0  # ... in either model's logits

    @property
    def top1_rate(self) -> float:
        return self.top1_agree / max(self.positions, 1)

    def line(self) -> str:
        return (f"verify: {self.reference} (is_causal=False) vs converted model, {self.dtype}, "
                f"{self.positions} positions: max |logit diff| {self.max_abs_diff:.3g}, "
                f"top-1 agreement {self.top1_agree}/{self.positions} ({100 * self.top1_rate:.1f}%)"
                + (f", {self.nonfinite_params:,} non-finite weights" if self.nonfinite_params
                   else "")
                + (f", {self.nonfinite_logits:,} non-finite logits" if self.nonfinite_logits
                   else ""))


def prompt_tokens(cfg, tokenizer=None, n_masks: int = 8) -> np.ndarray:
    """A short prompt followed by mask tokens (the positions a diffusion LM predicts)."""
    ids: list[int] = []
    if tokenizer is not None:
        ids = [i for i in tokenizer.encode("The capital of France is Paris, and the capital "
                                           "of Japan is") if 0 <= i < cfg.vocab_size]
    if len(ids) < 4:
        ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 16))
    return np.asarray([ids[:48] + [cfg.mask_token_id] * n_masks], np.int32)


def verify_converted(snapshot, dst, *, adapter=None, out_dtype: str,
                     compute_dtype: str | None = None) -> VerifyReport:
    """Runs the reference on the source tensors and the converted folder on the same prompt.

    The reference sees the source tensors (LoRA merged) rounded to the output dtype, as
    the converted folder stores them, so the comparison measures the architecture and
    the name mapping, not the rounding.

    Args:
      snapshot: the reader.Snapshot converted.
      dst: the converted folder.
      adapter: the LoRA adapter merged, if any.
      out_dtype: the converted folder's parameter dtype.
      compute_dtype: "float32" or "bfloat16"; default float32 up to 2B parameters.
    Returns:
      A VerifyReport.
    """
    import jax

    from asynclane_jax.checkpoint import load, read_config
    from checkpoints_convert.convert import NP_DTYPES

    cfg, _ = read_config(dst)
    n_params = sum(int(np.prod(t.shape)) for t in snapshot.tensors.values())
    compute = compute_dtype or ("float32" if n_params <= 2e9 else "bfloat16")
    store = NP_DTYPES[out_dtype]

    def stream():
        for info, array in snapshot.iter_tensors():
            if adapter is not None and info.name in adapter.pairs:
                array = adapter.merge(info.name, array)
            yield info.name, np.asarray(array, dtype=store).astype(np.float32)

    ref = build_reference(snapshot.hf_config, stream(), dtype=compute)
    from asynclane_jax.checkpoint import load_tokenizer

    tokens = prompt_tokens(cfg, load_tokenizer(dst))
    want = reference_logits(ref, tokens)
    name = type(ref).__name__
    del ref
    model, _, _ = load(dst, dtype=compute)
    from flax import nnx

    from checkpoints_convert.convert import count_nonfinite

    bad_params = sum(count_nonfinite(np.asarray(x))
                     for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(jax.numpy.asarray(tokens)), np.float32)
    bad_logits = int(np.sum(~np.isfinite(got)) + np.sum(~np.isfinite(want)))
    diff = float(np.max(np.abs(got - want)))
    agree = int(np.sum(got.argmax(-1) == want.argmax(-1)))
    return VerifyReport(diff, agree, int(tokens.size), compute, f"transformers {name}",
                        nonfinite_params=bad_params, nonfinite_logits=bad_logits)
