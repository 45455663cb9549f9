"""The "cpu" chip: what one call of each shape costs on this machine, measured.

For a loaded model and a `CallShape`, `measure_call` builds the arrays of that shape
and times `DiffusionLM.forward` under `jax.jit` as the decode calls it
(`ModelCalls.full_over` and `ModelCalls.cached` in asynclane_jax/decoding/driver.py):

* a full call: tokens and positions [rows, queries]; with a cache, the cache of the
  whole canvas [L, rows, canvas, K, h], every query's column written
  (`write_index`), and `key_len=queries` when the call covers only the leading
  columns; logits at `logits` columns (`logits_index`);
* a cached call: tokens and positions [rows, queries], the cache, the queries'
  columns written (within the first `keys`), `key_len=keys` when keys < canvas, and
  `logits_index` only when logits < queries (the decode passes none otherwise);
* a key mask [rows, canvas] in both, as the decode passes it.

The calls run as the decode runs them: several in a row inside one compiled loop
(`lax.fori_loop`), the cache carried from call to call and written in place, so
that neither the host's dispatch of each program nor a copy of the cache is counted
(a decode dispatches one program for all its calls). The cache is donated to the
program. The time is the median over a few runs of the loop, divided by its calls,
after a compile and half a second of untimed runs (`WARMUP_S`). `MeasuredCosts`
keeps one per shape, and its `measure_all` times many shapes in interleaved rounds.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from asynclane_jax.costs.formula import check_shape
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models.model import KVCache


def call_arrays(cfg, shape: CallShape) -> dict:
    """The arrays of one call of `shape` (see the module docstring), as keyword
    arguments of `DiffusionLM.forward` plus `tokens` and `positions`; `key_len` is a
    Python int or None."""
    shape = check_shape(shape)
    b, q, T = shape.rows, shape.queries, shape.canvas
    first = 0 if shape.kind == "full" else max(0, shape.keys - q)
    cols = jnp.broadcast_to(jnp.arange(first, first + q, dtype=jnp.int32), (b, q))
    args = dict(tokens=jnp.full((b, q), cfg.mask_token_id, jnp.int32), positions=cols,
                key_mask=jnp.ones((b, T if shape.cache else q), bool), cache=None,
                write_index=None, logits_index=None, key_len=None)
    if shape.cache:
        args.update(cache=KVCache.zeros(cfg, b, T), write_index=cols)
        bound = shape.queries if shape.kind == "full" else shape.keys
        args["key_len"] = bound if bound < T else None
    if shape.kind == "full" or shape.logits < q:
        n = min(shape.logits, q)
        args["logits_index"] = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    return args


# Calls per timed run of the loop (the host's dispatch of the program is shared by them).
CALLS_PER_RUN = 8
WARMUP_S = 0.5  # seconds of untimed runs after each compile
SENTINEL = 1234.5678  # a logit sum the loop never reaches in practice


@functools.lru_cache(maxsize=8)
def _program(graphdef, key_len, calls: int):
    def run(params, cache, tokens, positions, key_mask, write_index, logits_index):
        model = nnx.merge(graphdef, params)

        def one(_, carry):
            cache, acc = carry
            # The tokens depend on the carry, so that no call (a call without a cache
            # reads nothing the loop carries) can be hoisted out of the loop.
            toks = tokens + (acc == SENTINEL).astype(tokens.dtype)
            logits, cache = model.forward(toks, positions, key_mask=key_mask, cache=cache,
                                          write_index=write_index,
                                          logits_index=logits_index, key_len=key_len)
            return cache, acc + logits[0, 0, 0]  # every call's logits are used

        return jax.lax.fori_loop(0, calls, one, (cache, jnp.zeros((), jnp.float32)))

    return jax.jit(run, donate_argnums=(1,))


def _timer(model, shape: CallShape, calls: int):
    """A compiled loop of `calls` calls of `shape` on `model`, run once (the compile);
    returns a function that runs it once more and gives the seconds per call."""
    graphdef, params = nnx.split(model)
    args = call_arrays(model.cfg, shape)
    calls = max(1, int(calls))
    fn = _program(graphdef, args.pop("key_len"), calls)
    state = {"cache": args.pop("cache")}
    rest = (args["tokens"], args["positions"], args["key_mask"], args["write_index"],
            args["logits_index"])

    def run() -> float:
        t0 = time.perf_counter()
        state["cache"], acc = fn(params, state["cache"], *rest)
        jax.block_until_ready(acc)
        return (time.perf_counter() - t0) / calls

    run()  # compiles
    # The first runs after a compile can be several times slower than the rest (seen
    # on this CPU for hundreds of milliseconds): they are run and not kept.
    end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < end:
        run()
    return run


def measure_call(model, shape: CallShape, repeat: int = 5, calls: int = CALLS_PER_RUN
                 ) -> float:
    """Median seconds of one call of `shape` on `model`: `calls` calls in one compiled
    loop, timed `repeat` times after a compile, divided by `calls`.

    Args:
      model: a DiffusionLM (e.g. `asynclane_jax.load(name)[0]`).
      shape: the call's shape.
      repeat: timed runs of the loop (at least 1).
      calls: calls per run (at least 1).
    """
    run = _timer(model, shape, calls)
    return statistics.median(run() for _ in range(max(1, int(repeat))))


class MeasuredCosts:
    """The measured "cpu" chip of one model: `call_time(shape)` in seconds, measured
    once per shape (`measure_call`, `repeat` timed runs: the median of nine stays
    put when a few runs meet a busy spell of a shared machine) and remembered;
    `roofline.decode_time` and `tokens_per_s` take it in place of a chip."""

    key = "cpu"

    def __init__(self, model, repeat: int = 9):
        self.model = model
        self.cfg = model.cfg
        self.repeat = repeat
        self.times: dict[CallShape, float] = {}

    def call_time(self, shape: CallShape) -> float:
        """Seconds of one call of `shape` on this machine (measured on first use). A
        mixed call is priced as its two parts (`CallShape.parts`) made one after the
        other: on this CPU a call's time is its arithmetic, which the mixed call does
        in full for both parts (the pass over the weights it saves is what a
        weight-bound chip gains, and the roofline prices)."""
        if shape.kind == "mixed":
            return sum(self.call_time(p) for p in shape.parts())
        if shape not in self.times:
            self.times[shape] = measure_call(self.model, shape, self.repeat)
        return self.times[shape]

    def measure_all(self, shapes) -> None:
        """Measures every shape of `shapes` not yet measured, in `repeat` interleaved
        rounds (one timed run of each shape per round, the median per shape kept).
        A busy spell of a shared machine lasts longer than one shape's few runs: in
        rounds it falls on a run of every shape rather than on all runs of one."""
        parts = [p for s in shapes for p in s.parts()]
        todo = [s for s in dict.fromkeys(parts) if s not in self.times]
        timers = {s: _timer(self.model, s, CALLS_PER_RUN) for s in todo}
        runs: dict[CallShape, list[float]] = {s: [] for s in todo}
        for _ in range(max(1, int(self.repeat))):
            for s in todo:
                runs[s].append(timers[s]())
        for s in todo:
            self.times[s] = statistics.median(runs[s])


__all__ = ["MeasuredCosts", "call_arrays", "measure_call"]
