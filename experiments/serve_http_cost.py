"""The HTTP path's own cost in `asynclane-jax serve`: CPU per streamed request with an
engine that costs nothing.

On a 2-core machine the server's host work (HTTP, JSON, server-sent events) takes the
cores the decode runs on, so every millisecond of it per request is a millisecond the
model does not get (experiments/serve_load.py measures the two together). This script
measures the host path alone: it starts the real app (`serve.app.create_app`) on the
real uvicorn configuration (`serve.cli.serve_app`) in a subprocess, over a stand-in
engine that answers every request with --updates updates (four tokens of text each, one
round every --tick seconds for all requests in flight, from a thread of its own, as the
engine's emitter does), and the model's tokenizer and chat template. --clients asyncio
clients (serve_load's load client, --client: raw, aiohttp or httpx) each send --requests
streaming chat completions one after another. Per run: requests/s, the server's and this
process's CPU ms per request, and the events per request.

With --roots A,B (two checkouts of this repository) both servers run, each on its own
tree's code, and the runs alternate A, B, B, A, ... (--pairs pairs), so a change's
effect is read pair by pair on the same machine state. With --client raw,aiohttp the
load clients alternate the same way (over each tree). This script itself needs only the
current tree.

Results: experiments/results/serve/http_cost.md and .json.

Usage: python experiments/serve_http_cost.py [--roots .] [--pairs 4] [--clients 8]
       [--requests 32] [--updates 8] [--client raw] [--note TEXT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "serve"


def serve_stand_in(port: int, updates: int, tick: float) -> None:
    """The server process: the real app and uvicorn over an engine that costs nothing."""
    import threading

    import asynclane_jax
    from asynclane_jax.serve.app import create_app
    from asynclane_jax.serve.cli import serve_app
    from asynclane_jax.serve.engine import Update

    _, tok, model_cfg = asynclane_jax.load("tiny-llada")
    piece = tok.decode(tok.encode(" the answer is", add_special_tokens=False)[:4])

    class Handle:
        def __init__(self, n):
            self.request_id = f"r{n}"

        def cancel(self):
            pass

    class StandIn:
        """The Engine's interface as the app uses it; each request gets `updates`
        updates of four tokens, one per round."""

        model_name, sampler, options, gen_lengths = "tiny-llada", "asynclane", {}, (128,)
        max_prompt, slots, tokenizer, cfg = 32, 8, tok, model_cfg

        def __init__(self):
            self.rows, self.lock, self.n, self.done = [], threading.Lock(), 0, 0

        def start(self):
            threading.Thread(target=self.loop, daemon=True).start()

        def submit(self, prompt_ids, *, max_tokens, options=None, on_update):
            with self.lock:
                self.n += 1
                self.rows.append([on_update, 0])
                return Handle(self.n)

        def loop(self):
            while True:
                time.sleep(tick)
                with self.lock:
                    for row in list(self.rows):
                        row[1] += 1
                        last = row[1] >= updates
                        row[0](Update([0] * 4, piece, last, "stop" if last else None, 20,
                                      4 * row[1]))
                        if last:
                            self.rows.remove(row)
                            self.done += 1

        def shutdown(self, drain=True, timeout=None):
            pass

        def stats(self):
            return {"requests_done": self.done}

        def gauges(self):
            return {"slots": 8, "slots_busy": len(self.rows), "waiting": 0, "pools": 0,
                    "pool_bytes": 0, "compiles": 0, "compile_seconds": 0.0, "kv_budget": 0,
                    "evicted": 0}

    serve_app(create_app(StandIn()), host="127.0.0.1", port=port, log_level="warning")


def start(root: pathlib.Path, updates: int, tick: float):
    """A stand-in server on `root`'s code: (url, process)."""
    import httpx

    sys.path.insert(0, str(HERE))
    import serve_load

    port = serve_load.free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--updates",
                             str(updates), "--tick", str(tick)], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on {root} exited:\n{proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the server on {root} did not start")
        time.sleep(0.3)


def measure(url: str, pid: int, texts: list[str], clients: int, per: int,
            kind: str) -> dict:
    """One load run with the load client `kind` (serve_load's): requests/s, CPU ms per
    request (server, this process), events per request."""
    import serve_load

    events = [0]
    read = serve_load._chunk_line

    def counting(line, state, t0, at=None):
        events[0] += line.startswith("data: ")
        return read(line, state, t0, at)

    serve_load._chunk_line = counting
    try:
        cpu0 = serve_load.cpu_seconds(pid)
        records, wall, own = asyncio.run(serve_load.load_run(
            url, "tiny-llada", texts, clients, per, 128, 300, kind))
        cpu1 = serve_load.cpu_seconds(pid)
    finally:
        serve_load._chunk_line = read
    n = len(records)
    return {"requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "server_cpu_ms_per_request": 1000 * (cpu1 - cpu0) / n,
            "client_cpu_ms_per_request": 1000 * own / n,
            "events_per_request": events[0] / n}


def commit_of(root: pathlib.Path) -> str:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                            "asynclane_jax"], capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + (" + changes" if dirty else "")


