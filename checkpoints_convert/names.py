"""Declarative name tables: Hugging Face tensor name -> NNX parameter path + transform.

One table per model family. A rule's source and target are templates in which `{i}`
stands for the block index; kernels are stored [in, out] in NNX, the transpose of a
torch Linear weight [out, in], hence the TRANSPOSE transform on every projection. A
source with `{e}` (LLaDA2's routed experts, one tensor per expert) fills slice e of a
target stacked along a leading expert axis: all E of them make one array per layer.

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
      source: HF tensor name; `{i}` is the block index, `{e}` an expert index.
      target: dotted NNX path; `{i}` is the same block index. With `{e}` in the source,
        the target's leading axis is the expert: the source fills slice e.
      transform: COPY, or TRANSPOSE for torch Linear weights ([out, in] -> [in, out]),
        applied to the source (to the slice, for a stacked target).
    """

    source: str
    target: str
    transform: str

    @property
    def regex(self) -> re.Pattern:
        return re.compile(re.escape(self.source).replace(r"\{i\}", r"(?P<i>\d+)")
                          .replace(r"\{e\}", r"(?P<e>\d+)"))

    @property
    def stacked(self) -> bool:
        return "{e}" in self.source

    def target_path(self, i: int | None) -> Path:
        return parse_path(self.target.format(i=i))

    def source_name(self, i: int | None, e: int | str | None = None) -> str:
        return self.source.format(i=i, e=e)


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

# LLaDA2 (llada2_moe, Ling-style names). Every layer has the fused query_key_value
# projection, the per-head query/key norms and the output projection `dense`; the first
# first_k_dense_replace layers a dense SwiGLU (mlp.gate_proj / up_proj / down_proj), the
# others a router (mlp.gate: weight [E, d] and the stored expert_bias [E]), the routed
# experts (mlp.experts.<e>.*, stacked here into one [E, ...] array per projection) and
# the shared expert (mlp.shared_experts.*). A layer's mlp.gate_proj and
# mlp.shared_experts.gate_proj never meet: the table maps each to the parameter its
# layer has, and `plan` refuses the other.
LLADA2: tuple[Rule, ...] = (
    Rule("model.word_embeddings.weight", "embed", COPY),
    Rule("model.norm.weight", "final_norm.scale", COPY),
    Rule("lm_head.weight", "lm_head.kernel", TRANSPOSE),
) + _block("model.layers", (
    ("input_layernorm.weight", "attn_norm.scale", COPY),
    ("attention.query_key_value.weight", "attn.qkv_proj.kernel", TRANSPOSE),
    ("attention.query_layernorm.weight", "attn.q_norm.scale", COPY),
    ("attention.key_layernorm.weight", "attn.k_norm.scale", COPY),
    ("attention.dense.weight", "attn.o_proj.kernel", TRANSPOSE),
    ("post_attention_layernorm.weight", "mlp_norm.scale", COPY),
    ("mlp.gate_proj.weight", "mlp.gate_proj.kernel", TRANSPOSE),
    ("mlp.up_proj.weight", "mlp.up_proj.kernel", TRANSPOSE),
    ("mlp.down_proj.weight", "mlp.down_proj.kernel", TRANSPOSE),
    ("mlp.gate.weight", "mlp.gate.kernel", TRANSPOSE),
    ("mlp.gate.expert_bias", "mlp.gate.expert_bias", COPY),
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.gate_proj", TRANSPOSE),
    ("mlp.experts.{e}.up_proj.weight", "mlp.experts.up_proj", TRANSPOSE),
    ("mlp.experts.{e}.down_proj.weight", "mlp.experts.down_proj", TRANSPOSE),
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate_proj.kernel", TRANSPOSE),
    ("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up_proj.kernel", TRANSPOSE),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down_proj.kernel", TRANSPOSE),
))

TABLES: dict[str, tuple[Rule, ...]] = {"llada": LLADA, "dream": DREAM, "llada2": LLADA2}

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


def _match(rules: Sequence[Rule], name: str):
    """(rule, block index or None, expert index or None) of a source name, or None."""
    for rule in rules:
        m = rule.regex.fullmatch(name)
        if m:
            groups = m.groupdict()
            return (rule, int(groups["i"]) if "i" in groups else None,
                    int(groups["e"]) if "e" in groups else None)
    return None


def sources_of(rule: Rule, i: int | None, shape: Sequence[int]) -> list[tuple[str, int | None]]:
    """The source names (with their expert index, or None) that fill a parameter of
    `shape` through `rule`: one, or one per expert of a stacked target."""
    if rule.stacked:
        return [(rule.source_name(i, e), e) for e in range(shape[0])]
    return [(rule.source_name(i), None)]


def slice_shape(rule: Rule, shape: Sequence[int]) -> tuple[int, ...]:
    """What one source fills of a parameter of `shape`: all of it, or one expert's slice."""
    return tuple(shape[1:]) if rule.stacked else tuple(shape)


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
        for name, _ in sources_of(rule, i, shape):
            out[name] = source_shape(rule.transform, slice_shape(rule, shape))
    return out


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Source tensor `source` fills parameter `target` after `transform` (with `index`,
    slice `index` of a target stacked along a leading axis of `n_stacked`)."""

    source: str
    target: Path
    transform: str
    shape: tuple[int, ...]  # what the source fills: the parameter's shape, or its slice's
    index: int | None = None
    n_stacked: int = 0

    @property
    def target_shape(self) -> tuple[int, ...]:
        return ((self.n_stacked,) + self.shape) if self.index is not None else self.shape


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
    filled: dict[tuple[Path, int | None], str] = {}
    out: dict[str, Assignment] = {}
    for name, shape in shapes.items():
        found = _match(rules, name)
        if found is None:
            if not (ignored_ok and any(p.fullmatch(name) for p in IGNORED)):
                unknown.append(name)
            continue
        rule, i, e = found
        target = rule.target_path(i)
        if target not in params or (e is not None and e >= params[target][0]):
            unexpected.append(f"{name} -> {path_str(target)}"
                              + (f"[{e}]" if e is not None else ""))
            continue
        if (target, e) in filled:
            dup.append(f"{name} and {filled[target, e]} -> {path_str(target)}")
            continue
        filled[target, e] = name
        part = slice_shape(rule, params[target])
        want = source_shape(rule.transform, part)
        if tuple(shape) != want:
            mismatched.append(f"{name} has shape {list(shape)}, the config needs {list(want)}")
            continue
        out[name] = Assignment(name, target, rule.transform, part, e,
                               params[target][0] if e is not None else 0)
    missing = []
    for path, shape in params.items():
        found = _rule_for_target(rules, path)
        if found is None:
            if (path, None) not in filled:
                missing.append(path_str(path))
            continue
        missing.extend(n for n, e in sources_of(found[0], found[1], shape)
                       if (path, e) not in filled)
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
