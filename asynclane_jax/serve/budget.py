"""The server's memory budget and its host scheduler (no JAX in this module).

A pool (one sampler setting at one generation bucket and one prompt bucket) carries its
rows' state on the device between chunks: the K/V cache, the canvas and the per-row
counters. Its bytes follow from shapes alone, as `fixed + per_row * rows` (`PoolShape`,
which the engine reads from `jax.eval_shape` before anything is allocated). A pool runs
at a slot bucket, the smallest of 1, 2, 4, 8, ... up to --slots that holds its rows
(`slot_buckets`), so the state it holds, and a chunk's cost, follow the rows in use.

`--kv-budget` bounds the bytes that all pools hold together. Before each round of chunks
`plan` (pure Python, tested without JAX) decides each pool's slot bucket and how many of
its waiting requests it admits:

- a pool keeps the rows it has (their state is already held), and grows towards the
  bucket that holds its waiting requests too, as far as the budget allows;
- idle pools (no rows, nothing waiting) keep their state until another pool needs the
  bytes; then they are released least recently used first;
- when a pool with waiting requests cannot start one row, the others stop admitting
  until it can (the oldest waiting request is not starved by a busy pool);
- a request whose pool cannot hold even one row within the whole budget is refused at
  submit (`Engine.submit` raises `OverBudget`; the app answers 503).

The budget bounds the state carried between chunks. A move between slot counts holds
the old and the new state for a moment, and the chunk programs' temporaries
(activations, logits) come on top: the default budget leaves the other half of the free
memory for them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

# The share of the device's free memory (after the weights) that the default budget
# takes; the rest is the chunk programs' temporaries (activations, logits) and the
# runtime's own.
DEVICE_SHARE = 0.5
# Without a device memory figure (a CPU backend): the share of the host's RAM.
HOST_SHARE = 0.25
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class BudgetError(ValueError):
    """A budget that cannot be read."""


def parse_bytes(text: str | int) -> int:
    """Bytes from "8GiB", "512MiB", "2.5G", "1000000" (decimal k/M/G/T, binary KiB/MiB/
    GiB/TiB; case-insensitive).

    Raises:
      BudgetError: not a positive size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise BudgetError(f"{text!r}: a size in bytes, e.g. 8GiB, 512MiB or 2000000000")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise BudgetError(f"{text!r}: must be at least 1 byte")
    return n


def size_text(n: float) -> str:
    """Bytes for people: GiB from 1 GiB up, then MiB, then KiB."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"


def slot_buckets(slots: int) -> tuple[int, ...]:
    """The slot counts a pool is compiled at: 1, 2, 4, ... below `slots`, and `slots`."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return tuple(out) + (int(slots),)


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `rows` (0 for none; the largest when none does)."""
    if rows <= 0:
        return 0
    return next((b for b in buckets if b >= rows), buckets[-1])


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """A pool's carried state in bytes: fixed + per_row * rows (kv_per_row of them the
    K/V cache's)."""

    fixed: int
    per_row: int
    kv_per_row: int = 0

    def bytes(self, rows: int) -> int:
        return 0 if rows <= 0 else self.fixed + self.per_row * rows


def host_memory_bytes() -> int | None:
    """The host's physical memory, when the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_budget(device_limit: int | None, device_in_use: int | None,
                   host_bytes: int | None) -> tuple[int, str]:
    """The default --kv-budget and where it came from: DEVICE_SHARE of the device's free
    memory (its limit less what is in use, e.g. the weights) when the device reports
    them, else HOST_SHARE of the host's RAM (a CPU backend), else 1 GiB."""
    if device_limit:
        free = max(device_limit - (device_in_use or 0), 0)
        return max(int(free * DEVICE_SHARE), 1), (
            f"{DEVICE_SHARE:.0%} of the device's free memory ({size_text(free)})")
    if host_bytes:
        return max(int(host_bytes * HOST_SHARE), 1), (
            f"{HOST_SHARE:.0%} of the host's memory ({size_text(host_bytes)})")
    return 2**30, "1 GiB (no memory figure from the device or the host)"


@dataclasses.dataclass
class PoolView:
    """What `plan` reads of one pool.

    held: the slot bucket it holds state for now (0: none); live: rows decoding;
    waiting: requests queued for it; oldest: the arrival number of its oldest waiting
    request (None when none waits); last_used: when it last ran a chunk (larger is
    later).
    """

    key: object
    shape: PoolShape
    held: int
    live: int
    waiting: int
    oldest: int | None = None
    last_used: float = 0.0


@dataclasses.dataclass
class Decision:
    """A pool's slot bucket for the next round (0: release its state) and how many of
    its waiting requests it admits."""

    size: int
    admit: int


def plan(pools: Sequence[PoolView], buckets: Sequence[int], budget: int) -> dict:
    """Each pool's Decision for the next round of chunks (see the module's docstring).

    A pool's rows in flight are never dropped: its size is at least the bucket holding
    them. The bytes of all sizes together stay within `budget` whenever the rows in
    flight allow it (they were admitted within it).
    """
    out: dict = {}
    # Every pool first at the bucket its rows in flight need (idle ones keep theirs).
    for p in pools:
        size = bucket_for(p.live, buckets) if (p.live or p.waiting) else p.held
        out[p.key] = Decision(size=size, admit=0)

    def used() -> int:
        return sum(p.shape.bytes(out[p.key].size) for p in pools)

    _release_idle(pools, out, None, used() - budget)  # over it (a budget that shrank)

    # Waiting pools in the order of their oldest request.
    queue = sorted((p for p in pools if p.waiting), key=lambda p: p.oldest or 0)
    for p in queue:
        want = bucket_for(p.live + p.waiting, buckets)
        d = out[p.key]
        grown = d.size
        for size in (b for b in buckets if d.size < b <= want):
            spare = budget - used() + p.shape.bytes(d.size) - p.shape.bytes(size)
            spare_idle = spare + _idle_bytes(pools, out, p.key)
            if spare >= 0 or spare_idle >= 0:
                grown = size
            else:
                break
        if grown > d.size:
            _release_idle(pools, out, p.key,
                          used() - p.shape.bytes(d.size) + p.shape.bytes(grown) - budget)
            d.size = grown
        d.admit = max(min(d.size - p.live, p.waiting), 0)
        if d.admit == 0 and p.live == 0:
            break  # it waits for memory: later pools admit nobody until it runs
    return out


def _idle_bytes(pools, out, but) -> int:
    return sum(p.shape.bytes(out[p.key].size) for p in pools
               if p.key != but and not p.live and not p.waiting)


def _release_idle(pools, out, but, need: int) -> None:
    """Releases idle pools' state, least recently used first, until `need` bytes are
    free."""
    for p in sorted((p for p in pools if p.key != but and not p.live and not p.waiting
                     and out[p.key].size), key=lambda p: p.last_used):
        if need <= 0:
            return
        need -= p.shape.bytes(out[p.key].size)
        out[p.key].size = 0
