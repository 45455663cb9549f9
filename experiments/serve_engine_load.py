"""The serving engine alone, without HTTP: closed-loop clients in this process against
`generate` in batches of the engine's slot count, on the same prompts.

`serve_load.py` measures the whole server: its HTTP stack, and the load's clients, run
on the cores that also decode. This measures what is left when they are taken away. An
`Engine` (the one `asynclane-jax serve` builds: the sampler at its defaults, --slots,
one generation bucket --max-tokens, --chunk, --max-prompt) runs in this process; each of
C client threads submits --requests of the held-out problems (through the tokenizer's
chat template, as the server does) one after another, submitting the next as soon as the
last one's final update arrives. The reference, just before each engine run, calls
`asynclane_jax.generate` on the same prompts in batches of --slots. The runs of every
repeat are interleaved; each repeat's ratio is the engine's requests/s over the
reference's just before it, and the median of the repeats is the figure. Every answer is
checked against `generate`'s text for its prompt. CPU ms / request is this process's CPU
time (every thread) over the run, per request.

`--drivers inline` (or `threads,inline`) adds runs with no thread at all: a second engine,
compiled and warmed the same way and then stopped, whose pool this thread drives as the
engine's loop does (`inline_run`), each client's next request admissible --delays
chunks after its answer. Against the `threads` runs it separates what the engine's
scheduling costs from what its thread hand-offs cost.

Results: experiments/results/serve/engine_load.md and .json (or --out).

Usage: python experiments/serve_engine_load.py [--model tiny-llada] [--clients 8,16]
       [--requests 16] [--repeats 5] [--slots 8] [--max-tokens 128] [--chunk 8]
       [--max-prompt 32] [--drivers threads[,inline]] [--delays 0[,1,...]]
       [--out STEM] [--note TEXT]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import statistics
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_load  # noqa: E402  (its prompts, chat ids, call counts and CPU clock)

RESULTS = HERE / "results" / "serve"


def reference(model, tok, ids: list[list[int]], max_tokens: int, slots: int) -> dict:
    """`generate` on batches of `slots` prompts: requests/s, CPU, texts, model calls."""
    import asynclane_jax

    texts, calls = [], 0
    t0, c0 = time.perf_counter(), serve_load.cpu_seconds()
    for k in range(0, len(ids), slots):
        res = asynclane_jax.generate(model, ids[k:k + slots], gen_length=max_tokens,
                                     tokenizer=tok)
        texts += list(res.text)
        calls += sum(serve_load.call_counts(res.stats).values())
    wall = time.perf_counter() - t0
    return {"requests": len(ids), "wall_s": wall, "requests_per_s": len(ids) / wall,
            "cpu_ms_per_request": 1000 * (serve_load.cpu_seconds() - c0) / len(ids),
            "model_calls": calls, "texts": texts}


def engine_run(engine, ids: list[list[int]], clients: int, max_tokens: int,
               timeout: float) -> dict:
    """`clients` threads, each submitting its share of `ids` one after another."""
    per = len(ids) // clients
    texts: list[str | None] = [None] * len(ids)
    errors: list[str] = []

    def client(k: int) -> None:
        for j in range(k * per, (k + 1) * per):
            done, parts = threading.Event(), []

            def on_update(u, parts=parts, done=done, j=j):
                parts.append(u.text)
                if u.finished:
                    if u.finish_reason not in ("stop", "length"):
                        errors.append(f"prompt {j}: {u.finish_reason} {u.error or ''}")
                    texts[j] = "".join(parts)
                    done.set()

            try:
                engine.submit(ids[j], max_tokens=max_tokens, on_update=on_update)
            except Exception as e:  # refused: the run reports it rather than hanging
                errors.append(f"prompt {j}: {type(e).__name__}: {e}")
                return
            if not done.wait(timeout):
                errors.append(f"prompt {j}: no answer in {timeout} s")
                return

    calls0 = sum(engine.model_calls.values())
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0, c0 = time.perf_counter(), serve_load.cpu_seconds()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    n = per * clients
    return {"requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "cpu_ms_per_request": 1000 * (serve_load.cpu_seconds() - c0) / n,
            "model_calls": sum(engine.model_calls.values()) - calls0, "texts": texts[:n]}


class _Deliver:
    """The emitter of an engine driven inline: each update delivered on this thread, at
    the moment the engine hands it over (after the next chunk's dispatch)."""

    def __init__(self, engine):
        self.engine = engine

    def put_many(self, items) -> None:
        for item in items:
            self.engine._deliver(*item)


def inline_run(engine, ids: list[list[int]], clients: int, max_tokens: int, delay: int,
               timeout: float) -> dict:
    """The engine's pool driven on this thread, as its loop drives it (`_Pool.run_chunk`)
    but with no thread at all: no client threads, no emitter, no engine thread. `clients`
    requests are in flight; a client whose answer arrives sends its next request `delay`
    chunks later (0: in time for the next chunk). The admission window works as in the
    engine's loop (`Engine._short`: one-iteration chunks after a chunk that finished
    requests, until as many arrived or the window passed). `engine` must be stopped (its
    threads gone, its pools and programs kept); its emitter is replaced by `_Deliver`.

    What this measures: the engine's own scheduling (admissions one at a time, chunks
    ending at answers, one-iteration chunks) with every thread hand-off taken away."""
    from asynclane_jax.serve import engine as engine_lib

    per = len(ids) // clients
    n = per * clients
    texts: list[str | None] = [None] * n
    parts: dict[int, list[str]] = {}
    keys = {engine._key(None, engine.bucket(max_tokens),
                        next(m for m in engine.prompt_lengths if m >= len(ids[j])))
            for j in range(n)}
    if len(keys) != 1:
        raise ValueError("the inline driver serves one pool: give prompts of one bucket")
    pool = engine.pools[keys.pop()]
    pool.resize(engine.slots)
    engine._emitter = _Deliver(engine)
    due: list[tuple[int, int]] = []  # (chunk from which it may be admitted, prompt)
    chunks = 0
    errors: list[str] = []

    def submit(j: int) -> None:
        parts[j] = []

        def on_update(u, j=j):
            parts[j].append(u.text)
            if u.finished:
                if u.finish_reason not in ("stop", "length"):
                    errors.append(f"prompt {j}: {u.finish_reason} {u.error or ''}")
                texts[j] = "".join(parts[j])
                k = j // per
                if j + 1 < (k + 1) * per:
                    due.append((chunks + delay, j + 1))

        pool.waiting.append(engine_lib._Request(
            id=f"inline-{j}", engine=engine, prompt=list(ids[j]), max_tokens=max_tokens,
            pool_key=pool.key, on_update=on_update, traced=dict(pool.defaults), seq=j))

    calls0 = sum(engine.model_calls.values())
    t0, c0 = time.perf_counter(), serve_load.cpu_seconds()
    for k in range(clients):
        submit(k * per)
    while any(t is None for t in texts):
        if time.perf_counter() - t0 > timeout or errors:
            raise RuntimeError("; ".join(errors[:5]) or f"no end in {timeout} s")
        for item in [d for d in due if d[0] <= chunks]:
            due.remove(item)
            submit(item[1])
            engine._arrived(1)  # as the loop's inbox
        done = engine.requests_done
        pool.run_chunk(len(pool.waiting), 1 if engine._short(pool, len(pool.waiting))
                       else None)
        engine._answered(engine.requests_done - done)  # as the loop
        if not pool.live and not pool.waiting:
            engine._flush_updates()  # nothing to dispatch: what is held goes now
        chunks += 1
    wall = time.perf_counter() - t0
    return {"requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "cpu_ms_per_request": 1000 * (serve_load.cpu_seconds() - c0) / n,
            "model_calls": sum(engine.model_calls.values()) - calls0, "chunks": chunks,
            "texts": texts}


def to_markdown(meta: dict, rows: list[dict]) -> str:
    out = ["# The serving engine alone (no HTTP) against batched `generate`", "",
           f"Command: `{meta['command']}`", "",
           f"Model `{meta['model']}`, sampler asynclane at its defaults, engine "
           f"`slots={meta['slots']}, chunk={meta['chunk']}, max_prompt={meta['max_prompt']}`"
           f", one generation bucket ({meta['max_tokens']}), backend {meta['backend']}, "
           f"{meta['cores']} CPU cores (load average {meta['load_before']} before the run). "
           "Driver `threads`: each client thread submits its requests one after another "
           "to an `Engine` in this process (the next as soon as the last one's final update "
           "arrives), through the engine's own threads. Driver `inline, delay d`: the "
           "engine's pool driven on the main thread with no thread at all (`inline_run`); "
           "a client's next request may be admitted d chunks after its answer arrives, "
           "the admission window as in the engine's loop. The reference runs "
           f"`generate` on the same prompts in batches of {meta['slots']} just before each "
           "engine run. Ratio: the engine's requests/s over that reference's. CPU ms / "
           "request: this process's CPU time over the run. Model calls: per request, "
           "every shape counted alike.", "",
           "| clients | driver | requests | repeat | reference requests/s "
           "| engine requests/s | ratio | CPU ms / request: reference, engine "
           "| model calls / request: reference, engine | = reference text |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref, eng = r["reference"], r["engine"]
        out.append(
            f"| {r['clients']} | {r['driver']} | {eng['requests']} | {r['repeat']} "
            f"| {ref['requests_per_s']:.2f} | {eng['requests_per_s']:.2f} "
            f"| {r['ratio']:.2f}x | {ref['cpu_ms_per_request']:.1f}, "
            f"{eng['cpu_ms_per_request']:.1f} | {ref['model_calls'] / ref['requests']:.2f}, "
            f"{eng['model_calls'] / eng['requests']:.2f} | {r['matches']}/{eng['requests']} |")
    out += ["", "| clients | driver | each repeat's ratio | median |", "|---|---|---|---|"]
    for c in meta["clients"]:
        for d in dict.fromkeys(r["driver"] for r in rows):
            ratios = [r["ratio"] for r in rows if r["clients"] == c and r["driver"] == d]
            if ratios:
                out.append(f"| {c} | {d} | {', '.join(f'{x:.2f}x' for x in ratios)} "
                           f"| {statistics.median(ratios):.2f}x |")
    if meta.get("note"):
        out += ["", f"Note: {meta['note']}"]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per client")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request, at most")
    ap.add_argument("--drivers", default="threads",
                    help="comma-separated: threads (client threads through the engine's "
                         "threads) and/or inline (no threads; see --delays)")
    ap.add_argument("--delays", default="0",
                    help="the inline driver's round trips, in chunks (comma-separated)")
    ap.add_argument("--out", default=str(RESULTS / "engine_load"), help="results stem")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    if min(clients) < 1 or args.requests < 1 or args.repeats < 1:
        ap.error("--clients, --requests and --repeats must be positive")
    if max(clients) * args.requests > 256:
        ap.error("at most 256 requests per run")
    drivers = args.drivers.split(",")
    if not drivers or any(d not in ("threads", "inline") for d in drivers):
        ap.error(f"--drivers {args.drivers}: threads and/or inline, comma-separated")
    try:
        delays = [int(d) for d in args.delays.split(",")]
    except ValueError:
        ap.error(f"--delays {args.delays}: whole numbers of chunks, comma-separated")
    if min(delays) < 0:
        ap.error("--delays: at least 0")
    runs = [("threads", None)] * ("threads" in drivers) + \
        [("inline", d) for d in delays] * ("inline" in drivers)

    import jax

    import asynclane_jax
    from asynclane_jax.bench.runner import write_json
    from asynclane_jax.serve.engine import Engine, prompt_buckets

    load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    model, tok, cfg = asynclane_jax.load(args.model)
    texts = serve_load.prompts(max(clients) * args.requests, args.model)
    ids = [serve_load.chat_ids(tok, t) for t in texts]
    max_prompt, lengths = prompt_buckets(cfg, (args.max_tokens,), args.max_prompt, None)
    def make_engine():
        eng = Engine(model, tok, model_name=args.model, slots=args.slots,
                     gen_lengths=(args.max_tokens,), chunk=args.chunk, queue_size=256,
                     max_prompt=max_prompt, prompt_lengths=lengths)
        eng.start()
        return eng

    engine = make_engine()
    inline = None
    if "inline" in drivers:  # compiled and warmed as a server's, then its threads stopped
        inline = make_engine()
        inline.shutdown()
    rows = []
    try:
        # Compiled and run once each before the timed runs (`generate` at every batch
        # size the runs use).
        for size in sorted({args.slots} | {(c * args.requests) % args.slots or args.slots
                                           for c in clients}):
            reference(model, tok, ids[:size], args.max_tokens, args.slots)
        k = min(args.slots, len(ids))
        engine_run(engine, ids[:k], k, args.max_tokens, args.timeout)
        if inline is not None:
            inline_run(inline, ids[:k], k, args.max_tokens, 0, args.timeout)
        for rep in range(args.repeats):
            for c in clients:
                part = ids[:c * args.requests]
                for driver, delay in runs:
                    ref = reference(model, tok, part, args.max_tokens, args.slots)
                    if driver == "threads":
                        eng = engine_run(engine, part, c, args.max_tokens, args.timeout)
                        name = "threads"
                    else:
                        eng = inline_run(inline, part, c, args.max_tokens, delay,
                                         args.timeout)
                        name = f"inline, delay {delay}"
                    matches = sum(a == b for a, b in zip(ref.pop("texts"),
                                                         eng.pop("texts")))
                    rows.append({"clients": c, "driver": name, "repeat": rep,
                                 "reference": ref, "engine": eng,
                                 "ratio": eng["requests_per_s"] / ref["requests_per_s"],
                                 "matches": matches})
                    print(f"repeat {rep} clients {c} {name}: reference "
                          f"{ref['requests_per_s']:.1f}, engine {eng['requests_per_s']:.1f} "
                          f"requests/s ({rows[-1]['ratio']:.2f}x), {matches}/{eng['requests']}"
                          " texts equal", flush=True)
    finally:
        engine.shutdown(drain=False)
    meta = {"command": shlex.join(["python", "experiments/serve_engine_load.py", *sys.argv[1:]]),
            "model": args.model, "slots": args.slots, "chunk": args.chunk,
            "drivers": list(dict.fromkeys(r["driver"] for r in rows)),
            "max_prompt": max_prompt, "max_tokens": args.max_tokens, "clients": clients,
            "backend": jax.default_backend(), "cores": os.cpu_count(),
            "load_before": load_before, "note": args.note}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = to_markdown(meta, rows)
    write_json(out.with_suffix(".json"), meta, rows)
    tmp_md = out.with_suffix(".md.tmp")
    tmp_md.write_text(md)
    tmp_md.replace(out.with_suffix(".md"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
