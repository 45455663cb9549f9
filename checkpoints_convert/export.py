"""The way back: a model's parameters under their Hugging Face tensor names, and a
fine-tuned model as a PEFT LoRA adapter over its base.

`hf_tensors` inverts the family's name table (torch layout: projection weights
[out, in]). `write_lora_adapter` writes `tuned - base` as an exact LoRA adapter: each
changed projection weight's difference is factored by SVD at its full rank (alpha equal
to the rank, so PEFT's scale is 1), which `asynclane-jax convert --lora` merges back.
This is the form published D2F students take; a student distilled here
(`asynclane_jax.testbed.distill`) changes only projection kernels, so it round-trips.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from flax import nnx

from checkpoints_convert.names import (
    TABLES,
    ConvertError,
    _rule_for_target,
    apply_transform,
    sources_of,
)


def hf_tensors(model) -> dict[str, np.ndarray]:
    """Every parameter of `model` as float32 numpy under its Hugging Face name."""
    rules = TABLES[model.cfg.family]
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
        path = tuple(k.key for k in keys)
        found = _rule_for_target(rules, path)
        if found is None:
            raise ConvertError(f"no {model.cfg.family} tensor name for parameter {path}")
        rule, i = found
        array = np.asarray(leaf, np.float32)
        for name, e in sources_of(rule, i, array.shape):  # a stacked one: one per expert
            out[name] = np.ascontiguousarray(
                apply_transform(rule.transform, array if e is None else array[e]))
    return out


def write_lora_adapter(tuned, base, folder, *, base_model: str = "") -> dict:
    """Writes tuned - base as a PEFT LoRA adapter folder (adapter_config.json and
    adapter_model.safetensors); returns the adapter config.

    Raises:
      ConvertError when the models differ in structure, or anywhere a LoRA adapter
      cannot carry (embeddings, norms, biases, the output head).
    """
    from safetensors.numpy import save_file

    if tuned.cfg.replace(block_causal=False) != base.cfg.replace(block_causal=False):
        raise ConvertError("the tuned model and the base have different configs")
    t, b = hf_tensors(tuned), hf_tensors(base)
    head = {"llada": "model.transformer.ff_out.weight", "dream": "lm_head.weight"}[
        base.cfg.family]
    tensors, ranks, problems = {}, {}, []
    for name, w in b.items():
        delta = t[name].astype(np.float64) - w.astype(np.float64)
        if not np.any(delta):
            continue
        if delta.ndim != 2 or not name.endswith(".weight") or name == head or (
                "embed" in name or ".wte." in name):
            problems.append(name)
            continue
        u, s, vt = np.linalg.svd(delta, full_matrices=False)
        module = name[: -len(".weight")]
        root = np.sqrt(s)
        tensors[f"base_model.model.{module}.lora_A.weight"] = (root[:, None] * vt).astype(
            np.float32)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (u * root[None, :]).astype(
            np.float32)
        ranks[module] = len(s)
    if problems:
        raise ConvertError(f"a LoRA adapter cannot carry changes to {len(problems)} tensor(s) "
                           f"({', '.join(problems[:4])}{', ...' if len(problems) > 4 else ''})")
    if not tensors:
        raise ConvertError("the tuned model equals the base: nothing to write")
    r = max(ranks.values())
    config = {
        "peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": sorted(ranks),
        "rank_pattern": {m: k for m, k in ranks.items() if k != r},
        "alpha_pattern": {m: k for m, k in ranks.items() if k != r},
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "modules_to_save": None, "task_type": "CAUSAL_LM", "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": base_model}
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


__all__ = ["hf_tensors", "write_lora_adapter"]
