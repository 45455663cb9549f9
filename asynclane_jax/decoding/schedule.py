"""What a sampler is to the decode driver: a schedule that plans calls and reads logits.

A schedule is a frozen, hashable dataclass; its fields are static settings, part of the
compiled program. Each iteration of the driver's one `lax.while_loop`:

  1. `plan(ctx, canvas, state, live) -> Plan`: per row a fixed number Q of canvas
     columns to query (padded with T, an index that is dropped), whether the call is a
     full forward over the whole canvas, which rows the call serves, and optionally how
     much of the canvas the call may attend to (`first_plan` may ask for one first call
     of another query count);
  2. the driver makes the model call (full, or cached against the K/V of the whole
     canvas) and keeps the cache, counters and rng;
  3. `update(ctx, canvas, state, out, key) -> (canvas, state)`: commits anywhere on
     the canvas from the logits and advances the schedule's own state;
  4. `done(ctx, canvas, state) -> [b]`: rows that are finished (never served again).

Dream's logit shift lives in one place, `CallOutput`: the output at column q predicts
column q + shift, for full and cached calls alike. A schedule that wants logits for
column c plans the query c - shift and reads them back with `CallOutput.at`.

Registry: a subclass that sets `name` registers itself; options, their defaults and
their help (the CLI's included) come from its dataclass fields and the `Attributes:`
sections of its docstrings, so adding a sampler touches one file.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import pkgutil
import re
import typing
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from asynclane_jax.decoding.stats import DecodeStats


class SamplerError(ValueError):
    """Bad sampler name or options."""


@struct.dataclass
class Plan:
    """One model call, as a schedule asks for it."""

    positions: jax.Array  # [b, Q] int32 canvas columns queried; T marks an unused slot
    full: jax.Array  # [] bool: a full forward over the whole canvas (else a cached call)
    serve: jax.Array  # [b] bool: rows the call serves; other rows' canvas stays as it is
    # [b] int32 or None: keys at canvas columns >= visible are not attended in this call
    # (None: the whole canvas). A schedule that hides a region never queried yet keeps
    # the cache's unwritten columns out of attention.
    visible: jax.Array | None = None
    # [b, n] int32 or None: the queries (indices into `positions`) whose logits the
    # schedule reads; n >= Q marks an unused slot. None: every query's. A call with many
    # queries (e.g. a first call that encodes a long prefix) computes its output head
    # only where it is read.
    logits_at: jax.Array | None = None


@struct.dataclass
class CallOutput:
    """What the model call gives the schedule's update."""

    logits: jax.Array  # [b, n, V] float32; row i predicts column targets[:, i]
    targets: jax.Array  # [b, n] int32 column predicted by each row (T: none)
    serve: jax.Array  # [b] bool, the plan's rows (finished rows removed)
    full: jax.Array  # [] bool, the plan's call kind

    def at(self, cols):
        """Logits predicting the canvas columns cols [b, n].

        Returns:
          (logits [b, n, V], has [b, n] bool: whether the call predicted that column;
          where it did not, the logits row is arbitrary and must not be used).
        """
        match = self.targets[:, None, :] == cols[:, :, None]  # [b, n, Q]
        has = jnp.any(match, axis=-1)
        idx = jnp.argmax(match, axis=-1)
        return jnp.take_along_axis(self.logits, idx[:, :, None], axis=1), has


@dataclasses.dataclass(frozen=True)
class Context:
    """Facts about the canvas that every schedule needs; built inside the trace.

    Canvas layout per row: [left padding | prompt | generation]; the generation region
    starts at the same column P in every row, so generated position j is column P + j.
    """

    batch: int  # b
    prompt_len: int  # P, the bucketed prompt length
    gen_length: int  # G
    shift: int  # 1 for a logit-shifted model (Dream), else 0
    mask_id: int
    eos_id: int
    stop_ids: tuple[int, ...]  # end-of-text tokens (EOS, end-of-turn)
    pad_len: jax.Array  # [b] int32 left padding of each row

    @property
    def length(self) -> int:  # T = P + G
        return self.prompt_len + self.gen_length

    def is_stop(self, tokens):
        """Whether each token is an end-of-text token."""
        return jnp.isin(tokens, jnp.asarray(self.stop_ids, jnp.int32))


