"""Declarative name tables: Hugging Face tensor name -> NNX parameter path + transform.

One table per model family. A rule's source and target are templates in which `{i}`
stands for the block index; kernels are stored [in, out] in NNX, the transpose of a
torch Linear weight [out, in], hence the TRANSPOSE transform on every projection.

`plan` checks a checkpoint's whole tensor listing against the model the config
describes before anything is read or written: every source tensor must be used
exactly once and every parameter filled exactly once. All problems (unknown,
unexpected, duplicated, mis-shaped and missing tensors) are collected into one error.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence

import jax
from flax import nnx

from asynclane_jax.checkpoint import CheckpointError
from asynclane_jax.models.config import ModelConfig
from asynclane_jax.models.model import abstract_model

COPY = "copy"
TRANSPOSE = "transpose"

Path = tuple  # an NNX parameter path, e.g. ("layers", 3, "attn", "q_proj", "kernel")


class ConvertError(CheckpointError):
    """A source checkpoint cannot be converted; the message says what and why."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Hugging Face tensor name pattern and the NNX parameter it fills.

    Attributes:
      source: HF tensor name; `{i}` is the block index.
      target: dotted NNX path; `{i}` is the same block index.
      transform: COPY, or TRANSPOSE for torch Linear weights ([out, in] -> [in, out]).
    """

    source: str
    target: str
    transform: str

    @property
    def regex(self) -> re.Pattern:
        return re.compile(re.escape(self.source).replace(r"\{i\}", r"(?P<i>\d+)"))

    def target_path(self, i: int | None) -> Path:
        return parse_path(self.target.format(i=i))

    def source_name(self, i: int | None) -> str:
        return self.source.format(i=i)


def _block(prefix: str, pairs: Sequence[tuple[str, str, str]]) -> tuple[Rule, ...]:
    return tuple(Rule(f"{prefix}.{{i}}.{src}", f"layers.{{i}}.{dst}", tf) for src, dst, tf in pairs)


# LLaDA (OLMo-style names). The MLP is ff_out(silu(ff_proj(x)) * up_proj(x)): ff_proj is
# the gate. The top-level ff_out is the untied output head; the per-block ff_out is the
# MLP's down projection.
LLADA: tuple[Rule, ...] = (
    Rule("model.transformer.wte.weight", "embed", COPY),
    Rule("model.transformer.ln_f.weight", "final_norm.scale", COPY),
    Rule("model.transformer.ff_out.weight", "lm_head.kernel", TRANSPOSE),
) + _block("model.transformer.blocks", (
    ("attn_norm.weight", "attn_norm.scale", COPY),
    ("q_proj.weight", "attn.q_proj.kernel", TRANSPOSE),
    ("k_proj.weight", "attn.k_proj.kernel", TRANSPOSE),
    ("v_proj.weight", "attn.v_proj.kernel", TRANSPOSE),
    ("q_proj.bias", "attn.q_proj.bias", COPY),  # only with include_qkv_bias
    ("k_proj.bias", "attn.k_proj.bias", COPY),
    ("v_proj.bias", "attn.v_proj.bias", COPY),
    ("attn_out.weight", "attn.o_proj.kernel", TRANSPOSE),
    ("ff_norm.weight", "mlp_norm.scale", COPY),
    ("ff_proj.weight", "mlp.gate_proj.kernel", TRANSPOSE),
    ("up_proj.weight", "mlp.up_proj.kernel", TRANSPOSE),
    ("ff_out.weight", "mlp.down_proj.kernel", TRANSPOSE),
))

# Dream (Qwen2 names).
DREAM: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", "embed", COPY),
    Rule("model.norm.weight", "final_norm.scale", COPY),
    Rule("lm_head.weight", "lm_head.kernel", TRANSPOSE),
) + _block("model.layers", (
    ("input_layernorm.weight", "attn_norm.scale", COPY),
    ("self_attn.q_proj.weight", "attn.q_proj.kernel", TRANSPOSE),
    ("self_attn.k_proj.weight", "attn.k_proj.kernel", TRANSPOSE),
    ("self_attn.v_proj.weight", "attn.v_proj.kernel", TRANSPOSE),
    ("self_attn.q_proj.bias", "attn.q_proj.bias", COPY),
    ("self_attn.k_proj.bias", "attn.k_proj.bias", COPY),
    ("self_attn.v_proj.bias", "attn.v_proj.bias", COPY),
    ("self_attn.o_proj.weight", "attn.o_proj.kernel", TRANSPOSE),
    ("post_attention_layernorm.weight", "mlp_norm.scale", COPY),
    ("mlp.gate_proj.weight", "mlp.gate_proj.kernel", TRANSPOSE),
    ("mlp.up_proj.weight", "mlp.up_proj.kernel", TRANSPOSE),
    ("mlp.down_proj.weight", "mlp.down_proj.kernel", TRANSPOSE),
))

TABLES: dict[str, tuple[Rule, ...]] = {"llada": LLADA, "dream": DREAM}

# Buffers some checkpoints carry that are recomputed, not learned (old .bin exports of
# Qwen2/Llama saved RoPE's inverse frequencies). They are consumed and dropped.
IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq"),)


def parse_path(dotted: str) -> Path:
    return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def path_str(path: Path) -> str:
    return ".".join(str(p) for p in path)


@functools.lru_cache(maxsize=8)
def _param_shapes(cfg: ModelConfig) -> tuple[tuple[Path, tuple[int, ...]], ...]:
    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    flat, _ = jax.tree_util.tree_flatten_with_path(pure)
    return tuple((tuple(k.key for k in keys), tuple(leaf.shape)) for keys, leaf in flat)


def param_shapes(cfg: ModelConfig) -> dict[Path, tuple[int, ...]]:
    """Every parameter of the model `cfg` describes, with its shape (no memory used)."""
    return dict(_param_shapes(cfg))


def source_shape(transform: str, target_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(reversed(target_shape)) if transform == TRANSPOSE else tuple(target_shape)


def apply_transform(transform: str, array):
    """Source array -> parameter array layout (numpy or torch-free)."""
    return array.T if transform == TRANSPOSE else array


def _match(rules: Sequence[Rule], name: str) -> tuple[Rule, int | None] | None:
    for rule in rules:
        m = rule.regex.fullmatch(name)
        if m:
            return rule, (int(m.group("i")) if "i" in m.groupdict() else None)
    return None


def _rule_for_target(rules: Sequence[Rule], path: Path) -> tuple[Rule, int | None] | None:
    dotted = path_str(path)
    for rule in rules:
        pattern = re.escape(rule.target).replace(r"\{i\}", r"(?P<i>\d+)")
        m = re.fullmatch(pattern, dotted)
        if m:
            return rule, (int(m.group("i")) if "i" in m.groupdict() else None)
    return None


def expected_sources(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors (name -> torch shape) a checkpoint of `cfg` must hold.

    Derived from the model's abstract parameter shapes through the family's table.
    """
    rules = TABLES[cfg.family]
    out = {}
    for path, shape in param_shapes(cfg).items():
        found = _rule_for_target(rules, path)
        if found is None:
            raise ConvertError(f"the {cfg.family} name table has no rule for parameter "
                               f"{path_str(path)}")
        rule, i = found
        out[rule.source_name(i)] = source_shape(rule.transform, shape)
    return out


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Source tensor `source` fills parameter `target` after `transform`."""

    source: str
    target: Path
    transform: str
    shape: tuple[int, ...]  # the parameter's shape


def _listing(label: str, items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{len(items)} {label} ({shown}{more})"


def plan(cfg: ModelConfig, shapes: Mapping[str, Sequence[int]], *,
         duplicates: Sequence[str] = (), ignored_ok: bool = True) -> dict[str, Assignment]:
    """Matches a checkpoint's tensor listing against the model of `cfg`.

    Args:
      cfg: the model config.
      shapes: source tensor name -> shape (as stored, torch layout).
      duplicates: names the reader found more than once (in several shards).
      ignored_ok: drop known non-parameter buffers (RoPE inv_freq) silently.
    Returns:
      source name -> Assignment, for every source tensor that fills a parameter.
    Raises:
      ConvertError listing every unknown, unexpected, duplicated, mis-shaped and missing
      tensor at once.
    """
    rules = TABLES[cfg.family]
    params = param_shapes(cfg)
    unknown, unexpected, mismatched, dup = [], [], [], [f"{n}" for n in duplicates]
    filled: dict[Path, str] = {}
    out: dict[str, Assignment] = {}
    for name, shape in shapes.items():
        found = _match(rules, name)
        if found is None:
            if not (ignored_ok and any(p.fullmatch(name) for p in IGNORED)):
                unknown.append(name)
            continue
        rule, i = found
        target = rule.target_path(i)
        if target not in params:
            unexpected.append(f"{name} -> {path_str(target)}")
            continue
        if target in filled:
            dup.append(f"{name} and {filled[target]} -> {path_str(target)}")
            continue
        filled[target] = name
        want = source_shape(rule.transform, params[target])
        if tuple(shape) != want:
            mismatched.append(f"{name} has shape {list(shape)}, the config needs {list(want)}")
            continue
        out[name] = Assignment(name, target, rule.transform, params[target])
    missing = []
    for path in params:
        if path not in filled:
            found = _rule_for_target(rules, path)
            missing.append(found[0].source_name(found[1]) if found else path_str(path))
    problems = []
    if unknown:
        problems.append(_listing("unknown tensors", unknown))
    if unexpected:
        problems.append(_listing("tensors the config has no parameter for", unexpected))
    if dup:
        problems.append(_listing("duplicated tensors", dup))
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched, limit=4))
    if missing:
        problems.append(_listing("missing tensors", missing))
    if problems:
        raise ConvertError(f"the checkpoint does not match its {cfg.family} config "
                           f"({cfg.n_layers} layers, d_model={cfg.d_model}): "
                           + "; ".join(problems))
    return out
