"""Tiny Hugging Face checkpoints in the real LLaDA / Dream layouts, for tests.

The tensor names here are written out by hand from the published checkpoints, not
derived from checkpoints_convert.names, so the tests check the name tables against an
independent listing. Writers produce the exact on-disk layouts transformers uses:
model.safetensors; sharded model-0000i-of-0000n.safetensors + model.safetensors.index.json;
pytorch_model.bin (torch.save); and PEFT LoRA adapter folders.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch

from checkpoints_convert import verify


def llada_hf_config(**overrides) -> dict:
    """A tiny config.json in LLaDA's OLMo-style schema (auto_map included, never run)."""
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": 32, "embedding_dropout": 0.0, "embedding_size": 64, "eos_token_id": 62,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
        "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": 63, "max_sequence_length": 128, "mlp_hidden_size": 64,
        "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 4,
        "n_kv_heads": 4, "n_layers": 2, "pad_token_id": 62, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 64,
        "weight_tying": False,
    }
    cfg.update(overrides)
    return cfg


def dream_hf_config(**overrides) -> dict:
    """A tiny config.json in Dream's Qwen2-style schema."""
    cfg = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                     "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 61, "eos_token_id": 62, "hidden_act": "silu", "hidden_size": 32,
        "initializer_range": 0.02, "intermediate_size": 64, "mask_token_id": 63,
        "max_position_embeddings": 256, "max_window_layers": 2, "model_type": "Dream",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pad_token_id": 62, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 64,
    }
    cfg.update(overrides)
    return cfg


def llada_8b_hf_config() -> dict:
    """The config.json of GSAI-ML/LLaDA-8B-Instruct (OLMo schema), as far as it matters."""
    return llada_hf_config(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
        embedding_size=126464, vocab_size=126464, mask_token_id=126336, eos_token_id=126081,
        pad_token_id=126081, max_sequence_length=4096, rope_theta=500000.0,
        rms_norm_eps=1e-5, torch_dtype="bfloat16")


def dream_7b_hf_config() -> dict:
    """The config.json of Dream-org/Dream-v0-Instruct-7B (Qwen2.5-7B schema)."""
    return dream_hf_config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=131072, max_window_layers=28, bos_token_id=151643,
        eos_token_id=151643, pad_token_id=151643, mask_token_id=151666, rms_norm_eps=1e-6,
        rope_theta=1000000.0)


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name -> torch shape a checkpoint of this config.json holds."""
    out: dict[str, tuple[int, ...]] = {}
    if str(hf["model_type"]).lower() == "llada":
        d, heads = hf["d_model"], hf["n_heads"]
        kv = hf.get("n_kv_heads") or heads
        h, m, v = d // heads, hf["mlp_hidden_size"], hf.get("embedding_size") or hf["vocab_size"]
        out["model.transformer.wte.weight"] = (v, d)
        for i in range(hf["n_layers"]):
            b = f"model.transformer.blocks.{i}."
            out[b + "attn_norm.weight"] = (d,)
            out[b + "q_proj.weight"] = (heads * h, d)
            out[b + "k_proj.weight"] = (kv * h, d)
            out[b + "v_proj.weight"] = (kv * h, d)
            if hf.get("include_qkv_bias"):
                out[b + "q_proj.bias"] = (heads * h,)
                out[b + "k_proj.bias"] = (kv * h,)
                out[b + "v_proj.bias"] = (kv * h,)
            out[b + "attn_out.weight"] = (d, heads * h)
            out[b + "ff_norm.weight"] = (d,)
            out[b + "ff_proj.weight"] = (m, d)
            out[b + "up_proj.weight"] = (m, d)
            out[b + "ff_out.weight"] = (d, m)
        out["model.transformer.ln_f.weight"] = (d,)
        if not hf.get("weight_tying"):
            out["model.transformer.ff_out.weight"] = (v, d)
    else:
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        h = hf.get("head_dim") or d // heads
        m, v = hf["intermediate_size"], hf["vocab_size"]
        out["model.embed_tokens.weight"] = (v, d)
        for i in range(hf["num_hidden_layers"]):
            b = f"model.layers.{i}."
            out[b + "input_layernorm.weight"] = (d,)
            for p, n in (("q", heads), ("k", kv), ("v", kv)):
                out[b + f"self_attn.{p}_proj.weight"] = (n * h, d)
                out[b + f"self_attn.{p}_proj.bias"] = (n * h,)
            out[b + "self_attn.o_proj.weight"] = (d, heads * h)
            out[b + "post_attention_layernorm.weight"] = (d,)
            out[b + "mlp.gate_proj.weight"] = (m, d)
            out[b + "mlp.up_proj.weight"] = (m, d)
            out[b + "mlp.down_proj.weight"] = (d, m)
        out["model.norm.weight"] = (d,)
        if not hf.get("tie_word_embeddings"):
            out["lm_head.weight"] = (v, d)
    return out


def random_tensors(hf: dict, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random weights scaled so logits are O(1) and every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(hf).items():
        if name.endswith(("norm.weight", "ln_f.weight")):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.3 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
            if "wte" in name or "embed_tokens" in name:
                t = torch.randn(shape, generator=g)
        out[name] = t.to(dtype).contiguous()
    return out


def to_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float32 numpy copies (bfloat16 tensors are upcast exactly)."""
    return {k: v.float().numpy() for k, v in tensors.items()}


