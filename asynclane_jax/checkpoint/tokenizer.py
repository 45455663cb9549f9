"""A converted folder's tokenizer files: copied by the converter, read by `load`."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

from asynclane_jax.checkpoint.format import TOKENIZER_FILES, CheckpointError, read_json_object
from asynclane_jax.checkpoint.registry import resolve


def copy_tokenizer_files(src: pathlib.Path, dst: pathlib.Path) -> list[str]:
    """Copies the tokenizer files of `src` that exist into `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def check_chat_template(template: str, where) -> None:
    """Raises CheckpointError for a chat template that is not valid Jinja (it would
    otherwise fail only when `--chat` first uses it)."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError:  # transformers needs it to apply templates at all
        return

    class Generation(jinja2.ext.Extension):
        # transformers' {% generation %} ... {% endgeneration %} (assistant-token masks)
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body)

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, Generation])
    try:
        env.parse(template)
    except jinja2.TemplateError as e:
        raise CheckpointError(f"the chat template of {where} is not valid Jinja: "
                              f"{str(e)[:120]}") from None


def _tokenizer_kwargs(folder: pathlib.Path) -> dict[str, Any]:
    """Special tokens and the chat template, from tokenizer_config.json or
    chat_template.jinja (the template checked)."""
    kwargs: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        tok_cfg = read_json_object(cfg_path, "tokenizer config")
        for key in ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token"):
            tok = tok_cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                kwargs[key] = tok
        if isinstance(tok_cfg.get("chat_template"), str):
            kwargs["chat_template"] = tok_cfg["chat_template"]
    template = folder / "chat_template.jinja"
    if "chat_template" not in kwargs and template.is_file():
        try:
            kwargs["chat_template"] = template.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{template} is not a readable chat template: "
                                  f"{str(e)[:120]}") from None
    if "chat_template" in kwargs:
        check_chat_template(kwargs["chat_template"], folder)
    return kwargs


def load_tokenizer(folder: str | os.PathLike):
    """The folder's tokenizer as a transformers PreTrainedTokenizerFast, or None.

    Never executes code from the folder (no trust_remote_code).

    Raises:
      CheckpointError for a tokenizer.json, tokenizer_config.json or chat template that
      cannot be read.
    """
    folder = resolve(folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    kwargs = _tokenizer_kwargs(folder)
    tok_path = folder / "tokenizer.json"
    read_json_object(tok_path, "tokenizer")  # a clear message for what is not JSON
    try:
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_path), **kwargs)
    except Exception as e:  # the tokenizers library's parse errors have no common type
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{tok_path} is not a valid tokenizer: {first[:160]}") from None
