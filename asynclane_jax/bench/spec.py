"""Sampler specs of `asynclane-jax bench`: the grammar, the defaults, validation.

A spec is `NAME` or `NAME:key=value:key=value`; a value reads as JSON when it parses
(0.8, true) and as a string otherwise. A value may list alternatives with `|`
(`fast-dllm:cache=prefix|dual`): every combination is run and the spec's row reports the
fastest one (highest tokens/s), with the options it used. Options a spec leaves out are
filled from the sampler's `bench_defaults` (its schedule class declares them: the block
samplers with a cache run `cache=prefix|dual`, the faster of the two). `SPEC@MODEL` runs
that spec on another model of the same vocabulary, e.g. `d2f@tiny-llada-d2f`: D2F on its
block-causal student beside the samplers on --model.
"""

from __future__ import annotations

import itertools

from asynclane_jax.errors import UsageError

# The (c) specs (bench.compare): the baselines given the footing options of the sampler
# under study (its cascade, with early stop; its threshold beside the baseline's
# published one, the faster reported).
EQUAL_FOOTING = "cascade=true:early_stop=true:threshold=0.9|0.95"
DEFAULT_SAMPLERS = ("vanilla", "fast-dllm", "localleap", "fast-dllm:early_stop=true",
                    "localleap:early_stop=true", f"fast-dllm:{EQUAL_FOOTING}",
                    f"localleap:{EQUAL_FOOTING}", "asynclane")
DEFAULT_GEN_LENGTHS = (128, 256, 512)


def default_specs() -> list[str]:
    """DEFAULT_SAMPLERS, those whose sampler is registered."""
    from asynclane_jax.decoding.registry import samplers

    return [s for s in DEFAULT_SAMPLERS if s.split(":")[0] in samplers()]


def schedule_class(name: str):
    """The registered schedule class of a sampler name, or None when there is none (a
    spec naming it fails in `validate`; a results file may name a sampler since gone)."""
    from asynclane_jax.decoding.registry import get_schedule_class
    from asynclane_jax.decoding.schedule import SamplerError

    try:
        return get_schedule_class(name)
    except SamplerError:
        return None


def split_model(spec: str) -> tuple[str, str | None]:
    """`SPEC@MODEL` -> (SPEC, MODEL): the variant runs on another model (e.g. d2f on
    the D2F student `d2f@tiny-llada-d2f`); plain SPEC -> (SPEC, None)."""
    base, at, other = spec.partition("@")
    if at and not other.strip():
        raise UsageError(f"sampler spec {spec!r}: no model name after '@'")
    return base, (other.strip() or None)


def sampler_of(spec: str) -> str:
    """The sampler name of a spec (`fast-dllm:cache=dual@m` -> `fast-dllm`)."""
    return split_model(spec)[0].split(":")[0].strip()


def parse_spec(spec: str) -> tuple[str, list[dict]]:
    """Reads a sampler spec.

    Args:
      spec: `NAME` or `NAME:key=value:...`; a value may list alternatives with `|`.
    Returns:
      (sampler name, one options dict per combination of alternatives, in order).
      The sampler's `bench_defaults` are filled in for the keys the spec leaves out.
    Raises:
      UsageError: an empty name, a part without `=`, a key given twice, an empty
        alternative.
    """
    from asynclane_jax.decoding.registry import parse_options

    name, *parts = spec.strip().split(":")
    name = name.strip()
    if not name:
        raise UsageError(f"sampler spec {spec!r}: no sampler name")
    choices: dict[str, list] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"sampler spec {spec!r}: {part!r} is not key=value")
        if key in choices:
            raise UsageError(f"sampler spec {spec!r}: option {key!r} given twice")
        alts = value.split("|")
        if any(not a.strip() for a in alts):
            raise UsageError(f"sampler spec {spec!r}: {part!r} has an empty value")
        choices[key] = [parse_options([f"{key}={a.strip()}"])[key] for a in alts]
    cls = schedule_class(name)
    for default in (cls.bench_defaults if cls is not None else ()):
        key, _, value = default.partition("=")
        if key not in choices:
            choices[key] = [parse_options([f"{key}={a}"])[key] for a in value.split("|")]
    keys = list(choices)
    return name, [dict(zip(keys, combo)) for combo in itertools.product(*choices.values())]


def _check_types(name: str, options: dict) -> None:
    """An option value of the wrong type is a one-line error (e.g. threshold=high)."""
    from asynclane_jax.decoding.registry import get_schedule_class, option_fields, option_type

    cls = get_schedule_class(name)
    fields = option_fields(cls)
    for key, value in options.items():
        if key not in fields or value is None:
            continue  # unknown options are reported by the schedule itself
        typ = option_type(cls, key)
        if typ is bool:
            ok = isinstance(value, bool)
        elif typ is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, typ) and not isinstance(value, bool)
        if not ok:
            raise UsageError(f"{name}: option {key}={value!r} is not a {typ.__name__}")


def validate(specs, gen_lengths) -> list[tuple[str, str, list[dict]]]:
    """Parses every spec and builds every schedule it asks for at every generation
    length, so that a bad name or option fails before any decoding.

    Returns:
      [(spec, sampler name, options per variant)].
    """
    from asynclane_jax.decoding.api import make_schedule

    if not specs:
        raise UsageError("no samplers given")
    if len(set(specs)) != len(specs):
        raise UsageError(f"a sampler spec is given twice: {list(specs)}")
    for g in gen_lengths:
        if g <= 0:
            raise UsageError(f"gen length {g}: must be a positive number of tokens")
    parsed = []
    for spec in specs:
        name, variants = parse_spec(split_model(spec)[0])
        for opts in variants:
            _check_types(name, opts)
            for g in gen_lengths:
                make_schedule(name, gen_length=g, **opts)
        parsed.append((spec, name, variants))
    return parsed