def ours_from(hf: dict, tensors: dict[str, torch.Tensor]):
    """Our model of a Hugging Face config.json holding exactly `tensors` through the
    converter's table (no random init: every leaf is replaced), in float32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from asynclane_jax.models import abstract_model, from_hf_config
    from checkpoints_convert.convert import params_from_tensors

    cfg = from_hf_config(hf, dtype="float32")
    graphdef, state = nnx.split(abstract_model(cfg))
    params = params_from_tensors(cfg, to_numpy(tensors))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def write_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
    """A tiny word-level tokenizer.json + tokenizer_config.json (no remote code)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<unk>": vocab_size - 3, "<eos>": vocab_size - 2, "<mask>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "unk_token": "<unk>", "mask_token": "<mask>",
         "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))


def write_bpe_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
    """A Dream-style slow tokenizer: vocab.json + merges.txt + tokenizer_config.json with
    added special tokens and a remote-code auto_map (and no tokenizer.json)."""
    chars = ["a", "b", "c", "d", "Ġ"]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"ab": 5, "Ġc": 6, "abd": 7})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\na b\nĠ c\nab d\n")
    # Added tokens follow the BPE vocabulary contiguously, as in Qwen2 / Dream.
    special = {8: "<|endoftext|>", 9: "<|im_end|>", 10: "<|mask|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "DreamTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "added_tokens_decoder": {str(i): {"content": c, "special": True, "lstrip": False,
                                          "rstrip": False, "normalized": False,
                                          "single_word": False} for i, c in special.items()},
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
        "model_max_length": 131072}))
    (folder / "tokenization_dream.py").write_text("raise RuntimeError('remote code executed')\n")


def write_checkpoint(folder: pathlib.Path, hf: dict, tensors: dict[str, torch.Tensor], *,
                     layout: str = "single", shards: int = 2, tokenizer: bool | str = True
                     ) -> pathlib.Path:
    """Writes a snapshot folder the way transformers' save_pretrained lays it out.

    Args:
      layout: "single" (model.safetensors), "sharded" (safetensors + index), "bin"
        (pytorch_model.bin) or "bin_sharded" (pytorch_model-*.bin + index).
      tokenizer: True for tokenizer.json, "bpe" for Dream's vocab.json + merges.txt only.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    # Remote code that must never run: importing it would raise.
    (folder / "modeling_llada.py").write_text("raise RuntimeError('remote code executed')\n")
    names = list(tensors)
    if layout == "single":
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    elif layout == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    elif layout in ("sharded", "bin_sharded"):
        ext = "safetensors" if layout == "sharded" else "bin"
        prefix = "model" if layout == "sharded" else "pytorch_model"
        weight_map = {}
        for s in range(shards):
            part = {n: tensors[n] for n in names[s::shards]}
            fname = f"{prefix}-{s + 1:05d}-of-{shards:05d}.{ext}"
            if ext == "safetensors":
                save_file(part, str(folder / fname), metadata={"format": "pt"})
            else:
                torch.save(part, folder / fname)
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / f"{prefix}.{ext}.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    else:
        raise ValueError(layout)
    vocab = hf.get("embedding_size") or hf["vocab_size"]
    if tokenizer == "bpe":
        write_bpe_tokenizer(folder, vocab)
    elif tokenizer:
        write_tokenizer(folder, vocab)
    return folder


def write_lora_adapter(folder: pathlib.Path, base: dict[str, torch.Tensor], targets: list[str],
                       *, r: int = 4, alpha: float = 16.0, seed: int = 7
                       ) -> dict[str, torch.Tensor]:
    """Writes a PEFT LoRA adapter over `base` and returns the merged weights.

    `targets` are module-name suffixes (PEFT's target_modules): every base weight
    `<module>.weight` whose last component is a target gets a pair. The merge here is
    computed independently in torch: W + (alpha / r) * B @ A.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    adapter, merged = {}, dict(base)
    for name, w in base.items():
        parts = name.split(".")
        if parts[-1] != "weight" or w.ndim != 2 or parts[-2] not in targets:
            continue
        module = name[: -len(".weight")]
        a = torch.randn(r, w.shape[1], generator=g) * 0.3
        b = torch.randn(w.shape[0], r, generator=g) * 0.3
        adapter[f"base_model.model.{module}.lora_A.weight"] = a
        adapter[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = (w.float() + (alpha / r) * (b @ a)).to(w.dtype)
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
        "lora_dropout": 0.05, "bias": "none", "fan_in_fan_out": False,
        "modules_to_save": None, "task_type": "CAUSAL_LM", "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
        "rank_pattern": {}, "alpha_pattern": {}}, indent=2))
    return merged


def reference(hf: dict, tensors: dict[str, torch.Tensor]):
    """The transformers reference (Llama / Qwen2, is_causal=False) holding `tensors`."""
    return verify.build_reference(hf, to_numpy(tensors).items(), dtype="float32")


def reference_logits(hf: dict, tensors: dict[str, torch.Tensor], tokens, **kwargs) -> np.ndarray:
    return verify.reference_logits(reference(hf, tensors), np.asarray(tokens), **kwargs)


# --------------------------------------------------------------------------- converting

# A probe sequence for comparing a converted model's logits with the reference's.
TOKENS = np.array([[5, 17, 3, 42, 8, 63, 63, 63, 63, 1, 29, 11]], np.int32)


def convert_cli(capsys, *argv):
    """`asynclane-jax convert ARGV --no-progress`: (exit status, stdout, stderr)."""
    from asynclane_jax.cli import main

    rc = main(["convert", *map(str, argv), "--no-progress"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_trees_equal(a, b):
    """Two parameter trees (nested dicts of arrays, as `checkpoint.params_to_numpy`
    gives) hold the same names, and under each the same dtype, shape and values."""
    from asynclane_jax import checkpoint

    fa, fb = checkpoint.flat_arrays(a), checkpoint.flat_arrays(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x, y), k
