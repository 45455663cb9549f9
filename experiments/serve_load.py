"""Load on `asynclane-jax serve`: concurrent streaming clients against sequential
`generate` calls of the same prompts.

Starts `asynclane-jax serve` on a free port of 127.0.0.1 (a subprocess; the model, the
sampler at its defaults, --slots, one generation bucket --max-tokens), waits for it to
compile, then for each concurrency C in --clients runs C asyncio clients (by default a
minimal client on asyncio's streams, whose events are parsed once the run is over:
`RawConnection`; or aiohttp, or httpx; several, comma-separated, each run in every
repeat), each sending --requests chat completions one after another with stream=true
(the held-out problems of the task set the model was trained on).
Per request it records the time to the first content delta (TTFT), the time to
`data: [DONE]` (the latency) and the completion tokens (the final chunk's usage); per run,
the CPU time of the server process and of this one. The baseline is this process calling
`asynclane_jax.generate` on the same prompts one at a time at gen_length --max-tokens
(compiled first; compile time excluded), so its TTFT is its latency; a second reference
runs `generate` on batches of --slots prompts (the offline ceiling of a loop over that
many rows).
Every streamed answer is checked against the baseline's text for its prompt.

requests/s and tokens/s are over the wall time of a run; tokens are the completion
tokens (before end-of-text). The targets of issue 44 (item 3) are checked on requests/s:
1 client against sequential `generate` (TARGETS), and 8 and 16 clients against
`generate` in batches of --slots; the table reports the best rows' ratio, each repeat's
own ratio (the server against that repeat's reference) and their median, on which the
target is read, with latency p50 / p95 per run. Each run's model calls (the server's, by
shape, from /health; `generate`'s from its stats) are priced as the 8B preset's on v5e
(int8), v6e and H200 by the cost model (docs/costs.md): the projected requests/s and
the targets on those chips. Results: experiments/results/serve/serve.md
and serve.json, with the command that made them (and --note, e.g. what else ran on the
machine).

Usage: python experiments/serve_load.py [--model tiny-llada] [--slots 8]
       [--clients 1,8,16] [--requests 8] [--max-tokens 128] [--chunk 8] [--max-prompt 32]
       [--repeats 3] [--client raw|aiohttp|httpx] [--note TEXT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import pathlib
import platform
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results" / "serve"
# What the results say of the load clients.
CLIENT_NOTE = ("raw: one keep-alive connection per client on asyncio's streams, the events "
               "kept as received and parsed after the run, so that the load takes as little "
               "as it can of the two cores the server decodes on; aiohttp and httpx parse "
               "each event as it comes")
# Issue 44's targets on requests/s: (clients, the reference run, the least ratio).
TARGETS = ((1, "sequential generate", 0.9), (8, "batched", 0.95), (16, "batched", 0.95))
# The chips (and weights) each run's model calls are priced on (`project`).
CHIPS = (("v5e", "int8"), ("v6e", "bf16"), ("h200", "bf16"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int, model: str = "tiny-llada") -> list[str]:
    """The first n held-out problems of the task set `model` was trained on (a shipped
    model's name or a converted folder; the first task set for a model that records
    none)."""
    from asynclane_jax.testbed import tasks

    return [p.prompt for p in tasks.heldout(n, tasks.model_task_set(model))]


def chat_ids(tok, text: str) -> list[int]:
    """A user turn through the tokenizer's chat template, as the server reads a chat
    completion's messages."""
    s = tok.apply_chat_template([{"role": "user", "content": text}],
                                add_generation_prompt=True, tokenize=False)
    return tok.encode(s, add_special_tokens=False)


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, float), q)) if xs else float("nan")


def summary(name: str, clients: int | None, records: list[dict], wall: float) -> dict:
    lat = [r["latency"] for r in records]
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    toks = sum(r["tokens"] for r in records)
    return {"run": name, "clients": clients, "requests": len(records), "wall_s": wall,
            "requests_per_s": len(records) / wall, "tokens_per_s": toks / wall,
            "tokens": toks, "latency_p50_s": pct(lat, 50), "latency_p95_s": pct(lat, 95),
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "matches_baseline": sum(r.get("match", True) for r in records)}


