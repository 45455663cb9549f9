"""`asynclane-jax serve`: an OpenAI-compatible HTTP server with continuous batching.

  asynclane-jax serve --model tiny-llada --port 8000
  asynclane-jax serve --model /models/llada-8b-instruct --sampler fast-dllm --cache dual \\
      --slots 16 --max-tokens 256 --compile-cache /tmp/jax-cache

The sampler and its options are the `generate` flags; they apply to every request. A
request may set the sampler's traced options (thresholds) to any valid value through its
`sampler_options` field, in the programs that exist; its structural options (block
length, cache, lane slots, ...) are these flags', or those of a configuration given with
--allow-options (repeatable, at most 7: each one more pool and its programs), else a
400 naming what is allowed:

  asynclane-jax serve --sampler fast-dllm --cache dual --allow-options cache=prefix

Generation lengths
are buckets, each one compiled program: 128, 256, 512 up to --max-tokens (which is the
largest), or --gen-lengths; a request decodes at the smallest bucket >= its max_tokens.
SIGTERM (or Ctrl-C) stops admitting requests, finishes those in flight (up to
--drain-timeout; the rest get an error) and exits 0.

Memory: a pool runs at the smallest slot count (1, 2, 4, ... --slots) that holds its
rows, and all pools' decode state stays within --kv-budget (a request that does not fit
waits; one that never fits gets a 503). `serve --dry-run` prints the footprint
(weights, each pool's state, the budget) from the model's config alone:

  asynclane-jax serve --dry-run --model llada-8b-instruct --slots 8 --device-memory 141GiB

Locked by default: on a loopback address only requests that name this machine (Host) and
come from no web page (or its own origin) are served; anywhere else an API key is
required (--api-key, --api-key-file or ASYNCLANE_API_KEY), sent as `Authorization: Bearer
<key>`. Bodies are JSON of at most --max-body-bytes.

Needs the serve extra: pip install 'asynclane-jax[serve]'.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from asynclane_jax.errors import UsageError
from asynclane_jax.serve.guard import DEFAULT_MAX_BODY_BYTES

DEFAULT_BUCKETS = (128, 256, 512)
API_KEY_ENV = "ASYNCLANE_API_KEY"
DESCRIPTION = ("An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
               "streaming) with continuous batching over the decode loop's row slots.")


def register(subparsers) -> None:
    """Adds `serve` to the asynclane-jax command line (entry point
    `asynclane_jax.commands`)."""
    from asynclane_jax.generate_cli import DEFAULT_MODEL, _add_sampler_args

    p = subparsers.add_parser("serve", help="an OpenAI-compatible streaming HTTP server",
                              description=DESCRIPTION)
    p.add_argument("--model", default=None,
                   help=f"converted folder or shipped model name (default {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name requests must give as `model` (default: --model, or a "
                        "folder's last part, so that no path of the machine reaches clients)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only); any "
                        "other (e.g. 0.0.0.0) needs an API key")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--slots", type=int, default=8,
                   help="rows of the decode loop, i.e. requests decoded at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="the largest generation bucket: the most tokens a request may ask "
                        "for (default 512); buckets 128, 256, 512 below it and N itself")
    p.add_argument("--gen-lengths", default=None, metavar="N,N,...",
                   help="the generation buckets instead (e.g. 64,128)")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max_tokens of a request that gives none (default: the largest "
                        "bucket)")
    p.add_argument("--max-prompt", type=int, default=None, metavar="N",
                   help="the longest prompt in tokens (default: the model's context less "
                        "the largest bucket); prompts are padded to it, so a smaller one "
                        "compiles and runs faster")
    p.add_argument("--prompt-lengths", default=None, metavar="N,N,...",
                   help="prompt buckets (each one more compiled program per generation "
                        "bucket): a prompt is left-padded to the smallest that holds it "
                        "(default: --max-prompt alone)")
    p.add_argument("--chunk", type=int, default=8, metavar="K",
                   help="loop iterations between admissions and streamed updates, at "
                        "most: a chunk ends sooner when a request's answer is complete "
                        "(default 8)")
    p.add_argument("--queue", type=int, default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default 64)")
    p.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="bytes the pools' decode state (K/V caches, canvas) may hold "
                        "together, e.g. 8GiB or 500MB (default: half the devices' free "
                        "memory after the weights, or a quarter of the host's RAM on a "
                        "CPU); a request that does not fit now waits, one that never "
                        "fits gets a 503")
    p.add_argument("--max-pools", type=int, default=32, metavar="N",
                   help="pools (sampler setting x generation bucket x prompt bucket) kept "
                        "with their compiled programs; idle ones beyond it are dropped, "
                        "least recently used first (default 32)")
    p.add_argument("--precompile", choices=("all", "largest", "none"), default="all",
                   help="at start, compile the default pools at every slot count (all, "
                        "default: no request waits for a compile), at --slots only "
                        "(largest: a pool then compiles a smaller count when it first "
                        "runs one), or none")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="at start, run each precompiled program once down the paths a "
                        "load takes (admissions of 1, 2, 4, ... rows, a chunk of decoding, "
                        "the moves between slot counts), so that the first requests do not "
                        "pay for those first runs (default on)")
    p.add_argument("--allow-options", action="append", default=None,
                   metavar="KEY=VALUE[,KEY=VALUE]",
                   help="a further configuration of the sampler's structural options that "
                        "a request may pick by sending them in sampler_options (over the "
                        "sampler flags; repeatable, at most 7). Thresholds need none: a "
                        "request may send any valid value")
    p.add_argument("--dry-run", action="store_true",
                   help="print the server's memory footprint (weights, each pool's state "
                        "per slot count, the budget) from the model's config, without "
                        "loading weights or allocating, and exit (0 when it fits, 1 "
                        "when not); --model may then also be a preset such as "
                        "llada-8b-instruct")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="with --dry-run: the memory of the device to size for (e.g. "
                        "141GiB), for the default budget and the check")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object")
    # --compile-cache DIR (JAX's persistent cache: a restart loads the programs instead of
    # compiling them) is added and enabled by asynclane_jax.cli for every command that
    # compiles (asynclane_jax.compile_cache).
    p.add_argument("--drain-timeout", type=float, default=120.0, metavar="S",
                   help="at SIGTERM, seconds to let requests in flight finish (default "
                        "120); those still running then get an error (an error event and "
                        "[DONE] in a stream, a 503 otherwise)")
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="the key clients send as `Authorization: Bearer KEY` (else 401); "
                        "required unless --host is a loopback address. Prefer "
                        f"--api-key-file or ${API_KEY_ENV}: a command line is visible to "
                        "other users of the machine")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (its first line)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGIN,...",
                   help="web page origins (e.g. https://app.example.com) that may call the "
                        "server from a browser, which get CORS headers; '*' for any. "
                        "Default: none (a request with another Origin header is a 403)")
    g.add_argument("--allowed-hosts", default=None, metavar="NAME,...",
                   help="further names the server may be reached by (the Host header), "
                        "e.g. behind a proxy; '*' for any. Default: loopback names, the "
                        "--host address (for 0.0.0.0: the machine's names and any IP "
                        "address); another Host is a 403 (DNS rebinding)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="the largest request body, read with this bound (else 413; "
                        f"default {DEFAULT_MAX_BODY_BYTES} = 1 MiB)")
    g.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="the longest prompt text in characters (a chat's contents "
                        "together), refused before it is tokenized (default: --max-prompt "
                        "times the tokenizer's longest token, which no prompt that fits "
                        "exceeds)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a connection has to send a request's headers (default 10)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request has to send its body (else 408; default 30)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    _add_sampler_args(p)
    for action in p._actions:  # generate's flags that a server refuses (see run)
        if action.dest in ("gen_length", "seed"):
            action.help = argparse.SUPPRESS
    p.set_defaults(func=run)


def gen_lengths(max_tokens: int | None, explicit: str | None) -> tuple[int, ...]:
    """The generation buckets from --max-tokens / --gen-lengths.

    Raises:
      UsageError: not positive, or the two disagree.
    """
    if explicit is not None:
        try:
            got = sorted({int(x) for x in explicit.split(",") if x.strip()})
        except ValueError:
            raise UsageError(f"--gen-lengths {explicit!r}: comma-separated token counts") \
                from None
        if not got or got[0] < 1:
            raise UsageError(f"--gen-lengths {explicit!r}: positive token counts")
        if max_tokens is not None and max_tokens != got[-1]:
            raise UsageError(f"--max-tokens {max_tokens} and --gen-lengths {explicit}: the "
                             "largest bucket is the most tokens a request may ask for; give "
                             "one")
        return tuple(got)
    top = DEFAULT_BUCKETS[-1] if max_tokens is None else max_tokens
    if top < 1:
        raise UsageError(f"--max-tokens {top}: must be a positive number of tokens")
    return tuple(b for b in DEFAULT_BUCKETS if b < top) + (top,)


def _positive(args, *names) -> None:
    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} {v}: must be at least 1")


def run(args) -> int:
    from asynclane_jax.serve import require

    if not args.dry_run:
        for module in ("fastapi", "uvicorn", "httptools", "prometheus_client"):
            require(module)
    if args.gen_length is not None:
        raise UsageError("serve: --gen-length is per request here; use --max-tokens (the "
                         "largest bucket) or --gen-lengths")
    if args.seed != 0:
        raise UsageError("serve: --seed is not honoured under continuous batching (the "
                         "requests in the loop share one random stream)")
    _positive(args, "slots", "chunk", "queue", "default_max_tokens", "max_prompt",
              "max_body_bytes", "max_prompt_chars", "max_pools")
    kv_budget = _size_arg(args.kv_budget, "--kv-budget")
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "drain_timeout"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be "
                             "positive seconds")
    security = security_from_args(args)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port}: must be in [0, 65535]")
    buckets = gen_lengths(args.max_tokens, args.gen_lengths)
    if args.default_max_tokens is not None and args.default_max_tokens > buckets[-1]:
        raise UsageError(f"--default-max-tokens {args.default_max_tokens} is more than the "
                         f"largest bucket {buckets[-1]}")

    prompt_lengths = None
    if args.prompt_lengths is not None:
        try:
            prompt_lengths = sorted({int(x) for x in args.prompt_lengths.split(",")
                                     if x.strip()})
        except ValueError:
            raise UsageError(f"--prompt-lengths {args.prompt_lengths!r}: comma-separated "
                             "token counts") from None
        if not prompt_lengths or prompt_lengths[0] < 1:
            raise UsageError(f"--prompt-lengths {args.prompt_lengths!r}: positive token "
                             "counts")

    from asynclane_jax.generate_cli import DEFAULT_MODEL, _sampler_and_options

    sampler, options = _sampler_and_options(args)
    allow = allowed_configs(sampler, args.allow_options)
    if args.dry_run:
        return dry_run(args, sampler, options, buckets, prompt_lengths, kv_budget, allow)
    import asynclane_jax
    from asynclane_jax.serve.app import create_app
    from asynclane_jax.serve.engine import Engine, EngineError

    # The server's own log at --log-level (uvicorn sets up its own loggers); the
    # libraries' (absl, orbax, jax) at warnings only.
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asynclane_jax.serve").setLevel(args.log_level.upper())
    name = args.model or DEFAULT_MODEL
    model, tokenizer, _ = asynclane_jax.load(name, mesh=args.mesh, quantize=args.quantize,
                                             scan_layers=args.scan_layers)
    if tokenizer is None:
        raise UsageError(f"model {name} has no tokenizer: the server needs one")
    try:
        engine = Engine(model, tokenizer,
                        model_name=args.served_model_name or public_model_name(name),
                        sampler=sampler, options=options, slots=args.slots,
                        gen_lengths=buckets, chunk=args.chunk, queue_size=args.queue,
                        max_prompt=args.max_prompt, prompt_lengths=prompt_lengths,
                        compile_cache=getattr(args, "compile_cache", None),
                        kv_budget=kv_budget, max_pools=args.max_pools,
                        precompile=args.precompile, warm_up=args.warm_up,
                        allow_options=allow)
        app = create_app(engine, default_max_tokens=args.default_max_tokens,
                         server_options=options, drain_timeout=args.drain_timeout,
                         security=security, max_prompt_chars=args.max_prompt_chars)
    except EngineError as e:
        raise UsageError(str(e)) from None
    server = serve_app(app, host=args.host, port=args.port, log_level=args.log_level,
                       drain_timeout=args.drain_timeout, header_timeout=args.header_timeout,
                       keep_alive_timeout=args.keep_alive_timeout)
    if not server.started:  # the app did not start (the error is logged above)
        print("asynclane-jax serve: error: the server did not start", file=sys.stderr)
        return 1
    return 0


def allowed_configs(sampler: str, values: list[str] | None) -> list[dict]:
    """--allow-options values as option dicts, each value read with the sampler's field
    type.

    Raises:
      UsageError: not KEY=VALUE pairs, an option the sampler lacks or a value not of
        its type.
    """
    from asynclane_jax.decoding.registry import convert_option, get_schedule_class
    from asynclane_jax.decoding.schedule import SamplerError

    cls = get_schedule_class(sampler)
    out = []
    for value in values or ():
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        if not pairs or any("=" not in p for p in pairs):
            raise UsageError(f"--allow-options {value!r}: comma-separated KEY=VALUE pairs")
        try:
            out.append({k.strip().replace("-", "_"): convert_option(
                cls, k.strip().replace("-", "_"), v.strip())
                for k, v in (p.split("=", 1) for p in pairs)})
        except SamplerError as e:
            raise UsageError(f"--allow-options {value!r}: {e}") from None
    return out


def _size_arg(value, flag: str):
    """A size flag's bytes (`budget.parse_bytes`: 8GiB, 500MB, plain bytes), or None
    when the flag was not given; a bad size is a one-line usage error."""
    if value is None:
        return None
    from asynclane_jax.serve.budget import BudgetError, parse_bytes

    try:
        return parse_bytes(value)
    except BudgetError as e:
        raise UsageError(f"{flag} {e}") from None


def dry_run(args, sampler, options, buckets, prompt_lengths, kv_budget, allow=()) -> int:
    """--dry-run: prints the footprint (`footprint.Footprint`), the `--allow-options`
    configurations' pools included; 0 when it fits."""
    from asynclane_jax.generate_cli import DEFAULT_MODEL
    from asynclane_jax.serve.engine import EngineError
    from asynclane_jax.serve.footprint import footprint

    device = _size_arg(args.device_memory, "--device-memory")
    try:
        report = footprint(args.model or DEFAULT_MODEL, sampler=sampler, options=options,
                           slots=args.slots, gen_lengths=buckets, max_prompt=args.max_prompt,
                           prompt_lengths=prompt_lengths, kv_budget=kv_budget,
                           device_bytes=device, quantize=args.quantize,
                           scan_layers=args.scan_layers, allow_options=allow)
    except EngineError as e:
        raise UsageError(str(e)) from None
    print(report.to_json() if args.json else report.summary())
    return 0 if report.fits else 1


