"""Continuous batching over the decode loop's row slots, within a memory budget.

The engine keeps, per (sampler structure, generation bucket, prompt bucket), a pool whose
rows are carried on the device between calls of one compiled program,
`driver.serve_chunk`: it retires cancelled rows, admits waiting requests into free rows
(their first model call inside the same program) and runs up to `chunk` loop
iterations, ending early at the iteration in which a row's answer became complete (the
row finished, or its committed prefix reached a stop token or the request's
max_tokens), so a finished request is sent, and its slot refilled, at once rather than
after the rest of the chunk. For a moment after a chunk that freed rows while others
decode on and nobody waits (`admission_window`), chunks are one iteration long: the
answered clients' next requests, which often come at once, are admitted at the next
iteration while the rows in flight keep decoding, instead of waiting for a whole chunk
(or holding the device idle for them). Between chunks the engine's thread reads the
canvas back and frees the rows that are done; a second host thread (the emitter)
detokenizes and hands each request the text its contiguous committed prefix gained (a
diffusion LM commits out of order: a token is sent only when every token before it is
committed, and never again), while the engine's thread runs the next chunk. What a chunk's
read gives is handed to the emitter once the next chunk is dispatched (or when nothing is
left to run): the threads it wakes (the emitter, a server's event loop) then run while
the device decodes, not while the engine's thread dispatches. At start the
default pools' programs are compiled at every slot count (`precompile`) and run once
down the paths a load takes (`warm_up`, `_Pool.warm`): a program's first run down a path
costs many times a later one, which the first requests would otherwise pay.

Per-request options. A sampler's traced options (`Schedule.traced_options`: thresholds)
change no shape of its program: each row's values are per-row arguments of the pool's
program, so a request may send any valid value and runs in the pool that exists (no
new pool, no compile). Every other option is structural (block length, cache, lane
slots, ...): the operator fixes it at start (`options`, plus at most MAX_CONFIGS
configurations a request may pick, `allow_options`); a request asking for another gets
`OptionNotAllowed`, whose message names what is allowed (a 400 at the server).

With mixed calls on (`serve --mixed-calls`; docs/architecture.md, "Mixed calls"), an
admitted row's full forward and the other rows' cached calls are one model call
(AsyncLane), so an admission costs the rows in flight no iteration, and on a
weight-bound chip hardly a call of its own.

Active-batch buckets: a pool runs at the smallest slot count of 1, 2, 4, ... up to
`slots` (`budget.slot_buckets`) that holds its rows and the requests it admits, each
count one compiled program; when that count changes, the rows in flight are moved into
a state of the new size (a gather on the device), so one client pays for one row.

Memory: a pool's state (K/V cache, canvas, per-row counters) is sized from its shapes
(`jax.eval_shape`, before anything is allocated) as fixed + per-row bytes. All pools
together hold at most `kv_budget` bytes: `budget.plan` decides each round which pools
grow, which wait and which idle pools are released (least recently used first). A
request whose pool cannot hold one row within the whole budget is refused at submit
(`OverBudget`). At most `max_pools` pools are kept; idle ones beyond it are dropped with
their programs, least recently used first.

A request's tokens are `generate`'s for the same prompt and settings at gen_length =
its bucket (the smallest configured generation length >= max_tokens), cut at
max_tokens: rows never see each other, and a row decodes the same whatever its left
padding, its slot or the pool's slot count.

`stats()` (for /health) and `gauges()` (for /metrics, read without the engine's lock)
report the rows in use, the queue, the pools with the bytes they hold, the budget and
the compiles; `stats()` also the model calls made so far, by call shape (`CallShape`),
which the cost model prices (experiments/serve_load.py projects a server's device time
onto a chip from them).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asynclane_jax.decoding import driver
from asynclane_jax.decoding.api import build_canvas, make_schedule, prompt_bucket
from asynclane_jax.decoding.registry import DEFAULT_SAMPLER
from asynclane_jax.decoding.schedule import SamplerError
from asynclane_jax.serve import budget as budget_lib

# How long after a chunk that freed rows the engine expects the answered clients' next
# requests, running one-iteration chunks meanwhile (Engine.admission_window; seconds).
ADMISSION_WINDOW_S = 0.05
# Structural configurations an operator may allow, at most (the server's own included):
# each is a pool, and its programs, of its own.
MAX_CONFIGS = 8
log = logging.getLogger("asynclane_jax.serve")  # the server's logger (app.py's)


class EngineError(ValueError):
    """A request the engine cannot take (its message is for the client)."""


class QueueFull(EngineError):
    """The waiting queue is at its bound."""


class EngineStopped(EngineError):
    """The engine is not taking requests (not started, or shutting down)."""


class OverBudget(EngineError):
    """A request whose pool cannot hold one row within the whole memory budget."""


class OptionNotAllowed(EngineError):
    """A request's structural sampler option that none of the operator's configurations
    has (its message names the allowed values and the per-request options)."""


@dataclasses.dataclass
class Update:
    """What a request gained since its last update (called from the emitter's thread)."""

    token_ids: list[int]  # newly final tokens, in order; stop tokens excluded
    text: str  # their text ("" while a piece of text is held back)
    finished: bool
    finish_reason: str | None  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int  # so far
    error: str | None = None


class Handle:
    """A submitted request; `cancel` frees its row at the next chunk."""

    def __init__(self, request: _Request):
        self._request = request
        self.request_id = request.id

    def cancel(self) -> None:
        self._request.cancelled = True
        self._request.engine._wake()


@dataclasses.dataclass(eq=False)
class _Request:
    id: str
    engine: Engine
    prompt: list[int]
    max_tokens: int
    pool_key: tuple
    on_update: Callable[[Update], None]
    traced: dict = dataclasses.field(default_factory=dict)  # its traced option values
    seq: int = 0  # arrival order
    cancelled: bool = False
    sent: int = 0  # tokens handed to the emitter
    text: str = ""  # text sent (the emitter's)
    done: bool = False


def _placer(producer, shardings) -> Callable:
    """What puts a compiled `producer`'s output state where the chunk program takes it
    (`shardings`): nothing where the producer leaves it there already (one device, or a
    mesh the compiler kept), else a device_put, which walks the whole state on the host
    (0.3-0.8 ms at tiny-llada's 35 leaves here, each time the rows move)."""
    have, want = jax.tree.leaves(producer.output_shardings), jax.tree.leaves(shardings)
    if len(have) == len(want) and all(h == w for h, w in zip(have, want)):
        return lambda state: state
    return lambda state: jax.device_put(state, shardings)


def _itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key: two uint32
    return np.dtype(dtype).itemsize


def _state_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * _itemsize(x.dtype) for x in jax.tree.leaves(tree))


def pool_layout(graphdef, params, schedule, rows_shape: tuple[int, int], mask_id: int,
                seed: int = 0):
    """A pool's state from its shapes alone (nothing allocated): (PoolShape, the batch
    axis of each of the state's leaves, None for leaves shared by the rows).

    params may be abstract (ShapeDtypeStructs: no weights needed). rows_shape: (anything,
    T); the state is traced at 1 and 2 rows.
    """
    T = rows_shape[1]

    def at(b):
        def init(p, r):
            canvas = jnp.full((b, T), mask_id, jnp.int32)
            return driver.serve_init(graphdef, p, canvas, r, schedule.operands(),
                                     schedule=schedule)
        return jax.eval_shape(init, params, jax.random.key(seed))

    one, two = at(1), at(2)
    axes = []
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        diff = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
        axes.append(diff[0] if diff else None)
    b1, b2 = _state_bytes(one), _state_bytes(two)
    kv = _state_bytes(two.cache) - _state_bytes(one.cache) if one.cache is not None else 0
    return budget_lib.PoolShape(fixed=2 * b1 - b2, per_row=b2 - b1, kv_per_row=kv), \
        tuple(axes)


class _Pool:
    """One schedule structure at one generation bucket and prompt bucket: its state at
    its current slot count (`size`, 0 when it holds none), its rows' traced option
    values, and its programs by slot count."""

    def __init__(self, engine: Engine, schedule, gen_length: int, prompt_length: int):
        self.engine, self.schedule, self.G = engine, schedule, gen_length
        cfg = engine.cfg
        self.key = (schedule, gen_length, prompt_length)
        self.P = prompt_bucket(prompt_length, gen_length, cfg, prompt_length)
        self.T = self.P + gen_length
        self.shape, self.axes = engine._layout(self.key)
        self.size = 0
        self.state = None
        self.rows: list[_Request | None] = []
        self.waiting: collections.deque[_Request] = collections.deque()
        self.pad_len = np.zeros(0, np.int32)
        self.limit = np.zeros(0, np.int32)  # each slot's max_tokens (a free slot: G)
        # Each slot's traced option values ({name: [size] float32}; a free slot holds
        # the structure's own value).
        self.defaults = schedule.traced_values()
        self.traced = {n: np.zeros(0, np.float32) for n in self.defaults}
        self.operands = jax.tree.map(jnp.asarray, schedule.operands())
        self.programs: dict[int, tuple] = {}  # slots -> (init, chunk)
        self.abstract: dict[int, object] = {}  # slots -> the state's shapes and placement
        self.shardings: dict[int, object] = {}  # slots -> where the chunk program takes the state
        self.movers: dict[tuple[int, int], Callable] = {}  # (from, to) slots -> move
        # slots -> an all-mask canvas on the devices: the chunk program's canvas_in when
        # it admits nothing (made with the program, `program`)
        self.blanks: dict[int, jax.Array] = {}
        # slots -> the chunk program's call shapes, by their slot in state.shape_calls;
        # the state's counters as last read (`_count_calls`).
        self.call_shapes: dict[int, tuple] = {}
        self.counted = np.zeros(driver.MAX_CALL_SHAPES, np.int64)
        self.compile_time = 0.0
        self.last_used = time.monotonic()

    # -- what plan reads -----------------------------------------------------------------
    @property
    def live(self) -> int:
        """Rows holding a request (cancelled ones too, until the chunk that frees them)."""
        return sum(r is not None and r is not _RETIRED for r in self.rows)

    @property
    def decoding(self) -> int:
        return self.live

    @property
    def held_bytes(self) -> int:
        return self.shape.bytes(self.size)

    def view(self) -> budget_lib.PoolView:
        return budget_lib.PoolView(key=self.key, shape=self.shape, held=self.size,
                                   live=self.live, waiting=len(self.waiting),
                                   oldest=self.waiting[0].seq if self.waiting else None,
                                   last_used=self.last_used)

    # -- programs ------------------------------------------------------------------------
    def program(self, b: int) -> tuple:
        """(init, chunk) at b slots, compiled on first use (from shapes only)."""
        if b in self.programs:
            return self.programs[b]
        eng, cfg, schedule = self.engine, self.engine.cfg, self.schedule
        graphdef, params, T, operands = eng.graphdef, eng.params, self.T, self.operands
        t0 = time.perf_counter()

        def init_fn(p, r, o):  # the weights as an argument: the state lands on their devices
            canvas = jnp.full((b, T), cfg.mask_token_id, jnp.int32)
            return driver.serve_init(graphdef, p, canvas, r, o, schedule=schedule)

        rng = jax.random.key(eng.seed)
        init = jax.jit(init_fn).lower(params, rng, operands).compile()
        # The state as the chunk program is lowered for it: no placement of its own (as
        # a fresh state from `init` has none), then put where the compiled program
        # takes it (`shardings`) whenever it is made or moved.
        abstract = jax.eval_shape(init_fn, params, rng, operands)
        sites = driver.CallSites()
        tree = eng.param_tree
        chunk = jax.jit(lambda pl, st, pad, adm, cin, ret, k, o, tr, lim: driver.serve_chunk(
            graphdef, jax.tree.unflatten(tree, pl), st, pad, adm, cin, ret, k, o, tr, True,
            lim, schedule=schedule, sites=sites), donate_argnums=(1,))
        args = (eng.param_leaves, abstract, jax.ShapeDtypeStruct((b,), jnp.int32),
                jax.ShapeDtypeStruct((b,), bool), jax.ShapeDtypeStruct((b, T), jnp.int32),
                jax.ShapeDtypeStruct((b,), bool), jax.ShapeDtypeStruct((), jnp.int32),
                operands, self._traced_args(b) if self.defaults else None,
                jax.ShapeDtypeStruct((b,), jnp.int32))
        fn = chunk.lower(*args).compile()
        self.call_shapes[b] = tuple(sites.shapes)  # numbered as state.shape_calls counts
        shardings = fn.input_shardings[0][1]
        # The canvas_in of a chunk that admits nothing: made here, with the programs
        # (a host array put on the devices: no program of its own to compile when a
        # slot count is first used while serving).
        self.blanks[b] = jax.device_put(np.full((b, T), cfg.mask_token_id, np.int32),
                                        fn.input_shardings[0][4])
        dt = time.perf_counter() - t0
        self.compile_time += dt
        eng.compiles += 1
        eng.compile_seconds += dt

        self.abstract[b] = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
            shardings)
        self.shardings[b] = shardings
        place = _placer(init, shardings)
        self.programs[b] = (lambda *a: place(init(*a)), fn)
        return self.programs[b]

    def mover(self, a: int, b: int):
        """The program that moves the state from a slots to b (a gather of the rows in
        flight into the first slots; the others free), compiled on first use; its
        seconds count as compile seconds."""
        if (a, b) in self.movers:
            return self.movers[(a, b)]
        self.program(a), self.program(b)
        axes = self.axes
        t0 = time.perf_counter()

        def move(state, src, valid):
            leaves, treedef = jax.tree.flatten(state)
            moved = [x if ax is None else jnp.take(x, src, axis=ax)
                     for x, ax in zip(leaves, axes)]
            st = jax.tree.unflatten(treedef, moved)
            return st.replace(finished=jnp.where(valid, st.finished, True))

        fn = jax.jit(move).lower(self.abstract[a], jax.ShapeDtypeStruct((b,), jnp.int32),
                                 jax.ShapeDtypeStruct((b,), bool)).compile()
        dt = time.perf_counter() - t0
        self.compile_time += dt
        self.engine.compile_seconds += dt
        place = _placer(fn, self.shardings[b])
        self.movers[(a, b)] = lambda *args: place(fn(*args))
        return self.movers[(a, b)]

    def warm(self, sizes, prompt: Sequence[int]) -> None:
        """Runs each program at `sizes` slots down the paths a load takes, on a state of
        its own (the pool's rows and counters untouched): 1, 2, 4, ... rows admitted at
        once (each count's full forward is a branch of the program) and decoded for a
        chunk (`prompt` in every row), their retirement, and the moves between the
        sizes. A program's first run down a path costs many times a later one on this
        CPU (50-90 ms against 4-23 for an admission at tiny-llada's shapes), so without
        this the first requests after start pay for it."""
        eng, cfg = self.engine, self.engine.cfg
        canvas, pad, _ = build_canvas([list(prompt)[:self.P]], self.G, cfg, self.P)
        for b in sizes:
            init, fn = self.program(b)
            state = init(eng.params, jax.random.key(eng.seed), self.operands)
            limit = np.full(b, self.G, np.int32)
            pads = np.full(b, pad[0], np.int32)
            rows = np.broadcast_to(canvas[0], (b, self.T)).copy()
            traced = ({n: np.full(b, d, np.float32) for n, d in self.defaults.items()}
                      if self.defaults else None)
            none = np.zeros(b, bool)
            for j in (*driver.mix_buckets(b), b):
                admit = np.arange(b) < j
                for adm, ret, steps in ((admit, none, eng.chunk), (none, admit, 0)):
                    state = fn(eng.param_leaves, state, pads, adm, rows, ret,
                               np.int32(steps), self.operands, traced, limit)
            # The moves from this size, one at a time: at most two states are held at
            # once, as when rows move while serving.
            for c in sizes:
                if c != b:
                    src, valid = np.zeros(c, np.int32), np.zeros(c, bool)
                    jax.block_until_ready(self.mover(b, c)(state, src, valid))
            jax.block_until_ready(state)
            del state

    def _traced_args(self, b: int | None = None):
        """The slots' traced option values as the chunk program's argument (None: the
        schedule has none); with b, their shapes only."""
        if not self.defaults:
            return None
        if b is not None:
            return {n: jax.ShapeDtypeStruct((b,), jnp.float32) for n in self.defaults}
        # Host arrays (copies: the slots' values change in place at admission): the
        # compiled program takes them in more cheaply than a jnp.asarray each.
        return {n: v.copy() for n, v in self.traced.items()}

    # -- state ---------------------------------------------------------------------------
    def resize(self, b: int) -> None:
        """Holds state for b slots: the rows in flight move to the first slots; b = 0
        releases the state (no row may be in flight then)."""
        if b == self.size:
            return
        keep = [i for i, r in enumerate(self.rows) if r is not None and r is not _RETIRED]
        if len(keep) > b:
            raise RuntimeError(f"{len(keep)} rows in flight do not fit in {b} slots")
        if b == 0:
            self.state, self.rows, self.pad_len, self.size = None, [], self.pad_len[:0], 0
            self.limit = self.limit[:0]
            self.traced = {n: v[:0] for n, v in self.traced.items()}
            return
        init, _ = self.program(b)
        if self.state is None or not keep:
            self.state = None  # the old state goes before the new one is made
            self.state = init(self.engine.params, jax.random.key(self.engine.seed),
                              self.operands)
            self.rows, self.pad_len = [None] * b, np.zeros(b, np.int32)
            self.limit = np.full(b, self.G, np.int32)
            self.traced = {n: np.full(b, d, np.float32) for n, d in self.defaults.items()}
        else:
            src = np.array(keep + [0] * (b - len(keep)), np.int32)
            valid = np.arange(b) < len(keep)
            # Host arrays, as the chunk program's: jnp.asarray would compile a program
            # of its own per slot count on first use.
            self.state = self.mover(self.size, b)(self.state, src, valid)
            self.rows = [self.rows[i] for i in keep] + [None] * (b - len(keep))
            self.pad_len = np.where(valid, self.pad_len[src], 0).astype(np.int32)
            self.limit = np.where(valid, self.limit[src], self.G).astype(np.int32)
            self.traced = {n: np.where(valid, v[src], self.defaults[n]).astype(np.float32)
                           for n, v in self.traced.items()}
        self.size = b
        self.counted = np.asarray(self.state.shape_calls).astype(np.int64)

    def run_chunk(self, admit_n: int, iterations: int | None = None) -> None:
        """Runs one chunk: retires cancelled rows, admits up to admit_n waiting requests
        into free slots, then up to `iterations` loop iterations (default the engine's
        chunk), ending early at a completed answer; hands the emitter what each row
        gained and frees the rows that are done."""
        eng, cfg, b = self.engine, self.engine.cfg, self.size
        _, fn = self.program(b)
        admit = np.zeros(b, bool)
        retire = np.zeros(b, bool)
        canvas_in = None  # built only when a request is admitted
        for i, req in enumerate(self.rows):
            if req is not None and req.cancelled:
                retire[i] = True
                self.rows[i] = None
                eng._finish(req, "cancelled")
        for i in range(b):
            while self.rows[i] is None and self.waiting and admit_n > 0:
                req = self.waiting.popleft()
                if req.cancelled:
                    eng._finish(req, "cancelled")
                    continue
                if canvas_in is None:
                    canvas_in = np.full((b, self.T), cfg.mask_token_id, np.int32)
                canvas, pad, _ = build_canvas([req.prompt], self.G, cfg, self.P)
                canvas_in[i], self.pad_len[i] = canvas[0], pad[0]
                self.limit[i] = req.max_tokens
                for n, v in req.traced.items():  # the row's own threshold(s)
                    self.traced[n][i] = v
                admit[i] = True
                self.rows[i] = req
                admit_n -= 1
        self.last_used = time.monotonic()
        if not any(r is not None for r in self.rows) and not retire.any():
            return  # nothing to run
        if canvas_in is None:  # nothing admitted: the program does not read it
            canvas_in = self.blanks[b]
        steps = eng.chunk if iterations is None else max(1, min(int(iterations), eng.chunk))
        # Host (numpy) arguments go to the compiled program as they are: it copies them
        # in more cheaply than a jnp.asarray each would on the engine's thread.
        self.state = fn(eng.param_leaves, self.state, self.pad_len.copy(), admit, canvas_in,
                        retire, np.int32(steps), self.operands, self._traced_args(),
                        self.limit.copy())
        # The progress read after the last chunk goes to the emitter now that this one
        # is dispatched: the threads it wakes (the emitter, the server's event loop) then
        # run while the device decodes, not while this thread dispatches.
        eng._flush_updates()
        gen = np.asarray(self.state.canvas)[:, self.P:]
        finished = np.asarray(self.state.finished)
        eng.chunks += 1
        self._count_calls(b)
        for i, req in enumerate(self.rows):
            if req is not None and req is not _RETIRED and eng._advance(
                    req, gen[i], bool(finished[i])):
                self.rows[i] = None
                if not finished[i]:  # done by max_tokens: retire the row next chunk
                    self.rows[i] = _RETIRED

    def _count_calls(self, b: int) -> None:
        """Adds the model calls the last chunk made, by shape, to the engine's count
        (the state's int32 counters read as they wrap)."""
        now = np.asarray(self.state.shape_calls).astype(np.int64)
        new = (now - self.counted) % (1 << 32)
        self.counted = now
        counts = self.engine.model_calls
        for i, shape in enumerate(self.call_shapes[b]):
            if new[i]:
                counts[shape] = counts.get(shape, 0) + int(new[i])

    def fail(self, message: str) -> None:
        """Fails every request of the pool and releases its state."""
        for req in self.rows:
            if req is not None and req is not _RETIRED:
                self.engine._finish(req, "error", error=message)
        while self.waiting:
            self.engine._finish(self.waiting.popleft(), "error", error=message)
        self.state, self.rows, self.size = None, [], 0


_RETIRED = _Request(id="retired", engine=None, prompt=[], max_tokens=0, pool_key=(),
                    on_update=lambda u: None, cancelled=True, done=True)


class _Emitter:
    """The host thread that detokenizes and calls the requests' on_update, in the order
    the engine's thread hands it their progress, so that the next chunk runs meanwhile."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        self._lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="asynclane-emitter",
                                       daemon=True)
        self.thread.start()

    def put_many(self, items) -> None:
        with self._lock:
            self.pending += len(items)
        for item in items:
            self.queue.put(item)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything handed over has been sent."""
        with self._lock:
            return self._lock.wait_for(lambda: self.pending == 0, timeout)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                self.engine._deliver(*item)
            except Exception as e:  # a tokenizer or consumer that fails: that request ends
                req = item[0]
                req.cancelled = True  # its row is freed (and "cancelled" sent) next chunk
                if item[3] is not None:  # it was its last update: send why instead
                    with contextlib.suppress(Exception):
                        req.on_update(Update([], "", True, "error", len(req.prompt),
                                             req.sent, f"{type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self.pending -= 1
                    self._lock.notify_all()


class Engine:
    """Continuous batching of requests over up to `slots` rows of the compiled decode loop
    per pool, within a memory budget.

    Args:
      model, tokenizer: a loaded model and its tokenizer (`asynclane_jax.load`).
      model_name: the name clients ask for.
      sampler, options: the sampler and its options for every request. A request may
        send any value of the sampler's traced options (thresholds: per-row values in
        the pools that exist); its other options must be those of `options` or of an
        allowed configuration (else OptionNotAllowed, naming what is allowed).
      allow_options: further structural configurations a request may pick (each a dict
        of options over `options`; at most MAX_CONFIGS - 1): a request that sends the
        options in which one differs runs in that configuration's pools.
      slots: rows per pool, at most; a pool runs at the smallest of 1, 2, 4, ... slots
        that holds its rows.
      gen_lengths: the generation buckets; a request runs at the smallest bucket that
        holds its max_tokens.
      chunk: loop iterations per chunk, at most (between two reads of the canvas, for
        the streamed updates); a chunk ends sooner once a row's answer is complete.
      queue_size: requests waiting for a row, at most (then QueueFull).
      max_prompt: the longest prompt (tokens); default the model's maximum sequence
        length less the largest bucket.
      prompt_lengths: the prompt buckets (default: 128 and max_prompt, or max_prompt
        alone when it is at most 128); a request's prompt is left-padded to the
        smallest that holds it (every call computes every row at its pool's length).
      seed: PRNG seed of every pool (samplers that draw random numbers share one key
        per pool, so a per-request seed is not honoured).
      kv_budget: the bytes all pools' states may hold together (an int or a size such
        as "8GiB"); default `budget.default_budget` (a share of the devices' free
        memory, or of the host's RAM on a CPU).
      max_pools: pools kept (with their compiled programs) at most; idle ones beyond it
        are dropped, least recently used first.
      precompile: at start, compile the default pools at every slot count ("all"), at
        the largest only ("largest"), or none ("none": on first use).
      warm_up: at start, also run each precompiled program once down each of its paths
        (`_Pool.warm`), so that the first requests do not pay for their first runs.
      admission_window: after a chunk that finished requests while other rows decode on
        and nobody waits, for up to this many seconds (or until as many new requests
        arrived) the pool's chunks are one iteration long, so a request that arrives
        meanwhile is admitted at the next iteration instead of after a whole chunk,
        while the rows in flight keep decoding (0: never; chunks only ever end early,
        so no token changes).
    """

    def __init__(self, model, tokenizer, *, model_name: str, sampler: str = DEFAULT_SAMPLER,
                 options: dict | None = None, slots: int = 8,
                 gen_lengths: Sequence[int] = (128, 256, 512), chunk: int = 8,
                 queue_size: int = 64, max_prompt: int | None = None,
                 prompt_lengths: Sequence[int] | None = None, seed: int = 0,
                 compile_cache: str | None = None, kv_budget: int | str | None = None,
                 max_pools: int = 32, precompile: str = "all", warm_up: bool = True,
                 admission_window: float = ADMISSION_WINDOW_S,
                 allow_options: Sequence[dict] | None = None):
        if compile_cache:
            from asynclane_jax import compile_cache as cc

            cc.enable(compile_cache)
        for name, value in (("slots", slots), ("chunk", chunk), ("queue_size", queue_size),
                            ("max_pools", max_pools)):
            if int(value) < 1:
                raise EngineError(f"{name}={value}: must be at least 1")
        if precompile not in ("all", "largest", "none"):
            raise EngineError(f"precompile={precompile!r}: one of all, largest, none")
        self.gen_lengths = tuple(sorted({int(g) for g in gen_lengths}))
        if not self.gen_lengths or self.gen_lengths[0] < 1:
            raise EngineError(f"gen_lengths {tuple(gen_lengths)}: give positive lengths")
        self.model, self.tokenizer, self.cfg = model, tokenizer, model.cfg
        self.model_name, self.sampler = model_name, sampler
        self.options = dict(options or {})
        # The structural configurations requests may pick: the server's own first.
        self.configs = [self.options] + [{**self.options, **dict(c)}
                                         for c in (allow_options or ())]
        if len(self.configs) > MAX_CONFIGS:
            raise EngineError(f"allow_options: at most {MAX_CONFIGS - 1} configurations "
                              "besides the server's own (each a pool of its own)")
        self._structures: dict[int, list] = {}  # gen_length -> the configs' structures
        self.slots, self.chunk, self.queue_size, self.seed = slots, chunk, queue_size, seed
        self.slot_buckets = budget_lib.slot_buckets(int(slots))
        self.max_pools, self.precompile = int(max_pools), precompile
        self.warm_up = bool(warm_up)
        self.admission_window = float(admission_window)
        self._expected = 0  # requests expected in the open admission window
        self._window_end = 0.0
        self.max_prompt, self.prompt_lengths = prompt_buckets(
            self.cfg, self.gen_lengths, max_prompt, prompt_lengths)
        self.graphdef, self.params = nnx.split(model)
        # The weights as the chunk program takes them: a flat list, which a call flattens
        # in microseconds (the NNX State took about 0.2 ms of each chunk's call here).
        self.param_leaves, self.param_tree = jax.tree.flatten(self.params)
        if kv_budget is None:
            self.kv_budget, self.budget_source = budget_lib.default_budget(
                *device_memory(), budget_lib.host_memory_bytes())
        else:
            try:
                self.kv_budget = budget_lib.parse_bytes(kv_budget)
            except budget_lib.BudgetError as e:
                raise EngineError(f"kv_budget {e}") from None
            self.budget_source = "given"
        self.stop_ids = set(self.cfg.stop_token_ids)
        # Whether each token id is a stop token: a lookup per answer after every chunk
        # (np.isin sorts its arguments each call).
        self._is_stop = np.zeros(max([self.cfg.vocab_size, *self.stop_ids]) + 1, bool)
        self._is_stop[sorted(self.stop_ids)] = True
        self.pools: dict[tuple, _Pool] = {}
        self._layouts: dict[tuple, tuple] = {}
        self._layout_lock = threading.Lock()
        self._lock = threading.Condition()
        self._inbox: list[_Request] = []
        # Updates read after a chunk, held for the emitter until the next chunk is
        # dispatched (`_emit`, `_flush_updates`; the engine's thread only).
        self._pending: list[tuple] = []
        self._accepting = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._emitter: _Emitter | None = None
        self._ids = itertools.count()
        self.requests_done = 0
        self.tokens_sent = 0
        self.chunks = 0
        # The model calls of every chunk so far, by shape (CallShape -> calls): what a
        # cost model prices to project the server's device time onto a chip.
        self.model_calls: dict = {}
        self.compiles = 0  # programs compiled (a pool at a slot count), and their seconds
        self.compile_seconds = 0.0
        self.evicted = 0  # pools dropped (max_pools) and states released (the budget)
        for g in self.gen_lengths:  # a bad sampler or option fails here; so does a
            for structure in self._allowed(g):  # budget below one row
                self._check_fits((structure, g, self.prompt_lengths[-1]))

    # -- public -------------------------------------------------------------------------
    def bucket(self, max_tokens: int) -> int:
        """The generation bucket a request of max_tokens runs at."""
        if max_tokens < 1:
            raise EngineError(f"max_tokens={max_tokens}: must be at least 1")
        for g in self.gen_lengths:
            if g >= max_tokens:
                return g
        raise EngineError(f"max_tokens={max_tokens} exceeds the largest generation "
                          f"length served, {self.gen_lengths[-1]}")

    def start(self) -> None:
        """Compiles the default pools (`precompile`) and starts the engine's threads."""
        sizes = {"all": self.slot_buckets, "largest": self.slot_buckets[-1:],
                 "none": ()}[self.precompile]
        prompt = self._warm_prompt() if sizes and self.warm_up else None
        keys = [(g, n) for g in self.gen_lengths for n in self.prompt_lengths]
        for i, (g, n) in enumerate(keys, 1):
            t0 = time.perf_counter()
            pool = self._pool(self._key(None, g, n))
            for b in sizes:
                pool.program(b)
            for a in sizes:  # and the moves between them
                for b in sizes:
                    if a != b:
                        pool.mover(a, b)
            if prompt is not None:
                pool.warm(sizes, prompt)
            # One line per pool compiled at start (an 8B model's take minutes each); none
            # with --precompile none, where a pool compiles when first used.
            if sizes:
                log.info("pool %d of %d ready: gen length %d, prompts up to %d tokens, "
                         "slot counts %s%s, %.1f s", i, len(keys), g, n,
                         ", ".join(map(str, sizes)),
                         " (compiled and warmed)" if prompt is not None else " (compiled)",
                         time.perf_counter() - t0)
        self._emitter = _Emitter(self)
        self._accepting = self._running = True
        self._thread = threading.Thread(target=self._loop, name="asynclane-engine",
                                        daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], *, max_tokens: int,
               options: dict | None = None,
               on_update: Callable[[Update], None]) -> Handle:
        """Queues a request; its updates go to on_update (from the emitter's thread).

        Raises:
          EngineError: a prompt too long or empty, token ids outside the vocabulary,
            max_tokens out of range, an unknown or invalid sampler option, an engine
            that is not running; QueueFull when the queue is at its bound; OverBudget
            when its pool cannot hold one row within the whole budget.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) > self.max_prompt:
            raise EngineError(f"the prompt has {len(prompt)} tokens; this server takes at "
                              f"most {self.max_prompt}")
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise EngineError(f"token ids outside [0, {self.cfg.vocab_size})")
        n = next(n for n in self.prompt_lengths if n >= len(prompt))
        g = self.bucket(int(max_tokens))
        schedule = self._request_schedule(options, g)
        key = (schedule.structure(), g, n)
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down" if self._running else
                                    "the engine is not running")
        self._check_fits(key)
        req = _Request(id=f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", engine=self,
                       prompt=prompt, max_tokens=int(max_tokens), pool_key=key,
                       on_update=on_update, traced=schedule.traced_values())
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down" if self._running else
                                    "the engine is not running")
            if self._waiting() >= self.queue_size:
                raise QueueFull(f"{self.queue_size} requests are already waiting; try again")
            req.seq = next(self._ids)
            self._inbox.append(req)
            self._lock.notify_all()
        return Handle(req)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; with drain, finishes those in flight (else cancels
        them); then stops the threads."""
        with self._lock:
            self._accepting = False
            if not drain:
                for req in self._all_requests():
                    req.cancelled = True
            self._lock.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._running and self._all_requests():
            if deadline is not None and time.monotonic() > deadline:
                for req in self._all_requests():
                    req.cancelled = True
                deadline = None
            time.sleep(0.01)
        with self._lock:
            self._running = False
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._emitter is not None:
            self._flush_updates()  # what the thread held, had it stopped without sending
            self._emitter.flush()
            self._emitter.stop()

    def stats(self) -> dict:
        with self._lock:
            pools = list(self.pools.values())
            return {"slots": self.slots, "slot_buckets": list(self.slot_buckets),
                    "pools": len(pools),
                    "slots_busy": sum(p.decoding for p in pools),
                    "waiting": self._waiting(), "requests_done": self.requests_done,
                    "tokens_sent": self.tokens_sent, "chunks": self.chunks,
                    "kv_budget": self.kv_budget,
                    "pool_bytes": sum(p.held_bytes for p in pools),
                    "model_calls": [{**shape.to_dict(), "calls": n}
                                    for shape, n in dict(self.model_calls).items()],
                    "compile_s": [{"gen_length": p.G, "prompt_length": p.P,
                                   "options": self._shown(p.schedule),
                                   "slots": sorted(p.programs), "held_slots": p.size,
                                   "seconds": round(p.compile_time, 2)}
                                  for p in pools]}

    def gauges(self) -> dict:
        """The engine's state for /metrics, read without its lock (a scrape never waits
        for the loop; each number is a moment's, not all of them the same moment's):
        slots (rows per pool, at most), slots_busy, waiting, pools, pool_bytes (the state
        they hold, from its shapes), kv_budget, compiles and compile_seconds (so far),
        evicted, requests_done, tokens_sent, chunks."""
        pools = list(self.pools.values())  # one step under the GIL: a consistent copy
        return {"slots": self.slots, "slots_busy": sum(p.decoding for p in pools),
                "waiting": len(self._inbox) + sum(len(p.waiting) for p in pools),
                "pools": len(pools), "pool_bytes": sum(p.held_bytes for p in pools),
                "kv_budget": self.kv_budget, "evicted": self.evicted,
                "compiles": self.compiles, "compile_seconds": self.compile_seconds,
                "requests_done": self.requests_done, "tokens_sent": self.tokens_sent,
                "chunks": self.chunks}

    # -- internals ----------------------------------------------------------------------
    def _schedule(self, options, gen_length: int, *, merge: bool = True):
        merged = {**self.options, **(options or {})} if merge else dict(options or {})
        try:
            return make_schedule(self.sampler, gen_length=gen_length,
                                 **merged).bind(self.tokenizer, self.cfg)
        except SamplerError as e:
            raise EngineError(str(e)) from None
        except (TypeError, ValueError, OverflowError) as e:  # an option's value
            raise EngineError(f"{self.sampler}: {type(e).__name__}: {e}") from None

    def _key(self, options, gen_length: int, prompt_length: int) -> tuple:
        """A pool's key: the schedule's structure (traced options left out), the
        generation bucket, the prompt bucket."""
        return (self._request_schedule(options, gen_length).structure(), gen_length,
                prompt_length)

    def _allowed(self, gen_length: int) -> list:
        """The structures of the allowed configurations at a generation bucket (the
        server's own first)."""
        if gen_length not in self._structures:
            self._structures[gen_length] = [
                self._schedule(c, gen_length, merge=False).structure() for c in self.configs]
        return self._structures[gen_length]

    def _request_schedule(self, options, gen_length: int):
        """The schedule a request's options give (over the server's), validated; its
        traced options (thresholds) take any valid value, its structure must be one
        of the allowed configurations'.

        Raises:
          EngineError: an unknown or invalid option; OptionNotAllowed: a structural
            option that no allowed configuration has.
        """
        schedule = self._schedule(options, gen_length)
        allowed = self._allowed(gen_length)
        if schedule.structure() in allowed:
            return schedule
        traced = set(schedule.traced_options)
        asked = {k: v for k, v in (options or {}).items() if k not in traced}
        shown = sorted(set(asked) | {k for c in self.configs[1:] for k in c
                                     if k not in traced})
        choices = " | ".join(", ".join(f"{k}={getattr(a, k, None)!r}" for k in shown)
                             for a in allowed)
        sent = ", ".join(f"{k}={v!r}" for k, v in sorted(asked.items()))
        per_row = ", ".join(sorted(traced)) or "none"
        raise OptionNotAllowed(
            f"{self.sampler}: {sent} would need a compiled program of its own; this "
            f"server allows {choices} (set when it starts); options a request may set "
            f"to any valid value: {per_row}")

    @staticmethod
    def _shown(schedule) -> dict:
        """A pool's settings for /health: its structure's, with the traced options
        (each row's own) named instead of their placeholder values."""
        traced = set(schedule.traced_options)
        out = {k: v for k, v in schedule.settings().items() if k not in traced}
        if traced:
            out["per_request"] = sorted(traced)
        return out

    def _layout(self, key) -> tuple:
        """(PoolShape, batch axes) of a pool key, from shapes (cached)."""
        with self._layout_lock:
            if key not in self._layouts:
                schedule, g, n = key
                P = prompt_bucket(n, g, self.cfg, n)
                if len(self._layouts) >= 4 * self.max_pools:
                    self._layouts.pop(next(iter(self._layouts)))
                self._layouts[key] = pool_layout(self.graphdef, self.params, schedule,
                                                 (1, P + g), self.cfg.mask_token_id,
                                                 self.seed)
            return self._layouts[key]

    def _check_fits(self, key) -> None:
        shape = self._layout(key)[0]
        if shape.bytes(1) > self.kv_budget:
            raise OverBudget(
                f"a request at generation length {key[1]} (prompt bucket {key[2]}) needs "
                f"{budget_lib.size_text(shape.bytes(1))} of decode state, more than this "
                f"server's whole budget ({budget_lib.size_text(self.kv_budget)}); ask for "
                "fewer max_tokens")

    def _warm_prompt(self) -> list[int]:
        """The prompt `_Pool.warm` decodes (made once per start): a short question
        through the tokenizer's chat template (or the tokenizer alone), so that rows
        decode for a while as requests' rows do; [0] without a tokenizer."""
        tok, text = self.tokenizer, "x = 4 y = 9 (1) y = x + 3 print y"
        try:
            if getattr(tok, "chat_template", None):
                text = tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=False)
                return list(tok.encode(text, add_special_tokens=False)) or [0]
            return list(tok.encode(text)) or [0]
        except Exception:  # no tokenizer, or one that cannot: any prompt warms the paths
            return [0]

    def _pool(self, key) -> _Pool:
        if key not in self.pools:
            self.pools[key] = _Pool(self, *key)
            self._trim_pools(keep=key)
        return self.pools[key]

    def _trim_pools(self, keep=None) -> None:
        idle = sorted((p for p in self.pools.values()
                       if not p.live and not p.waiting and p.key != keep),
                      key=lambda p: p.last_used)
        while len(self.pools) > self.max_pools and idle:
            p = idle.pop(0)
            del self.pools[p.key]
            self.evicted += 1

    def _waiting(self) -> int:
        pools = list(self.pools.values())  # a copy: the engine's thread adds and drops pools
        return len(self._inbox) + sum(len(p.waiting) for p in pools)

    def _all_requests(self) -> list[_Request]:
        out = list(self._inbox)
        for p in list(self.pools.values()):
            out += list(p.waiting) + [r for r in p.rows if r is not None and r is not _RETIRED]
        return out

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while (self._running and not self._inbox
                       and not any(p.live or p.waiting for p in list(self.pools.values()))):
                    self._flush_updates()  # nothing to dispatch: send what is held now
                    self._lock.wait(timeout=0.5)
                if not self._running:
                    self._flush_updates()
                    return
                inbox, self._inbox = self._inbox, []
            self._arrived(len(inbox))
            for req in inbox:
                try:
                    self._pool(req.pool_key).waiting.append(req)
                except Exception as e:  # a pool that cannot be built fails its requests only
                    self._finish(req, "error", error=f"{type(e).__name__}: {e}")
            done = self.requests_done
            ran = self._round()
            if not ran:  # requests wait for memory, or all were cancelled: do not spin
                self._flush_updates()
                with self._lock:
                    self._lock.wait(timeout=0.01)
            else:
                self._answered(self.requests_done - done)

    def _arrived(self, n: int) -> None:
        """n requests came in: as many fewer are expected in the admission window."""
        self._expected = max(0, self._expected - n)

    def _answered(self, n: int) -> None:
        """A round finished n requests. The clients just answered often send their next
        request at once: until as many arrive (or the window passes), chunks are one
        iteration long, so each is admitted at the next iteration, not a chunk later."""
        if n > 0 and self.admission_window > 0:
            self._expected = min(self._expected + n, self.slots * len(self.pools))
            self._window_end = time.monotonic() + self.admission_window

    def _window_open(self) -> bool:
        """Whether requests are expected in an open admission window (closes it once
        its time has passed)."""
        if self._expected <= 0:
            return False
        if time.monotonic() >= self._window_end:
            self._expected = 0
            return False
        return True

    def _short(self, pool: _Pool, admit: int) -> bool:
        """Whether a pool's next chunk is one iteration long: an admission window is
        open (`admission_window`) and the pool will have a free slot and nobody waiting
        once it admits `admit` requests."""
        return (self._window_open() and len(pool.waiting) <= admit
                and pool.live + len(pool.waiting) < pool.size)

    def _round(self) -> bool:
        """One chunk of every pool with rows or admissions, at the sizes `plan` gives;
        whether any chunk ran."""
        pools = list(self.pools.values())
        for p in pools:  # cancelled waiting requests leave the queue now
            for req in [r for r in p.waiting if r.cancelled]:
                p.waiting.remove(req)
                self._finish(req, "cancelled")
        decisions = budget_lib.plan([p.view() for p in pools], self.slot_buckets,
                                    self.kv_budget)
        if self._window_open() and not any(p.waiting for p in pools):
            # Requests are expected and no pool waits for memory: a pool with rows in
            # flight keeps its slot count (bytes it holds already), so the expected
            # requests find free slots rather than the rows moving down and back up.
            for p in pools:
                d = decisions[p.key]
                if p.live and d.size < p.size:
                    decisions[p.key] = budget_lib.Decision(size=p.size, admit=d.admit)
        ran = False
        # Shrinks and releases first, so that the bytes are free before others grow.
        order = sorted(pools, key=lambda p: decisions[p.key].size - p.size)
        for p in order:
            d = decisions[p.key]
            if d.size == 0 and p.size:
                self.evicted += not p.live
            try:
                p.resize(d.size)
                if p.size and (p.live or d.admit):
                    p.run_chunk(d.admit, 1 if self._short(p, d.admit) else None)
                    ran = True
            except Exception as e:  # fail this pool's requests, keep serving
                p.fail(f"{type(e).__name__}: {e}")
        self._trim_pools()
        return ran

    def _advance(self, req: _Request, gen: np.ndarray, finished: bool) -> bool:
        """Hands the emitter what a request's contiguous committed prefix gained; whether
        it is done."""
        masked = np.flatnonzero(gen == self.cfg.mask_token_id)
        ready = int(masked[0]) if len(masked) else len(gen)
        stops = np.flatnonzero(self._is_stop[gen[:ready]])
        end = min(ready, int(stops[0]) if len(stops) else ready, req.max_tokens)
        reason = None
        if len(stops) and int(stops[0]) < req.max_tokens:
            reason = "stop"
        elif end >= req.max_tokens:
            reason = "length"
        elif finished:  # the step cap, with masks left
            reason = "error"
        if reason is None and end <= req.sent:
            return False
        tokens = gen[:end].tolist()
        start, req.sent = req.sent, end
        self.tokens_sent += end - start
        if reason is not None:
            req.done = True
            self.requests_done += 1
        self._emit((req, tokens, start, reason,
                    "the decode hit its step cap" if reason == "error" else None))
        return reason is not None

    def _deliver(self, req: _Request, tokens: list[int], start: int, reason: str | None,
                 error: str | None) -> None:
        """On the emitter's thread: the text `tokens` (the request's final prefix so far)
        add, sent with the tokens after `start`."""
        if tokens is None:  # cancelled, or failed: no new tokens
            new, new_text, count = [], "", start
        else:
            new, count = tokens[start:], len(tokens)
            text = self._text(tokens)
            new_text = text[len(req.text):] if text.startswith(req.text) else ""
            if reason is None and new_text.endswith("\ufffd"):
                new_text = ""  # a character not yet whole
            if reason is not None and not text.startswith(req.text):
                new_text = text  # the tokenizer re-read earlier text; send what is final
        req.text += new_text
        update = Update(token_ids=new, text=new_text, finished=reason is not None,
                        finish_reason=reason, prompt_tokens=len(req.prompt),
                        completion_tokens=count, error=error)
        try:
            req.on_update(update)
        except Exception:  # a failing consumer must not stop the engine
            req.cancelled = True

    def _text(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _finish(self, req: _Request, reason: str, *, error: str | None = None) -> None:
        """Ends a request without new tokens (cancelled, or an error)."""
        if req.done:
            return
        req.done = True
        self.requests_done += 1
        if self._emitter is None:  # not started: nothing to hand over to
            return
        self._emit((req, None, req.sent, reason, error))

    def _emit(self, item) -> None:
        """Holds a request's update for the emitter until `_flush_updates` (on the
        engine's thread: after the next chunk's dispatch, or before the thread waits).
        One list keeps every request's updates in order."""
        self._pending.append(item)

    def _flush_updates(self) -> None:
        """Hands the held updates to the emitter, in order."""
        if self._pending and self._emitter is not None:
            items, self._pending = self._pending, []
            self._emitter.put_many(items)


def prompt_buckets(cfg, gen_lengths: Sequence[int], max_prompt: int | None,
                   prompt_lengths: Sequence[int] | None) -> tuple[int, tuple[int, ...]]:
    """(max_prompt, prompt buckets) as the Engine's arguments describe them.

    Raises:
      EngineError: a max_prompt the model cannot hold with the largest bucket, or
        prompt lengths that are not positive.
    """
    room = cfg.max_seq_len - max(gen_lengths)
    max_prompt = room if max_prompt is None else int(max_prompt)
    if not 1 <= max_prompt <= room:
        raise EngineError(f"max_prompt={max_prompt}: the model holds {cfg.max_seq_len} "
                          f"tokens, so at most {room} with generation bucket "
                          f"{max(gen_lengths)}")
    default = [n for n in (128, max_prompt) if n <= max_prompt]
    lengths = tuple(sorted({min(int(n), max_prompt) for n in (prompt_lengths or default)}))
    if lengths[0] < 1:
        raise EngineError(f"prompt_lengths {tuple(prompt_lengths)}: give positive lengths")
    if lengths[-1] < max_prompt:
        lengths += (max_prompt,)
    return max_prompt, lengths


def device_memory(devices=None) -> tuple[int | None, int | None]:
    """(bytes limit, bytes in use) summed over the devices, where JAX reports them."""
    limit = used = 0
    for d in devices or jax.local_devices():
        try:
            s = d.memory_stats() or {}
        except Exception:  # a backend without memory stats
            s = {}
        if not s.get("bytes_limit"):
            return None, None
        limit += int(s["bytes_limit"])
        used += int(s.get("bytes_in_use", 0))
    return limit, used