def baseline(loaded, texts: list[str], max_tokens: int,
             slots: int) -> tuple[list[dict], dict, dict]:
    """Sequential `generate` calls, then batches of `slots`: (summaries, {prompt: text},
    {run: its wall time and each call's seconds and model calls}, for `same_prompts`)."""
    import asynclane_jax

    model, tok, cfg = loaded

    stop = set(cfg.stop_token_ids)
    asynclane_jax.generate(model, [chat_ids(tok, texts[0])], gen_length=max_tokens,
                           tokenizer=tok)
    records, answers = [], {}
    steps = []  # (seconds, model calls) of each generate call, in prompt order
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    for text in texts:
        t = time.perf_counter()
        res = asynclane_jax.generate(model, [chat_ids(tok, text)], gen_length=max_tokens,
                                     tokenizer=tok)
        dt = time.perf_counter() - t
        steps.append((dt, call_counts(res.stats)))
        row = [int(x) for x in res.tokens[0]]
        n = next((j for j, x in enumerate(row) if x in stop), len(row))
        answers[text] = res.text[0]
        records.append({"latency": dt, "ttft": dt, "tokens": n})
    rows = [summary("sequential generate", None, records, time.perf_counter() - t0)]
    rows[-1]["load_cpu_ms_per_request"] = 1000 * (cpu_seconds() - cpu0) / len(records)
    rows[-1]["calls"] = calls_list(total_calls(steps))
    parts = {rows[-1]["run"]: {"wall": rows[-1]["wall_s"], "per": 1, "steps": steps}}
    # The offline ceiling of a loop over `slots` rows: generate on batches of that many
    # (every request of a batch waits for the whole batch).
    batches = [texts[k:k + slots] for k in range(0, len(texts), slots)]
    asynclane_jax.generate(model, [chat_ids(tok, x) for x in batches[0]],
                           gen_length=max_tokens, tokenizer=tok)
    records, steps = [], []
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    for batch in batches:
        t = time.perf_counter()
        res = asynclane_jax.generate(model, [chat_ids(tok, x) for x in batch],
                                     gen_length=max_tokens, tokenizer=tok)
        dt = time.perf_counter() - t
        steps.append((dt, call_counts(res.stats)))
        for i, text in enumerate(batch):
            row = [int(x) for x in res.tokens[i]]
            n = next((j for j, x in enumerate(row) if x in stop), len(row))
            records.append({"latency": dt, "ttft": dt, "tokens": n,
                            "match": res.text[i] == answers[text]})
    rows.append(summary(f"generate, batches of {slots}", None, records,
                        time.perf_counter() - t0))
    rows[-1]["load_cpu_ms_per_request"] = 1000 * (cpu_seconds() - cpu0) / len(records)
    rows[-1]["calls"] = calls_list(total_calls(steps))
    parts[rows[-1]["run"]] = {"wall": rows[-1]["wall_s"], "per": slots, "steps": steps}
    return rows, answers, parts