def public_model_name(model: str) -> str:
    """The name a model is served by when --served-model-name is not given: --model as
    given, but a folder's last part only (no path of the machine goes to clients)."""
    if os.sep in model or "/" in model:
        return os.path.basename(os.path.normpath(model)) or model
    return model


def api_key_from(args, environ=os.environ) -> str | None:
    """The API key: --api-key, --api-key-file or $ASYNCLANE_API_KEY (one of them).

    Raises:
      UsageError: two given, an unreadable or empty file, an empty key.
    """
    given = [(n, v) for n, v in (("--api-key", args.api_key),
                                 ("--api-key-file", args.api_key_file)) if v is not None]
    if len(given) > 1:
        raise UsageError("serve: give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file: cannot read it ({type(e).__name__})") from None
        if not key:
            raise UsageError("--api-key-file: its first line is empty")
        return key
    if args.api_key is not None:
        key = args.api_key.strip()
        if not key:
            raise UsageError("--api-key: the key is empty")
        return key
    key = environ.get(API_KEY_ENV, "").strip()
    return key or None


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (value or "").split(",") if x.strip())


def security_from_args(args, environ=os.environ):
    """The server's `guard.Security` from the command line.

    Raises:
      UsageError: no API key for an address beyond loopback, bad limits.
    """
    from asynclane_jax.serve.guard import Security, is_loopback, own_hosts

    key = api_key_from(args, environ)
    if key is None and not is_loopback(args.host):
        raise UsageError(f"serve: --host {args.host} listens beyond this machine: give an "
                         f"API key (--api-key-file FILE, ${API_KEY_ENV}, or --api-key) so "
                         "that only clients holding it are served")
    hosts, any_ip = own_hosts(args.host)
    return Security(api_key=key, hosts=hosts, any_ip_host=any_ip,
                    allowed_hosts=_names(args.allowed_hosts),
                    allowed_origins=_names(args.allowed_origins),
                    max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout)


