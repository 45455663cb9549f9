"""Merging a PEFT LoRA adapter into the base weights while they stream past.

A PEFT adapter folder holds adapter_config.json (r, lora_alpha, target_modules, ...) and
adapter_model.safetensors (or .bin) with keys such as
`base_model.model.model.transformer.blocks.3.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. The merged weight is W + s * B @ A with s = alpha / r
(alpha / sqrt(r) under rsLoRA), computed in float32 and cast once to the output dtype.
This is how the published D2F students (LoRA adapters over LLaDA / Dream) are run.
An adapter that targets an embedding-like layer (Dream's lm_head) also holds PEFT's copy
of that base weight, `...lm_head.base_layer.weight`; it is compared with the base
checkpoint's tensor and otherwise ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from asynclane_jax.models.config import is_int, is_real, show
from checkpoints_convert import reader
from checkpoints_convert.names import ConvertError

_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight")
# PEFT also saves the frozen base weight of a targeted output / input embedding layer
# (lm_head, embed_tokens) as `<module>.base_layer.weight`: a copy of the base checkpoint's
# tensor, checked against it, never merged.
_BASE_COPY = re.compile(r"base_model\.model\.(?P<module>.+)\.base_layer\.weight")


@dataclasses.dataclass(frozen=True)
class LoraPair:
    base: str  # the base tensor the pair updates, e.g. model.layers.0.self_attn.q_proj.weight
    a: reader.TensorInfo  # [r, in]
    b: reader.TensorInfo  # [out, r]
    scale: float
    base_copy: reader.TensorInfo | None = None  # PEFT's copy of the base weight, if saved


@dataclasses.dataclass
class LoraAdapter:
    folder: pathlib.Path
    config: dict
    pairs: dict[str, LoraPair]  # base tensor name -> pair
    kind: str  # "safetensors" or "bin"
    # The loaded adapter_model.bin (name -> torch tensor, memory-mapped where torch can):
    # a pickle cannot be read one tensor at a time, so it is loaded once, not per tensor.
    state: dict | None = dataclasses.field(default=None, repr=False)

    def delta(self, base: str) -> np.ndarray:
        """s * B @ A in float32, shaped like the base weight [out, in]."""
        pair = self.pairs[base]
        a, b = self._read(pair.a), self._read(pair.b)
        return np.float32(pair.scale) * (b.astype(np.float32) @ a.astype(np.float32))

    def merge(self, base: str, weight: np.ndarray) -> np.ndarray:
        """The merged weight in float32.

        Raises:
          ConvertError if the adapter holds a copy of this base weight (PEFT's
          `base_layer.weight`) that differs from `weight`: it was trained over another base.
        """
        copy = self.pairs[base].base_copy
        if copy is not None:
            _check_base_copy(base, weight, self._read(copy))
        return weight.astype(np.float32) + self.delta(base)

    def _read(self, info: reader.TensorInfo) -> np.ndarray:
        if self.kind == "safetensors":
            with open(info.shard, "rb") as f:
                return reader.read_at(f, info)
        return reader.torch_to_numpy(self.state[info.name])

    def summary(self) -> dict:
        c = self.config
        return {"path": str(self.folder), "r": c.get("r"), "lora_alpha": c.get("lora_alpha"),
                "use_rslora": bool(c.get("use_rslora")), "merged_tensors": len(self.pairs),
                "base_model_name_or_path": c.get("base_model_name_or_path")}


def _check_base_copy(base: str, weight: np.ndarray, copy: np.ndarray) -> None:
    # Equal up to the rounding of the coarser of the two dtypes: a float32 base may have
    # been trained over in bfloat16, and the copy saved in that dtype.
    eps = max(float(ml_dtypes.finfo(weight.dtype).eps), float(ml_dtypes.finfo(copy.dtype).eps))
    w, c = weight.astype(np.float32), copy.astype(np.float32)
    if w.shape != c.shape or not np.all(np.abs(w - c) <= eps * np.abs(w)):
        raise ConvertError(f"the LoRA adapter's copy of {base} (base_layer.weight) differs "
                           "from the checkpoint's: the adapter was trained over another base "
                           "model; nothing was written")


def _valid_regex(pattern) -> bool:
    try:
        re.compile(pattern)
    except (re.error, TypeError, RecursionError, OverflowError):
        return False
    return True


def _pattern_problems(config: Mapping) -> list[str]:
    """What is wrong with an adapter's target_modules, rank_pattern and alpha_pattern:
    targets are a regex string or a list of module-name suffixes; the patterns map
    module-name regexes to positive integer ranks / finite positive alphas."""
    problems = []
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if not _valid_regex(targets):
            problems.append(f"target_modules={show(targets)} (not a valid regular expression)")
    elif targets is not None and not (isinstance(targets, list)
                                      and all(isinstance(t, str) and t for t in targets)):
        problems.append(f"target_modules={show(targets)} (need a regular expression or a "
                        "list of module names)")
    for key, check, need in (("rank_pattern", lambda v: is_int(v) and v > 0,
                              "positive integer ranks"),
                             ("alpha_pattern", lambda v: is_real(v) and v > 0,
                              "finite positive alphas")):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            problems.append(f"{key}={show(patterns)} (need an object of module patterns)")
            continue
        bad = [f"{show(k)}: {show(v)}" for k, v in patterns.items()
               if not _valid_regex(rf"(.*\.)?{k}") or not check(v)]
        if bad:
            problems.append(f"{key} entries {', '.join(bad[:4])} (need valid module "
                            f"patterns with {need})")
    return problems


def _pattern_value(patterns: Mapping[str, float] | None, module: str, default):
    # PEFT keys rank_pattern / alpha_pattern by a module-name suffix (or regex).
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def load_adapter(folder: str | pathlib.Path) -> LoraAdapter:
    """Reads and validates a PEFT LoRA adapter folder.

    Safetensors data is read later, tensor by tensor; an adapter_model.bin is loaded
    once here and kept (memory-mapped where torch can) for the merge.

    Raises:
      ConvertError for a missing folder or file, an unsupported adapter variant (DoRA,
      activated LoRA, trained biases, modules_to_save, non-LoRA PEFT types), or unpaired
      tensors.
    """
    folder = reader.user_path(folder)
    try:
        is_dir = folder.is_dir()
    except OSError as e:  # a name too long for the OS, ...
        raise ConvertError(f"LoRA adapter folder {show(str(folder))}: {e.strerror or e}") from None
    if not is_dir:
        raise ConvertError(f"LoRA adapter folder {folder} does not exist")
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"no adapter_config.json in {folder}; expected a PEFT LoRA adapter")
    try:
        config = json.loads(cfg_path.read_text())
        assert isinstance(config, dict)
    except Exception:
        raise ConvertError(f"{cfg_path} is not a valid JSON object") from None
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (only LORA is supported)")
    if config.get("use_dora"):
        problems.append("use_dora=true (DoRA is not supported)")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out=true (Conv1D-style layers are not supported)")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config.get('bias')!r} (only 'none' is supported)")
    if config.get("alora_invocation_tokens") is not None:
        # Activated LoRA applies only after its invocation tokens appear; merged into the
        # weights it would apply everywhere (PEFT refuses to merge it too).
        problems.append(f"alora_invocation_tokens={config.get('alora_invocation_tokens')} "
                        "(activated LoRA cannot be merged into the weights)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config.get('modules_to_save')} (fully trained "
                        "extra modules are not supported)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not is_int(r) or r <= 0:
        problems.append(f"r={show(r)} (need a positive integer rank)")
    if not is_real(alpha) or alpha <= 0:
        problems.append(f"lora_alpha={show(alpha)} (need a finite positive number)")
    if not isinstance(config.get("use_rslora", False), bool):
        problems.append(f"use_rslora={show(config.get('use_rslora'))} (need true or false)")
    problems += _pattern_problems(config)
    if problems:
        raise ConvertError(f"unsupported LoRA adapter {folder}: " + "; ".join(problems))

    state = None
    if (folder / "adapter_model.safetensors").is_file():
        kind, path = "safetensors", folder / "adapter_model.safetensors"
        infos = reader.read_safetensors_header(path)
    elif (folder / "adapter_model.bin").is_file():
        kind, path = "bin", folder / "adapter_model.bin"
        state = reader.torch_load(path)
        infos = reader.bin_infos(path, state)
    else:
        raise ConvertError(f"no adapter_model.safetensors or adapter_model.bin in {folder}")

    halves: dict[str, dict[str, reader.TensorInfo]] = {}
    copies: dict[str, reader.TensorInfo] = {}
    unknown = []
    for info in infos:
        m = _KEY.fullmatch(info.name)
        if m is not None:
            halves.setdefault(m["module"], {})[m["ab"]] = info
        elif (c := _BASE_COPY.fullmatch(info.name)) is not None:
            copies[c["module"]] = info
        else:
            unknown.append(info.name)
    # A base copy is only expected beside a LoRA pair on the same module.
    unknown += sorted(info.name for module, info in copies.items() if module not in halves)
    unpaired = sorted(mod for mod, h in halves.items() if set(h) != {"A", "B"})
    if unknown or unpaired:
        raise ConvertError(
            f"LoRA adapter {folder}: " + "; ".join(filter(None, [
                unknown and f"{len(unknown)} tensors that are not lora_A/lora_B weights "
                            f"({', '.join(unknown[:6])})",
                unpaired and f"{len(unpaired)} modules lacking lora_A or lora_B "
                             f"({', '.join(unpaired[:6])})"])))
    pairs, wrong_rank = {}, []
    for module, h in halves.items():
        rank = _pattern_value(config.get("rank_pattern"), module, r)
        a_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
        scale = a_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        if (len(h["A"].shape) != 2 or h["A"].shape[0] != rank or len(h["B"].shape) != 2
                or h["B"].shape[1] != rank):
            wrong_rank.append(f"{module} (A {list(h['A'].shape)}, B {list(h['B'].shape)}, "
                              f"rank {rank})")
        if not math.isfinite(scale) or scale <= 0:
            wrong_rank.append(f"{module} (scale alpha/r = {scale})")
        pairs[f"{module}.weight"] = LoraPair(f"{module}.weight", h["A"], h["B"], float(scale),
                                             copies.get(module))
    if wrong_rank:
        raise ConvertError(f"LoRA adapter {folder}: {len(wrong_rank)} modules whose tensors "
                           "do not have the rank adapter_config.json gives them: "
                           + "; ".join(wrong_rank[:4]))
    return LoraAdapter(folder, config, pairs, kind, state)


def check_against(adapter: LoraAdapter, base_shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """Problems between the adapter and the base checkpoint (all of them, not the first)."""
    problems = []
    for base, pair in sorted(adapter.pairs.items()):
        if base not in base_shapes:
            problems.append(f"LoRA pair for {base}, which the base checkpoint does not have")
            continue
        shape = tuple(base_shapes[base])
        rank = pair.a.shape[0] if len(pair.a.shape) == 2 else -1
        if (len(shape) != 2 or len(pair.a.shape) != 2 or len(pair.b.shape) != 2
                or pair.b.shape != (shape[0], rank) or pair.a.shape != (rank, shape[1])):
            problems.append(f"LoRA shapes for {base}: A {list(pair.a.shape)}, B "
                            f"{list(pair.b.shape)} do not fit the weight {list(shape)}")
        if pair.base_copy is not None and pair.base_copy.shape != shape:
            problems.append(f"the adapter's copy of {base} (base_layer.weight) has shape "
                            f"{list(pair.base_copy.shape)}, the checkpoint's {list(shape)}")
    return problems