def same_prompts(parts: dict, n: int) -> dict:
    """Each reference run (`baseline`'s parts) restricted to the first n prompts, the ones
    a server run of n requests sent: {run: {"requests", "requests_per_s", "calls"}}. Its
    seconds are the whole run's wall time times those calls' share of the calls' seconds,
    so the reference's host time between calls counts as in the whole run. A reference
    whose calls do not end exactly at prompt n (a batch cut in two) is left out."""
    out = {}
    for name, part in parts.items():
        if n % part["per"] or n // part["per"] > len(part["steps"]):
            continue
        steps = part["steps"][: n // part["per"]]
        share = sum(dt for dt, _ in steps) / sum(dt for dt, _ in part["steps"])
        out[name] = {"run": name, "requests": n, "requests_per_s": n / (part["wall"] * share),
                     "calls": calls_list(total_calls(steps))}
    return out


def reference(served: dict, ref: dict) -> dict:
    """The reference a server run is compared with: `ref` over the prompts the run sent
    (`same_prompts`, kept in the run's row), or the whole `ref` run (rows written
    before the runs kept it)."""
    return (served.get("reference") or {}).get(ref["run"], ref)


def total_calls(steps) -> collections.Counter:
    """The model calls, by shape, of `generate` calls given as (seconds, calls)."""
    total = collections.Counter()
    for _, calls in steps:
        total.update(calls)
    return total


def call_counts(stats) -> collections.Counter:
    """A `generate` call's model calls, by shape."""
    counts = collections.Counter()
    for shape, n in zip(stats.call_shapes, stats.shape_calls):
        if n:
            counts[shape] += int(n)
    return counts


def calls_list(counter) -> list[dict]:
    return [{**shape.to_dict(), "calls": n} for shape, n in counter.items() if n]


def server_calls(url: str) -> collections.Counter:
    """The server's model calls so far, by shape (its /health `model_calls`)."""
    import httpx

    from asynclane_jax.decoding.stats import CallShape

    stats = httpx.get(url + "/health", timeout=10).json()
    return collections.Counter({CallShape.from_dict(c): c["calls"]
                                for c in stats["model_calls"]})


def project(rows: list[dict], model: str) -> None:
    """Fills each row's `projected` {chip: requests/s}: its model calls priced by the
    cost model at the family's 8B preset on each of CHIPS (no host time: on a chip the
    server's host work runs beside the device's)."""
    from asynclane_jax.bench import project as proj
    from asynclane_jax.costs import roofline

    family = proj.family_of_name(model)
    name = proj.DEFAULT_PROJECT_MODELS[family]
    cfg = proj.project_model_config(name, family)
    for row in rows:
        counts = proj.row_counts(row)
        row["projected_model"] = name
        row["projected"] = {
            proj.label(chip, weights): row["requests"] / roofline.decode_time(
                chip, cfg, counts, weights=weights) for chip, weights in CHIPS}


def _chunk_line(line: str, state: dict, t0: float, at: float | None = None) -> bool:
    """Reads one server-sent-event line into `state`; whether it was `[DONE]`. `at`: when
    the line arrived (default: now)."""
    if not line.startswith("data: "):
        return False
    data = line[6:]
    if data == "[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        raise RuntimeError(chunk["error"]["message"])
    piece = chunk["choices"][0]["delta"].get("content") or ""
    if piece and state["ttft"] is None:
        state["ttft"] = (time.perf_counter() if at is None else at) - t0
    state["parts"].append(piece)
    if chunk.get("usage"):
        state["tokens"] = chunk["usage"]["completion_tokens"]
    return False


async def one_request(client, kind: str, url: str, text: str, max_tokens: int,
                      model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    state = {"ttft": None, "parts": [], "tokens": 0}
    if kind == "raw":  # read once the run is over (`_parse_raw`)
        pieces, end = await client.post_stream("/v1/chat/completions",
                                               json.dumps(body).encode())
        return {"t0": t0, "pieces": pieces, "end": end, "prompt": text}
    if kind == "httpx":
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if _chunk_line(line, state, t0):
                    break
    else:
        async with client.post(url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:  # one line at a time
                if _chunk_line(raw.decode().rstrip("\r\n"), state, t0):
                    break
    return {"latency": time.perf_counter() - t0, "ttft": state["ttft"],
            "tokens": state["tokens"], "text": "".join(state["parts"]), "prompt": text}


def _parse_raw(record: dict) -> dict:
    """A raw client's record (the stream's pieces as received) as one_request's."""
    state = {"ttft": None, "parts": [], "tokens": 0}
    if not _read_lines(record["pieces"], state, record["t0"]):
        raise RuntimeError("a stream ended without [DONE]")
    return {"latency": record["end"] - record["t0"], "ttft": state["ttft"],
            "tokens": state["tokens"], "text": "".join(state["parts"]),
            "prompt": record["prompt"]}


def _read_lines(pieces: list[tuple[float, bytes]], state: dict, t0: float) -> bool:
    """Reads a stream's body, received as (arrival time, bytes) pieces, line by line into
    `state` (each line at the time of the piece that completed it); whether it held
    `[DONE]`."""
    buf = b""
    for at, data in pieces:
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if _chunk_line(line.decode().rstrip("\r"), state, t0, at):
                return True
    return False


class RawConnection:
    """The lightest load client: one keep-alive HTTP/1.1 connection on asyncio's streams
    per client. It sends a request as prepared bytes and reads the chunked response's
    pieces with their arrival times, and nothing more while the load runs; the events
    are parsed (`_parse_raw`) once the run is over. On this 2-core machine the load's
    client shares the cores with the server and its decode, so its CPU per request is
    taken from the server under test (about half of aiohttp's here:
    experiments/results/serve/load_client.md)."""

    def __init__(self, url: str):
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.reader = self.writer = None

    async def open(self) -> RawConnection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()

    async def post_stream(self, path: str, body: bytes) -> tuple[list[tuple[float, bytes]],
                                                                  float]:
        """POSTs a JSON body; the response body's pieces (arrival time, bytes) and when
        it ended. Raises RuntimeError on a status other than 200."""
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        headers = dict(line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
        if headers.get("transfer-encoding", "").lower() != "chunked":
            data = await self.reader.readexactly(int(headers.get("content-length", 0)))
            raise RuntimeError(f"HTTP {status}: {data[:500].decode(errors='replace')}")
        pieces = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # the (empty) trailer's end
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: "
                                       + b"".join(p for _, p in pieces)[:500].decode())
                return pieces, time.perf_counter()
            data = await self.reader.readexactly(size + 2)
            pieces.append((time.perf_counter(), data[:-2]))


@contextlib.asynccontextmanager
async def http_client(kind: str, url: str, clients: int, timeout: float):
    """The load's HTTP client: raw (the default: `RawConnection`), aiohttp (about a
    third of httpx's CPU time per streamed request) or httpx."""
    if kind == "raw":
        conns = [await RawConnection(url).open() for _ in range(clients)]
        try:
            yield conns  # one per client
        finally:
            for c in conns:
                await c.close()
        return
    if kind == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=clients + 2)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
            yield c
    else:
        import aiohttp

        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=clients + 2),
                timeout=aiohttp.ClientTimeout(total=timeout)) as c:
            yield c


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of process `pid` (from /proc;
    NaN where there is none)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load_run(url: str, model: str, texts: list[str], clients: int, per_client: int,
                   max_tokens: int, timeout: float,
                   kind: str = "aiohttp") -> tuple[list[dict], float, float]:
    """One load run: its records (one_request's), its wall time and this process's CPU
    seconds over it (the raw client's events are parsed after both are taken)."""
    async with http_client(kind, url, clients, timeout) as client:
        async def worker(k):
            out = []
            own = client[k] if kind == "raw" else client
            for j in range(per_client):
                text = texts[(k * per_client + j) % len(texts)]
                out.append(await one_request(own, kind, url, text, max_tokens, model))
            return out

        t0, cpu0 = time.perf_counter(), cpu_seconds()
        results = await asyncio.wait_for(
            asyncio.gather(*(worker(k) for k in range(clients))), timeout)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    records = [r for rs in results for r in rs]
    if kind == "raw":  # the events are read after the run, when the server is idle
        records = [_parse_raw(r) for r in records]
    return records, wall, cpu