def serve_app(app, *, host: str, port: int, log_level: str = "info",
              drain_timeout: float | None = 120.0, header_timeout: float = 10.0,
              keep_alive_timeout: float = 5.0, sockets=None):
    """Runs `app` (create_app's) on uvicorn until SIGTERM / Ctrl-C; returns the server.

    At the signal, uvicorn stops accepting connections and the app's drain begins at
    once (`app.state.begin_drain`), so that the requests the drain cancels tell their
    clients before uvicorn's own graceful timeout (drain + a margin) could cut them.
    Headers must arrive within header_timeout seconds of a connection's start (or of its
    previous response); a request's headers are at most 16 KiB.
    """
    from asynclane_jax.serve import require
    from asynclane_jax.serve.app import DRAIN_MARGIN_S

    uvicorn = require("uvicorn")

    graceful = None if drain_timeout is None else drain_timeout + DRAIN_MARGIN_S
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful, lifespan="on",
                            http=_guarded_http_protocol(header_timeout),
                            timeout_keep_alive=keep_alive_timeout)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and hasattr(app.state, "begin_drain"):
                app.state.begin_drain()

    server = Server(config)
    _exit_quietly_after_drain(server)
    server.run(sockets=sockets)
    return server


MAX_HEADER_BYTES = 16 * 1024


