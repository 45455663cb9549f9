"""The sampler registry: discovery, options and their help.

A sampler is a concrete `Schedule` subclass that sets `name`. Each module of the
decoding package is imported once on first use, so a new sampler file is found without
being listed anywhere; two classes under one name are an error naming both. A
sampler's options are its dataclass fields (less its `structural` ones), their defaults
the fields' defaults, their help the `Attributes:` sections of its docstrings, and
their types the fields' annotations: the CLI flags, the bench specs and `generate`'s
keyword options all come from here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import pkgutil
import re
import typing

from asynclane_jax.decoding.schedule import SamplerError, Schedule

# The sampler `generate`, the CLI and `aot` use when none is named: AsyncLane at its
# defaults.
DEFAULT_SAMPLER = "asynclane"


@functools.cache
def _import_sampler_modules() -> None:
    """Imports each module of the decoding package once, so a new sampler file registers
    itself without being listed anywhere."""
    # The package's folder, read without importing the package (which imports this).
    for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
        importlib.import_module(f"{__package__}.{mod.name}")


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def samplers() -> dict[str, type[Schedule]]:
    """Every registered sampler by name (the classes that set `name` themselves).

    Raises:
      SamplerError: two classes register one name.
    """
    _import_sampler_modules()
    found: dict[str, type[Schedule]] = {}
    for cls in _subclasses(Schedule):
        name = cls.__dict__.get("name")
        if name is None:
            continue
        other = found.get(name)
        if other is not None and other is not cls:
            raise SamplerError(
                f"sampler name {name!r} is registered twice: by "
                f"{other.__module__}.{other.__qualname__} and by "
                f"{cls.__module__}.{cls.__qualname__}; give one of them another name")
        found[name] = cls
    return dict(sorted(found.items()))


def get_schedule_class(name: str) -> type[Schedule]:
    found = samplers()
    if name not in found:
        raise SamplerError(f"unknown sampler {name!r}; available: {sorted(found)}")
    return found[name]


def option_fields(cls: type[Schedule]) -> dict[str, dataclasses.Field]:
    """The user options of a schedule class: its fields except the structural ones."""
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in cls.structural}


def build(sampler: str | type[Schedule], *, gen_length: int, **options) -> Schedule:
    """Builds and validates a schedule from user options (defaults filled in).

    Raises:
      SamplerError: an unknown sampler or option, or a value the schedule refuses.
    """
    cls = get_schedule_class(sampler) if isinstance(sampler, str) else sampler
    fields = option_fields(cls)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise SamplerError(
            f"{cls.name}: unknown option(s) {unknown}; accepted: {sorted(fields)}")
    try:
        return cls(gen_length=gen_length, **options)
    except TypeError as e:
        raise SamplerError(f"{cls.name}: {e}") from None


def option_docs(cls: type) -> dict[str, str]:
    """Field -> help text, from the `Attributes:` sections of the class and its bases
    (the nearest definition wins). A section is `Attributes...:` followed by lines
    `name: text` at one indentation, continued by deeper-indented lines."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        lines = (klass.__dict__.get("__doc__") or "").splitlines()
        heads = [i for i, line in enumerate(lines) if line.strip().startswith("Attributes")]
        if not heads:
            continue
        base, current = None, None
        for line in lines[heads[0] + 1:]:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            base = indent if base is None else base
            m = re.match(r"(\w+):\s*(.*)$", line.strip())
            if indent < base:
                break
            if indent == base and m:
                current = m.group(1)
                docs[current] = m.group(2)
            elif indent > base and current:
                docs[current] += " " + line.strip()
    return docs


def parse_options(pairs) -> dict:
    """Sampler options from KEY=VALUE strings (command lines); a value that reads as
    JSON (0.9, true, null) is taken as such, anything else as a string."""
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def option_type(cls: type, name: str):
    """The scalar Python type of a field (int, float, str or bool), optional or not."""
    hints = typing.get_type_hints(cls)
    hint = hints[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def convert_option(cls: type[Schedule], name: str, text: str):
    """A command-line value of one option, read as that sampler's field type (so two
    samplers may give one option name different types).

    Raises:
      SamplerError: the sampler has no such option, or the text is not of its type.
    """
    fields = option_fields(cls)
    if name not in fields:
        others = [s for s, c in samplers().items() if name in option_fields(c)]
        raise SamplerError(f"--{name.replace('_', '-')} is not an option of {cls.name} "
                           f"(it is of {', '.join(others) or 'no sampler'}); "
                           f"{cls.name} accepts: {sorted(fields)}")
    typ = option_type(cls, name)
    if typ is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    else:
        try:
            return typ(text)
        except (TypeError, ValueError):
            pass
    raise SamplerError(f"{cls.name}: --{name.replace('_', '-')} {text!r} is not "
                       f"a{'n' if typ is int else ''} {typ.__name__}")