def projected_markdown(rows: list[dict], base: dict, ceiling: dict) -> list[str]:
    """The rows' model calls priced on the chips, and issue 44's ratios there."""
    if not all(r.get("projected") for r in rows):
        return []
    chips = list(rows[0]["projected"])
    lines = ["", f"Projected onto chips: each row's model calls (the same runs), priced by the "
             f"cost model as calls of `{rows[0]['projected_model']}` "
             "(asynclane_jax.costs; docs/costs.md): requests/s if the device's calls were "
             "the only cost. The host's work (HTTP, scheduling, detokenizing) is left out: "
             "on a chip it runs on the host's cores beside the device, where on this CPU it "
             "shares the two cores with the decode. Also left out: the chunk program's own "
             "work between calls (admission, the cache rows zeroed, a state moved between "
             "slot counts).", "",
             "| run | clients | model calls (full + mixed + cached) | " +
             " | ".join(f"{c} requests/s" for c in chips) + " |",
             "|" + "---|" * (3 + len(chips))]
    for r in rows:
        full = sum(c["calls"] for c in r["calls"] if c["kind"] == "full")
        cached = sum(c["calls"] for c in r["calls"] if c["kind"] == "cached")
        mixed = sum(c["calls"] for c in r["calls"] if c["kind"] == "mixed")
        lines.append(f"| {r['run']} | {r['clients'] or '-'} | {full} + {mixed} + {cached} | " +
                     " | ".join(f"{r['projected'][c]:.2f}" for c in chips) + " |")
    served = {(r["run"], r["clients"]): r for r in rows if r["clients"]}
    lines += ["", "| run | clients | reference | " + " | ".join(chips) + " | target |",
              "|" + "---|" * (4 + len(chips))]
    for (run, clients), r in served.items():
        target = [t for t in TARGETS if t[0] == clients]
        if not target:
            continue
        _, ref_name, least = target[0]
        ref = reference(r, base if ref_name == "sequential generate" else ceiling)
        lines.append(f"| {run} | {clients} | {ref['run']} | " + " | ".join(
            f"{r['projected'][c] / ref['projected'][c]:.2f}x" for c in chips) +
            f" | >= {least} |")
    return lines