def _guarded_http_protocol(timeout: float,
                           max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's httptools protocol (its C parser, which costs less CPU per request than
    h11's pure Python), closing a connection whose request headers have not all arrived
    within `timeout` seconds of its start or of its previous response (uvicorn itself
    times out idle keep-alive connections only, not slow headers), and answering 400 to
    a request whose request line and headers exceed max_header_bytes."""
    from asynclane_jax.serve import require

    require("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Guarded(HttpToolsProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def on_response_complete(self):
            super().on_response_complete()
            self._rearm()

        def _rearm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data):
            super().data_received(data)
            if not self._waiting_for_headers() and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_late(self):
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        # The request line and headers are counted as they are parsed, whether they
        # come in one read or many; past the bound, the callback's error is the
        # parser's, which uvicorn answers with a 400 and a closed connection.
        def on_message_begin(self):
            self._header_bytes = 0
            super().on_message_begin()

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                raise ValueError("request headers too large")

        def on_url(self, url):
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name, value):
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

    return Guarded


def _exit_quietly_after_drain(server) -> None:
    """uvicorn drains on SIGTERM, then raises the signal again to the handler it found.
    That handler is this one: once uvicorn has drained (should_exit) the process exits
    normally (status 0); before uvicorn runs, SIGTERM ends it at once (status 143)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(sig, frame):
        if server.should_exit:
            return
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
