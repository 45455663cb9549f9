"""The converted folder's format: file names, config.json, and the nested-dict helpers
the other checkpoint modules share.

A converted folder holds:
  config.json        {"format": "asynclane-jax", "format_version": 1,
                      "model": <ModelConfig fields>, "hf_config": <original config.json or null>}
  params/            an orbax checkpoint of the parameters (nested dict of arrays)
  digests.json       a digest of every stored array (`integrity`)
  tokenizer files    tokenizer.json and friends, copied verbatim (optional)
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

from asynclane_jax.models import quantize as quantize_lib
from asynclane_jax.models.config import ConfigError, ModelConfig, show

FORMAT = "asynclane-jax"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# config.json's key for weights stored quantized ("int8": int8 kernels and their scales).
QUANTIZATION_KEY = "quantization"
# config.json's key for the layers whose stored int8 values are [..., out, in]
# (`Linear.int8_out_in`: q / k / v); a folder of int8 weights without it was written
# before that layout and is refused with a message saying how to make it again.
INT8_OUT_IN_KEY = "int8_out_in"
DIGESTS_FILE = "digests.json"
COMMIT_MARKER = "commit_success.txt"  # orbax's completion marker in params/
COMMIT_MARKER_TEXT = "Checkpoint commit was successful"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


class CheckpointError(ValueError):
    """A converted folder is missing, malformed, or does not match its config."""


def printable(path) -> str:
    """A path as text any terminal can show: bytes that were not UTF-8 (surrogate
    escapes) are written as backslash escapes instead of failing to print."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def read_json_object(path: pathlib.Path, what: str) -> dict:
    """A JSON file holding an object; CheckpointError (naming `what`) otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a valid {what}: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a valid {what}: not a JSON object")
    return data


def write_config(folder: pathlib.Path, cfg: ModelConfig, hf_config: dict | None,
                 extra: dict | None = None) -> None:
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": cfg.to_dict(),
            "hf_config": hf_config}
    if extra:
        data.update(extra)
    (folder / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_config_file(folder: pathlib.Path) -> tuple[ModelConfig, dict]:
    """Reads the config.json of a converted folder (a path; `registry.read_config` also
    takes a shipped name); returns (ModelConfig, the whole json)."""
    path = pathlib.Path(folder) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise CheckpointError(f"{path} is not a readable JSON file: {str(e)[:120]}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not an asynclane-jax config; if this is a Hugging Face "
            "snapshot, convert it first with `asynclane-jax convert SRC DST`")
    if data.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {show(data.get('format_version'))}; "
                              f"this asynclane-jax reads version {FORMAT_VERSION}")
    try:
        return ModelConfig.from_dict(data.get("model")), data
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def stored_quantization(data: dict) -> str | None:
    """The quantization a folder's weights are stored in (config.json's
    "quantization": "int8" when the converter or `save` wrote int8 kernels with their
    scales), None for float weights.

    Raises:
      CheckpointError for a value this version cannot read.
    """
    value = data.get(QUANTIZATION_KEY)
    if value is None:
        return None
    try:
        return quantize_lib.check_mode(value)
    except quantize_lib.QuantizeError:
        raise CheckpointError(f"config.json: {QUANTIZATION_KEY} {show(value)}; this "
                              f"asynclane-jax reads {', '.join(quantize_lib.MODES)}") from None


# --------------------------------------------------------------------------- nested dicts

def str_keys(tree):
    """A nested dict (or orbax metadata tree) with string keys throughout."""
    if isinstance(tree, Mapping):
        return {str(k): str_keys(v) for k, v in tree.items()}
    return tree


def restore_keys(tree, template):
    """Gives a restored dict the key types (ints for layer lists) of the template."""
    if isinstance(template, dict):
        return {k: restore_keys(tree[str(k)], v) for k, v in template.items()}
    return tree


def flat_arrays(tree, prefix: str = "") -> dict[str, Any]:
    """A nested dict of arrays as {"layers.0.attn.q_proj.kernel": array}: the names orbax
    gives the stored arrays, which key digests.json."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_arrays(v, name + "."))
        else:
            out[name] = v
    return out


def nest(flat: Mapping[str, Any]) -> dict:
    """{"a.b": x} -> {"a": {"b": x}}: the inverse of `flat_arrays`."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree
