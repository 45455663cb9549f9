"""Continuous batching over the decode loop's row slots.

The engine keeps, per (sampler settings, generation bucket), a pool of `slots` rows
carried on the device between calls of one compiled program, `driver.serve_chunk`: it
retires cancelled rows, admits waiting requests into free rows (their first model call
inside the same program) and runs up to `chunk` loop iterations. Between chunks the
engine's thread reads the canvas back, sends every request the tokens its contiguous
committed prefix gained (a diffusion LM commits out of order: a token is sent only when
every token before it is committed, and never again), and frees the rows that are done.

A request's tokens are `generate`'s for the same prompt and settings at gen_length =
its bucket (the smallest configured generation length >= max_tokens), cut at
max_tokens: rows never see each other, and a row decodes the same whatever its left
padding.

Requests with per-request sampler options run in a pool of their own, compiled on
first use (the engine's thread compiles it while other pools wait).

`stats()` (for /health) and `gauges()` (for /metrics, read without the engine's lock)
report the rows in use, the queue, the pools with their K/V bytes, and the compiles.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
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


class EngineError(ValueError):
    """A request the engine cannot take (its message is for the client)."""


class QueueFull(EngineError):
    """The waiting queue is at its bound."""


class EngineStopped(EngineError):
    """The engine is not taking requests (not started, or shutting down)."""


@dataclasses.dataclass
class Update:
    """What a request gained since its last update (called from the engine's thread)."""

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
    cancelled: bool = False
    sent: int = 0  # tokens sent
    text: str = ""  # text sent
    done: bool = False


class _Pool:
    """One compiled program: a schedule at one generation bucket over the slot rows."""

    def __init__(self, engine: Engine, schedule, gen_length: int, prompt_length: int):
        self.engine, self.schedule, self.G = engine, schedule, gen_length
        cfg = engine.cfg
        self.P = prompt_bucket(prompt_length, gen_length, cfg, prompt_length)
        self.T = self.P + gen_length
        b = engine.slots
        self.rows: list[_Request | None] = [None] * b
        self.waiting: collections.deque[_Request] = collections.deque()
        self.pad_len = np.zeros(b, np.int32)
        self.operands = jax.tree.map(jnp.asarray, schedule.operands())
        graphdef, params = engine.graphdef, engine.params
        canvas = jnp.full((b, self.T), cfg.mask_token_id, jnp.int32)
        rng = jax.random.key(engine.seed)
        t0 = time.perf_counter()
        init = jax.jit(lambda c, r, o: driver.serve_init(graphdef, params, c, r, o,
                                                         schedule=schedule))
        self.state = init(canvas, rng, self.operands)
        # The K/V cache's bytes, from its shapes (0 when the schedule keeps none).
        self.kv_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                            for x in jax.tree.leaves(self.state.cache))
        chunk = jax.jit(lambda p, st, pad, adm, cin, ret, k, o: driver.serve_chunk(
            graphdef, p, st, pad, adm, cin, ret, k, o, schedule=schedule),
            donate_argnums=(1,))
        args = (params, self.state, jnp.asarray(self.pad_len), jnp.zeros((b,), bool),
                canvas, jnp.zeros((b,), bool), jnp.asarray(1, jnp.int32), self.operands)
        self.fn = chunk.lower(*args).compile()
        self.compile_time = time.perf_counter() - t0

    @property
    def busy(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def decoding(self) -> int:
        """Rows decoding a request (not those retired at the next chunk)."""
        return sum(r is not None and r is not _RETIRED for r in self.rows)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.busy > 0

    def run_chunk(self) -> None:
        eng, cfg, b = self.engine, self.engine.cfg, self.engine.slots
        admit = np.zeros(b, bool)
        retire = np.zeros(b, bool)
        canvas_in = np.full((b, self.T), cfg.mask_token_id, np.int32)
        for i, req in enumerate(self.rows):
            if req is not None and req.cancelled:
                retire[i] = True
                self.rows[i] = None
                eng._finish(req, "cancelled")
        for i in range(b):
            while self.rows[i] is None and self.waiting:
                req = self.waiting.popleft()
                if req.cancelled:
                    eng._finish(req, "cancelled")
                    continue
                canvas, pad, _ = build_canvas([req.prompt], self.G, cfg, self.P)
                canvas_in[i], self.pad_len[i] = canvas[0], pad[0]
                admit[i] = True
                self.rows[i] = req
        self.state = self.fn(eng.params, self.state, jnp.asarray(self.pad_len),
                             jnp.asarray(admit), jnp.asarray(canvas_in), jnp.asarray(retire),
                             jnp.asarray(eng.chunk, jnp.int32), self.operands)
        gen = np.asarray(self.state.canvas)[:, self.P:]
        finished = np.asarray(self.state.finished)
        eng.chunks += 1
        for i, req in enumerate(self.rows):
            if req is not None and eng._advance(req, gen[i], bool(finished[i])):
                self.rows[i] = None
                if not finished[i]:  # done by max_tokens: retire the row next chunk
                    self.rows[i] = _RETIRED


_RETIRED = _Request(id="retired", engine=None, prompt=[], max_tokens=0, pool_key=(),
                    on_update=lambda u: None, cancelled=True, done=True)


class Engine:
    """Continuous batching of requests over `slots` rows of the compiled decode loop.

    Args:
      model, tokenizer: a loaded model and its tokenizer (`asynclane_jax.load`).
      model_name: the name clients ask for.
      sampler, options: the sampler and its options for every request (a request may
        add options of the same sampler; each distinct setting is a pool of its own).
      slots: rows per pool.
      gen_lengths: the generation buckets; a request runs at the smallest bucket that
        holds its max_tokens.
      chunk: loop iterations per chunk (between two reads of the canvas).
      queue_size: requests waiting for a row, at most (then QueueFull).
      max_prompt: the longest prompt (tokens); default the model's maximum sequence
        length less the largest bucket.
      prompt_lengths: the prompt buckets (default: 128 and max_prompt, or max_prompt
        alone when it is at most 128); a request's prompt is left-padded to the
        smallest that holds it (every call computes every row at its pool's length).
      seed: PRNG seed of every pool (samplers that draw random numbers share one key
        per pool, so a per-request seed is not honoured).
    """

    def __init__(self, model, tokenizer, *, model_name: str, sampler: str = DEFAULT_SAMPLER,
                 options: dict | None = None, slots: int = 8,
                 gen_lengths: Sequence[int] = (128, 256, 512), chunk: int = 8,
                 queue_size: int = 64, max_prompt: int | None = None,
                 prompt_lengths: Sequence[int] | None = None, seed: int = 0,
                 compile_cache: str | None = None):
        if compile_cache:
            from asynclane_jax import compile_cache as cc

            cc.enable(compile_cache)
        for name, value in (("slots", slots), ("chunk", chunk), ("queue_size", queue_size)):
            if int(value) < 1:
                raise EngineError(f"{name}={value}: must be at least 1")
        self.gen_lengths = tuple(sorted({int(g) for g in gen_lengths}))
        if not self.gen_lengths or self.gen_lengths[0] < 1:
            raise EngineError(f"gen_lengths {tuple(gen_lengths)}: give positive lengths")
        self.model, self.tokenizer, self.cfg = model, tokenizer, model.cfg
        self.model_name, self.sampler = model_name, sampler
        self.options = dict(options or {})
        self.slots, self.chunk, self.queue_size, self.seed = slots, chunk, queue_size, seed
        room = self.cfg.max_seq_len - self.gen_lengths[-1]
        self.max_prompt = room if max_prompt is None else int(max_prompt)
        if not 1 <= self.max_prompt <= room:
            raise EngineError(f"max_prompt={self.max_prompt}: the model holds "
                              f"{self.cfg.max_seq_len} tokens, so at most {room} with "
                              f"generation bucket {self.gen_lengths[-1]}")
        default = [n for n in (128, self.max_prompt) if n <= self.max_prompt]
        self.prompt_lengths = tuple(sorted({min(int(n), self.max_prompt)
                                            for n in (prompt_lengths or default)}))
        if self.prompt_lengths[0] < 1:
            raise EngineError(f"prompt_lengths {tuple(prompt_lengths)}: give positive lengths")
        if self.prompt_lengths[-1] < self.max_prompt:
            self.prompt_lengths += (self.max_prompt,)
        self.graphdef, self.params = nnx.split(model)
        self.stop_ids = set(self.cfg.stop_token_ids)
        self.pools: dict[tuple, _Pool] = {}
        self._lock = threading.Condition()
        self._inbox: list[_Request] = []
        self._accepting = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.requests_done = 0
        self.tokens_sent = 0
        self.chunks = 0
        self.compiles = 0  # pools compiled, and the seconds that took
        self.compile_seconds = 0.0
        self._schedule(None, self.gen_lengths[0])  # a bad sampler or option fails here

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
        """Compiles the default pools and starts the engine's thread."""
        for g in self.gen_lengths:
            for n in self.prompt_lengths:
                self._pool(self._key(None, g, n))
        self._accepting = self._running = True
        self._thread = threading.Thread(target=self._loop, name="asynclane-engine",
                                        daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], *, max_tokens: int,
               options: dict | None = None,
               on_update: Callable[[Update], None]) -> Handle:
        """Queues a request; its updates go to on_update (from the engine's thread).

        Raises:
          EngineError: a prompt too long or empty, token ids outside the vocabulary,
            max_tokens out of range, an unknown or invalid sampler option, an engine
            that is not running; QueueFull when the queue is at its bound.
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
        key = self._key(options, self.bucket(int(max_tokens)), n)
        req = _Request(id=f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", engine=self,
                       prompt=prompt, max_tokens=int(max_tokens), pool_key=key,
                       on_update=on_update)
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down" if self._running else
                                    "the engine is not running")
            if self._waiting() >= self.queue_size:
                raise QueueFull(f"{self.queue_size} requests are already waiting; try again")
            self._inbox.append(req)
            self._lock.notify_all()
        return Handle(req)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; with drain, finishes those in flight (else cancels
        them); then stops the thread."""
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

    def stats(self) -> dict:
        with self._lock:
            return {"slots": self.slots, "pools": len(self.pools),
                    "slots_busy": sum(p.decoding for p in self.pools.values()),
                    "waiting": self._waiting(), "requests_done": self.requests_done,
                    "tokens_sent": self.tokens_sent, "chunks": self.chunks,
                    "compile_s": [{"gen_length": k[1], "prompt_length": k[2],
                                   "options": k[0].settings(), "seconds": round(p.compile_time, 2)}
                                  for k, p in self.pools.items()]}

    def gauges(self) -> dict:
        """The engine's state for /metrics, read without its lock (a scrape never waits
        for the loop; each number is a moment's, not all of them the same moment's):
        slots (rows per pool), slots_busy, waiting, pools, pool_bytes (their K/V caches,
        from the shapes), compiles and compile_seconds (so far), requests_done,
        tokens_sent, chunks."""
        pools = list(self.pools.values())  # one step under the GIL: a consistent copy
        return {"slots": self.slots, "slots_busy": sum(p.decoding for p in pools),
                "waiting": len(self._inbox) + sum(len(p.waiting) for p in pools),
                "pools": len(pools), "pool_bytes": sum(p.kv_bytes for p in pools),
                "compiles": self.compiles, "compile_seconds": self.compile_seconds,
                "requests_done": self.requests_done, "tokens_sent": self.tokens_sent,
                "chunks": self.chunks}

    # -- internals ----------------------------------------------------------------------
    def _schedule(self, options, gen_length: int):
        merged = {**self.options, **(options or {})}
        try:
            return make_schedule(self.sampler, gen_length=gen_length,
                                 **merged).bind(self.tokenizer, self.cfg)
        except SamplerError as e:
            raise EngineError(str(e)) from None
        except (TypeError, ValueError, OverflowError) as e:  # an option's value
            raise EngineError(f"{self.sampler}: {type(e).__name__}: {e}") from None

    def _key(self, options, gen_length: int, prompt_length: int) -> tuple:
        return (self._schedule(options, gen_length), gen_length, prompt_length)

    def _pool(self, key) -> _Pool:
        if key not in self.pools:
            pool = _Pool(self, *key)
            self.compiles += 1
            self.compile_seconds += pool.compile_time
            self.pools[key] = pool
        return self.pools[key]

    def _waiting(self) -> int:
        return len(self._inbox) + sum(len(p.waiting) for p in self.pools.values())

    def _all_requests(self) -> list[_Request]:
        out = list(self._inbox)
        for p in self.pools.values():
            out += list(p.waiting) + [r for r in p.rows if r is not None and r is not _RETIRED]
        return out

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while (self._running and not self._inbox
                       and not any(p.has_work() for p in self.pools.values())):
                    self._lock.wait(timeout=0.5)
                if not self._running:
                    return
                inbox, self._inbox = self._inbox, []
            for req in inbox:
                try:
                    self._pool(req.pool_key).waiting.append(req)
                except Exception as e:  # a pool that cannot compile fails its requests only
                    self._finish(req, "error", error=f"{type(e).__name__}: {e}")
            for pool in list(self.pools.values()):
                if pool.has_work():
                    try:
                        pool.run_chunk()
                    except Exception as e:  # fail this pool's requests, keep serving
                        for j, req in enumerate(pool.rows):
                            if req is not None and req is not _RETIRED:
                                self._finish(req, "error", error=f"{type(e).__name__}: {e}")
                            pool.rows[j] = None
                        while pool.waiting:
                            self._finish(pool.waiting.popleft(), "error",
                                         error=f"{type(e).__name__}: {e}")

    def _advance(self, req: _Request, gen: np.ndarray, finished: bool) -> bool:
        """Sends a request what its contiguous committed prefix gained; whether it is
        done."""
        mask = self.cfg.mask_token_id
        masked = np.flatnonzero(gen == mask)
        ready = int(masked[0]) if len(masked) else len(gen)
        stops = [j for j in range(ready) if int(gen[j]) in self.stop_ids]
        end = min(ready, stops[0] if stops else ready, req.max_tokens)
        reason = None
        if stops and stops[0] < req.max_tokens:
            reason = "stop"
        elif end >= req.max_tokens:
            reason = "length"
        elif finished:  # the step cap, with masks left
            reason = "error"
        tokens = [int(t) for t in gen[:end]]
        text = self._text(tokens)
        new_text = text[len(req.text):] if text.startswith(req.text) else ""
        if reason is None and new_text.endswith("\ufffd"):
            new_text = ""  # a character not yet whole
        new = tokens[req.sent:]
        if reason is not None and not text.startswith(req.text):
            new_text = text  # the tokenizer re-read earlier text; send what is final
        if reason is None and not new:
            return False
        req.sent = end
        req.text += new_text
        self.tokens_sent += len(new)
        if reason is None:
            self._emit(req, Update(token_ids=new, text=new_text, finished=False,
                                   finish_reason=None, prompt_tokens=len(req.prompt),
                                   completion_tokens=req.sent))
            return False
        self._finish(req, reason, token_ids=new, text=new_text,
                     error="the decode hit its step cap" if reason == "error" else None)
        return True

    def _text(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _finish(self, req: _Request, reason: str, *, token_ids=(), text: str = "",
                error: str | None = None) -> None:
        if req.done:
            return
        req.done = True
        self.requests_done += 1
        self._emit(req, Update(token_ids=list(token_ids), text=text, finished=True,
                               finish_reason=reason, prompt_tokens=len(req.prompt),
                               completion_tokens=req.sent, error=error))

    def _emit(self, req: _Request, update: Update) -> None:
        try:
            req.on_update(update)
        except Exception:  # a failing consumer must not stop the engine
            req.cancelled = True