def to_markdown(runs: list[dict], meta: dict) -> str:
    kinds = meta["clients_kinds"]
    lines = ["# The HTTP path's own cost: CPU per streamed request, no model", "",
             f"Command: `{meta['command']}`", "",
             f"The real app and uvicorn over an engine that costs nothing "
             f"(experiments/serve_http_cost.py): each request gets {meta['updates']} updates "
             f"of four tokens, a round every {meta['tick']} s; {meta['clients']} clients "
             f"(the load client: {' and '.join(kinds)}; experiments/serve_load.py) each send "
             f"{meta['requests']} streaming chat completions one after "
             f"another (the testbed's held-out prompts, the tiny-llada tokenizer's chat "
             f"template). Runs alternate between the variants (in order, then reversed). "
             f"{meta['machine']}; load average {meta['load']} before the run.", "",
             "| pair | tree | commit | client | requests/s | server CPU ms / request | "
             "this process (clients) CPU ms / request | events / request |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['pair']} | {r['tree']} | {r['commit']} | "
                     f"{r['client']} | "
                     f"{r['requests_per_s']:.0f} | {r['server_cpu_ms_per_request']:.2f} | "
                     f"{r['client_cpu_ms_per_request']:.2f} | "
                     f"{r['events_per_request']:.1f} |")
    lines += ["", "Medians over the pairs:", "",
              "| tree | commit | client | requests/s | server CPU ms / request | clients CPU "
              "ms / request |", "|---|---|---|---|---|---|"]
    for tree in meta["trees"]:
        for kind in kinds:
            rs = [r for r in runs if r["tree"] == tree and r["client"] == kind]
            med = {k: statistics.median(r[k] for r in rs) for k in
                   ("requests_per_s", "server_cpu_ms_per_request",
                    "client_cpu_ms_per_request")}
            lines.append(f"| {tree} | {rs[0]['commit']} | {kind} | "
                         f"{med['requests_per_s']:.0f} | "
                         f"{med['server_cpu_ms_per_request']:.2f} | "
                         f"{med['client_cpu_ms_per_request']:.2f} |")
    if meta["note"]:
        lines += ["", f"Note: {meta['note']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--roots", default=str(REPO),
                    help="comma-separated checkouts whose server code is measured "
                         "(default: this one)")
    ap.add_argument("--pairs", type=int, default=4, help="runs per tree, interleaved")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="requests per client")
    ap.add_argument("--updates", type=int, default=8, help="updates per request")
    ap.add_argument("--tick", type=float, default=0.002, help="seconds between rounds")
    ap.add_argument("--client", default="raw",
                    help="comma-separated load clients (serve_load's: raw, aiohttp, httpx)")
    ap.add_argument("--out", default=str(RESULTS / "http_cost"), help="results stem")
    ap.add_argument("--note", default="")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve_stand_in(args.serve, args.updates, args.tick)
        return 0
    for name in ("pairs", "clients", "requests", "updates"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.clients * args.requests > 512:
        ap.error("at most 512 requests per run")
    kinds = args.client.split(",")
    if not kinds or any(k not in ("raw", "aiohttp", "httpx") for k in kinds):
        ap.error(f"--client {args.client}: expected raw, aiohttp or httpx, comma-separated")
    roots = [pathlib.Path(r).resolve() for r in args.roots.split(",")]
    for r in roots:
        if not (r / "asynclane_jax" / "serve" / "app.py").is_file():
            ap.error(f"--roots: {r} is not a checkout of this repository")
    sys.path.insert(0, str(HERE))
    import serve_load

    texts = serve_load.prompts(args.clients * args.requests)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    trees = [f"{'AB'[i] if len(roots) == 2 else i}" for i in range(len(roots))]
    servers = []
    try:
        for root in roots:
            servers.append(start(root, args.updates, args.tick))
        for url, _ in servers:  # warm-up: the first connection and request
            for kind in kinds:
                asyncio.run(serve_load.load_run(url, "tiny-llada", texts[:args.clients],
                                                args.clients, 1, 128, 300, kind))
        runs = []
        variants = [(i, kind) for i in range(len(roots)) for kind in kinds]
        for pair in range(args.pairs):
            order = variants[::-1] if pair % 2 else variants
            for i, kind in order:
                url, proc = servers[i]
                row = measure(url, proc.pid, texts, args.clients, args.requests, kind)
                row.update(pair=pair, tree=trees[i], root=str(roots[i]),
                           commit=commit_of(roots[i]), client=kind)
                runs.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for _, proc in servers:
            proc.terminate()
            proc.wait()
    meta = {"command": "python experiments/serve_http_cost.py " + shlex.join(sys.argv[1:]),
            "updates": args.updates, "tick": args.tick, "clients": args.clients,
            "requests": args.requests, "trees": trees, "clients_kinds": kinds,
            "note": args.note, "load": load,
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})"}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_md, tmp_json = out.with_suffix(".md.tmp"), out.with_suffix(".json.tmp")
    tmp_md.write_text(to_markdown(runs, meta))
    tmp_json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    tmp_md.replace(out.with_suffix(".md"))
    tmp_json.replace(out.with_suffix(".json"))
    print(to_markdown(runs, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