def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x:.1f}"


def repeat_ratios(all_runs: list[dict], clients: int, ref_run: str,
                  run: str = "serve") -> list[float]:
    """The server's requests/s at `clients` (in the runs named `run`) over that of the
    run named `ref_run` in the same repeat, repeat by repeat (the interleaved ratios)."""
    by_repeat: dict[int, dict] = {}
    for r in all_runs:
        by_repeat.setdefault(r["repeat"], {})[(r["run"], r["clients"])] = r
    ratios = []
    for runs in by_repeat.values():
        ref, served = runs.get((ref_run, None)), runs.get((run, clients))
        if ref is not None and served is not None:
            ratios.append(served["requests_per_s"] / reference(served, ref)["requests_per_s"])
    return ratios


def to_markdown(rows: list[dict], meta: dict, all_runs: list[dict] | None = None) -> str:
    head = ("| run | clients | requests | requests/s | tokens/s | latency p50 s | "
            "latency p95 s | TTFT p50 s | TTFT p95 s | = baseline text | CPU ms / request: "
            "server, this process |")
    lines = [
        "# `asynclane-jax serve` under load",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Model `{meta['model']}`, sampler asynclane at its defaults, server `--slots "
        f"{meta['slots']} --max-tokens {meta['max_tokens']} --chunk {meta['chunk']} --max-prompt "
        f"{meta['max_prompt']}` "
        f"(one generation bucket, {meta['max_tokens']}), backend {meta['backend']}, "
        f"{meta['cpus']} CPU cores (load average {meta['load_before']} before the run). "
        f"Each client sends {meta['requests']} streaming chat completions one after "
        "another (testbed held-out problems, max_tokens "
        f"{meta['max_tokens']}); the baseline calls `generate` on the same prompts one at "
        "a time in one process (compiled first). Latency is to `[DONE]`, TTFT to the first "
        "content delta; tokens are completion tokens. Each row is the best (by "
        f"requests/s) of {meta['repeats']} interleaved repeats (all of them in the JSON). "
        f"The load's HTTP client: {meta['client']} ({CLIENT_NOTE}). "
        "CPU ms / request: CPU "
        "time (user + system, every thread) of the server process and of this one (the "
        "load's clients; for the `generate` rows, the decode itself) over the run, per "
        "request. "
        f"Server start (load + compile): {meta['server_start_s']:.1f} s.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['clients'] or '-'} | {r['requests']} | "
            f"{r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['latency_p50_s']:.3f} | "
            f"{r['latency_p95_s']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | "
            f"{r['matches_baseline']}/{r['requests']} | "
            f"{_ms(r.get('server_cpu_ms_per_request'))}, {_ms(r.get('load_cpu_ms_per_request'))} |")
    base, ceiling = rows[0], rows[1]
    served = {(r["run"], r["clients"]): r for r in rows if r["clients"]}
    lines += ["", "Targets (issue 44, item 3; requests/s of the server over the reference). "
              "The best rows' ratio sets the best server run against the best reference "
              "run, which may come from different repeats; each repeat's own ratio (the "
              "server against the reference run just before it) and their median are "
              "the interleaved figures, and the target is read on the median" + (
                  ". A run of C clients sends the first C x requests prompts, and answers' "
                  "lengths differ from prompt to prompt, so each reference is taken over "
                  "the prompts the run sent: the reference run's wall time times those "
                  "prompts' share of its `generate` calls' seconds, and their model calls "
                  "(the projections below too)" if any(r.get("reference") for r in rows)
                  else "") + ":", "",
              "| run | clients | reference | best rows' ratio | each repeat's ratio | "
              "median | target | met |", "|---|---|---|---|---|---|---|---|"]
    for run in dict.fromkeys(r["run"] for r in rows if r["clients"]):
        for clients, ref_name, least in TARGETS:
            ref = base if ref_name == "sequential generate" else ceiling
            r = served.get((run, clients))
            if r is None:
                lines.append(f"| {run} | {clients} | {ref['run']} | not run | - | - | "
                             f">= {least} | - |")
                continue
            best_ref = max(reference(x, ref)["requests_per_s"] for x in all_runs or [r]
                           if (x["run"], x["clients"]) == (run, clients))
            ratio = r["requests_per_s"] / best_ref
            each = repeat_ratios(all_runs or [], clients, ref["run"], run) or [ratio]
            median = float(np.median(each))
            lines.append(f"| {run} | {clients} | {ref['run']} | {ratio:.2f}x | "
                         f"{', '.join(f'{x:.2f}x' for x in each)} | {median:.2f}x | "
                         f">= {least} | {'yes' if median >= least else 'no'} |")
    others = [r for (_, c), r in served.items() if c not in {t[0] for t in TARGETS}]
    if others:
        lines += ["", "Other runs over sequential `generate`: " + ", ".join(
            f"{r['clients']} client(s) "
            f"{r['requests_per_s'] / reference(r, base)['requests_per_s']:.2f}x"
            for r in others) + "."]
    cost = ceiling["latency_p50_s"] / base["latency_p50_s"]
    lines += ["", f"A `generate` call of {meta['slots']} rows costs {cost:.1f}x one of a single "
              "row here (the latency p50 of the two `generate` rows). The server runs each "
              "chunk at the smallest slot count (1, 2, 4, ...) that holds its rows, so one "
              "client pays for one row."]
    lines += projected_markdown(rows, base, ceiling)
    if meta.get("note"):
        lines += ["", f"Note: {meta['note']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--clients", default="1,8,16")
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=32,
                    help="the server's prompt bucket (the testbed's chat prompts are at most 28 "
                         "tokens, which generate pads to 32)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved repeats; the table keeps each run's best (requests/s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run, at most")
    ap.add_argument("--client", default="raw",
                    help="the load's HTTP client: raw (asyncio streams, events parsed after "
                         "the run; the least CPU taken from the server), aiohttp or httpx; "
                         "comma-separated, each runs every client count in every repeat")
    ap.add_argument("--mixed-calls", action=argparse.BooleanOptionalAction, default=False,
                    help="the server's and the baselines' decodes mix their calls "
                         "(docs/architecture.md, \"Mixed calls\"; off by default, as in "
                         "the driver)")
    ap.add_argument("--out", default=str(RESULTS / "serve"), help="results stem (.md, .json)")
    ap.add_argument("--note", default="", help="a sentence for the results (e.g. what else "
                    "ran on the machine)")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    kinds = args.client.split(",")
    if any(k not in ("raw", "aiohttp", "httpx") for k in kinds):
        ap.error(f"--client {args.client}: expected raw, aiohttp or httpx, comma-separated")
    if max(clients) * args.requests > 256:
        ap.error("at most 256 requests per run")
    n_prompts = max(clients) * args.requests
    texts = prompts(n_prompts, args.model)
    load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "asynclane_jax.cli", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--slots", str(args.slots),
           "--max-tokens", str(args.max_tokens), "--chunk", str(args.chunk),
           "--max-prompt", str(args.max_prompt),
           "--queue", str(max(64, n_prompts)), "--log-level", "warning",
           "--mixed-calls" if args.mixed_calls else "--no-mixed-calls"]
    from asynclane_jax.decoding import driver

    driver.MIXED_CALLS["on"] = args.mixed_calls
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows, all_runs = [], []
    try:
        import httpx

        import asynclane_jax

        while True:
            if server.poll() is not None:
                print(server.stderr.read(), file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > args.timeout:
                raise TimeoutError("the server did not start")
            time.sleep(0.5)
        server_start = time.perf_counter() - t0
        loaded = asynclane_jax.load(args.model)
        # Warm-up: one request (the server's first, and a connection pool's).
        for kind in kinds:
            asyncio.run(load_run(url, args.model, texts[:1], 1, 1, args.max_tokens,
                                 args.timeout, kind))
        best: dict[tuple, dict] = {}
        for rep in range(args.repeats):  # interleaved, so that noise hits every run alike
            # While the server idles: the baselines in this process.
            runs, answers, parts = baseline(loaded, texts, args.max_tokens, args.slots)
            # With several load clients, their order alternates repeat by repeat.
            order = kinds if rep % 2 == 0 else kinds[::-1]
            for kind, c in ((k, c) for k in order for c in clients):
                calls0 = server_calls(url)
                cpu0 = cpu_seconds(server.pid)
                records, wall, load_cpu = asyncio.run(load_run(
                    url, args.model, texts, c, args.requests, args.max_tokens, args.timeout,
                    kind))
                cpu1 = cpu_seconds(server.pid)
                for r in records:
                    r["match"] = r["text"] == answers[r["prompt"]]
                row = summary("serve" if len(kinds) == 1 else f"serve ({kind} client)", c,
                              records, wall)
                row["client"] = kind
                row["server_cpu_ms_per_request"] = 1000 * (cpu1 - cpu0) / len(records)
                row["load_cpu_ms_per_request"] = 1000 * load_cpu / len(records)
                row["calls"] = calls_list(server_calls(url) - calls0)
                row["reference"] = same_prompts(parts, len(records))
                runs.append(row)
            project(runs, args.model)
            for row in runs:
                project(list(row.get("reference", {}).values()), args.model)
            for row in runs:
                row["repeat"] = rep
                all_runs.append(row)
                print(json.dumps(row))
                key = (row["run"], row["clients"])
                if key not in best or row["requests_per_s"] > best[key]["requests_per_s"]:
                    best[key] = row
        rows = list(best.values())
        stats = httpx.get(url + "/health", timeout=5).json()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    import jax

    meta = {"command": shlex.join(["python", "experiments/serve_load.py", *sys.argv[1:]]),
            "model": args.model, "slots": args.slots, "max_tokens": args.max_tokens,
            "chunk": args.chunk, "max_prompt": args.max_prompt, "requests": args.requests,
            "repeats": args.repeats, "client": args.client,
            "backend": jax.default_backend(),
            "cpus": os.cpu_count(), "platform": platform.platform(), "load_before": load_before,
            "server_start_s": server_start, "server_stats": stats, "note": args.note}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": rows, "all_runs": all_runs}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    md = to_markdown(rows, meta, all_runs)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