_REGISTRY: dict[str, type[Schedule]] = {}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Base of every sampler schedule.

    Attributes:
      gen_length: G, tokens generated per row.
    """

    # Registry name (set by a concrete sampler; None: not registered).
    name: ClassVar[str | None] = None
    # The statistics this schedule returns (a DecodeStats, or an extension of it whose
    # extra fields `summary` fills).
    stats_type: ClassVar[type[DecodeStats]] = DecodeStats
    # Fields that `from_options` fills and callers do not pass as sampler options.
    structural: ClassVar[tuple[str, ...]] = ("gen_length",)
    gen_length: int

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None:
            _REGISTRY[name] = cls

    def __post_init__(self):
        if self.gen_length <= 0:
            raise SamplerError(f"gen_length={self.gen_length}: must be positive")

    def bind(self, tokenizer, cfg) -> Schedule:
        """The schedule with what it needs from the tokenizer and model config resolved
        (e.g. delimiter token ids); called by `generate` before compiling."""
        del tokenizer, cfg
        return self

    # -- what the driver asks -------------------------------------------------------
    @property
    def uses_cache(self) -> bool:
        """Whether the driver keeps a K/V cache of the canvas (cached calls allowed)."""
        return False

    @property
    def guidance_scale(self) -> float:
        """Classifier-free guidance scale of full forwards (0: none)."""
        return 0.0

    def max_iterations(self) -> int:
        """The loop's step cap; hitting it is a bug signal, reported in the stats."""
        raise NotImplementedError

    def init(self, ctx: Context) -> Any:
        """The schedule's initial state (a pytree of [b, ...] arrays)."""
        raise NotImplementedError

    def plan(self, ctx: Context, canvas, state, live) -> Plan:
        """The next model call.

        Args:
          ctx: the canvas facts.
          canvas: [b, T] int32.
          state: the schedule's state.
          live: [b] bool, rows not finished (padding rows of a batch bucket included
            as finished).
        Returns:
          Plan.
        """
        raise NotImplementedError

    def key_bound(self, ctx: Context) -> int | None:
        """A static column count: when every row of a cached call has `Plan.visible` at
        most this, the call reads and attends only the cache's first columns up to it
        (the attention over the hidden suffix is not computed at all). None: always the
        whole canvas."""
        del ctx
        return None

    def attention_blocks(self, ctx: Context):
        """[b, T] int block id of every canvas column for block-causal attention (a
        query attends only to keys whose block id is <= its own), in every call of the
        decode; None (the default): bidirectional attention."""
        del ctx
        return None

    def first_plan(self, ctx: Context, canvas, state, live) -> Plan | None:
        """An optional first call, made once before the loop, whose query count may
        differ from `plan`'s (e.g. a cached call over a prefix of the canvas instead of a
        full forward); its output goes through `update` as any other. None: the loop
        starts with `plan`."""
        del ctx, canvas, state, live
        return None

    def update(self, ctx: Context, canvas, state, out: CallOutput, key) -> tuple[Any, Any]:
        """Commits from the call's logits.

        Args:
          ctx, canvas, state: as `plan`.
          out: the call's output.
          key: a PRNG key for this iteration.
        Returns:
          (canvas [b, T], new state). Only rows in out.serve may change (the driver
          enforces it).
        """
        raise NotImplementedError

    def done(self, ctx: Context, canvas, state):
        """[b] bool: rows that are finished."""
        raise NotImplementedError

    def summary(self, ctx: Context, state) -> dict:
        """Schedule-specific statistics from the final state (numpy arrays); the keys
        are fields of `stats_type`."""
        del ctx, state
        return {}

    # -- options --------------------------------------------------------------------
    @classmethod
    def from_options(cls, *, gen_length: int, **options) -> Schedule:
        """Builds and validates the schedule from user options (defaults filled in)."""
        fields = option_fields(cls)
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise SamplerError(
                f"{cls.name}: unknown option(s) {unknown}; accepted: {sorted(fields)}")
        try:
            return cls(gen_length=gen_length, **options)
        except TypeError as e:
            raise SamplerError(f"{cls.name}: {e}") from None


@functools.cache
def _import_sampler_modules() -> None:
    """Imports each module of the decoding package once, so a new sampler file registers
    itself without being listed anywhere."""
    import asynclane_jax.decoding as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")


def registry() -> dict[str, type[Schedule]]:
    """Every registered sampler by name."""
    _import_sampler_modules()
    return dict(sorted(_REGISTRY.items()))


def get_schedule_class(name: str) -> type[Schedule]:
    samplers = registry()
    if name not in samplers:
        raise SamplerError(f"unknown sampler {name!r}; available: {sorted(samplers)}")
    return samplers[name]


def option_fields(cls: type[Schedule]) -> dict[str, dataclasses.Field]:
    """The user options of a schedule class: its fields except the structural ones."""
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in cls.structural}


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
