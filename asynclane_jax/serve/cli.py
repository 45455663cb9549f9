"""`asynclane-jax serve`: an OpenAI-compatible HTTP server with continuous batching.

  asynclane-jax serve --model tiny-llada --port 8000
  asynclane-jax serve --model /models/llada-8b-instruct --sampler fast-dllm --cache dual \\
      --slots 16 --max-tokens 256 --compile-cache /tmp/jax-cache

The sampler and its options are the `generate` flags; they apply to every request (a
request may override options through its `sampler_options` field). Generation lengths
are buckets, each one compiled program: 128, 256, 512 up to --max-tokens (which is the
largest), or --gen-lengths; a request decodes at the smallest bucket >= its max_tokens.
SIGTERM (or Ctrl-C) stops admitting requests, finishes those in flight and exits 0.

Needs the serve extra: pip install 'asynclane-jax[serve]'.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from asynclane_jax.errors import UsageError

DEFAULT_BUCKETS = (128, 256, 512)
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
                   help="the name requests must give as `model` (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                                                       "127.0.0.1)")
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
                   help="loop iterations between admissions and streamed updates "
                        "(default 8)")
    p.add_argument("--queue", type=int, default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default 64)")
    # --compile-cache DIR (JAX's persistent cache: a restart loads the programs instead of
    # compiling them) is added and enabled by asynclane_jax.cli for every command that
    # compiles (asynclane_jax.compile_cache).
    p.add_argument("--drain-timeout", type=float, default=120.0, metavar="S",
                   help="at SIGTERM, seconds to let requests in flight finish (default 120)")
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

    require("fastapi")
    uvicorn = require("uvicorn")
    require("sse_starlette")
    if args.gen_length is not None:
        raise UsageError("serve: --gen-length is per request here; use --max-tokens (the "
                         "largest bucket) or --gen-lengths")
    if args.seed != 0:
        raise UsageError("serve: --seed is not honoured under continuous batching (the "
                         "requests in the loop share one random stream)")
    _positive(args, "slots", "chunk", "queue", "default_max_tokens", "max_prompt")
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
        engine = Engine(model, tokenizer, model_name=args.served_model_name or name,
                        sampler=sampler, options=options, slots=args.slots,
                        gen_lengths=buckets, chunk=args.chunk, queue_size=args.queue,
                        max_prompt=args.max_prompt, prompt_lengths=prompt_lengths,
                        compile_cache=getattr(args, "compile_cache", None))
        app = create_app(engine, default_max_tokens=args.default_max_tokens,
                         server_options=options, drain_timeout=args.drain_timeout)
    except EngineError as e:
        raise UsageError(str(e)) from None
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, lifespan="on")
    server = uvicorn.Server(config)
    _exit_quietly_after_drain(server)
    server.run()
    if not server.started:  # the app did not start (the error is logged above)
        print("asynclane-jax serve: error: the server did not start", file=sys.stderr)
        return 1
    return 0


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
