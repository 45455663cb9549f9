"""`asynclane-jax generate` and `asynclane-jax eval`.

`generate --trace FILE.png` draws the decode order of the prompt
(asynclane_jax.decoding.trace).

Sampler options are not listed here: every option of every registered sampler becomes a
flag (`--relaxed-threshold`), with its type and help taken from the schedule's dataclass
field and docstring (asynclane_jax.decoding.schedule).
"""

from __future__ import annotations

import argparse
import json
import sys

from asynclane_jax.errors import UsageError

DEFAULT_MODEL = "tiny-llada"
# AsyncLane at its defaults: the fastest sampler at gen_length 256 and 512, with the
# baselines' accuracy (experiments/results/asynclane.md).
DEFAULT_SAMPLER = "asynclane"
DEFAULT_SAMPLER_OPTIONS: dict[str, dict] = {"asynclane": {}}


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def sampler_options() -> dict[str, dict]:
    """Every sampler option: name -> {"type", "help" and "defaults" (per sampler),
    "samplers"}."""
    from asynclane_jax.decoding.schedule import (
        option_docs,
        option_fields,
        option_type,
        registry,
    )

    options: dict[str, dict] = {}
    for sampler, cls in registry().items():
        docs = option_docs(cls)
        for name, field in option_fields(cls).items():
            typ = option_type(cls, name)
            entry = options.setdefault(name, {"type": typ, "help": {}, "samplers": [],
                                              "defaults": {}})
            if entry["type"] is not typ:
                raise TypeError(f"option {name!r} has type {entry['type'].__name__} in "
                                f"{entry['samplers']} but {typ.__name__} in {sampler}")
            entry["samplers"].append(sampler)
            entry["help"][sampler] = docs.get(name, "")
            entry["defaults"][sampler] = field.default
    return options


def _add_sampler_args(p) -> None:
    from asynclane_jax.decoding.schedule import registry

    names = registry()
    lines = [f"{n}: {(c.__doc__ or '').strip().splitlines()[0]}" for n, c in names.items()]
    p.add_argument("--sampler", default=None,
                   help=f"default {DEFAULT_SAMPLER} {DEFAULT_SAMPLER_OPTIONS[DEFAULT_SAMPLER]}. "
                        + "; ".join(lines))
    p.add_argument("--gen-length", type=int, default=None, help="tokens to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="decode sharded over this device mesh, e.g. data=2,tensor=4 or "
                        "tensor (every device on one axis); the model is loaded straight "
                        "into its shards (see asynclane_jax.sharding)")
    group = p.add_argument_group("sampler options (each sampler accepts its own)")
    for name, opt in sampler_options().items():
        defaults = ", ".join(f"{s} {d}" for s, d in opt["defaults"].items())
        docs = set(opt["help"].values())
        doc = (docs.pop() if len(docs) == 1 else
               "; ".join(f"{s}: {d}" for s, d in opt["help"].items()))
        typ = _parse_bool if opt["type"] is bool else opt["type"]
        group.add_argument("--" + name.replace("_", "-"), dest="opt_" + name, type=typ,
                           default=None, metavar=opt["type"].__name__.upper(),
                           help=f"{doc} (default: {defaults})".replace("%", "%%"))


def _sampler_and_options(args) -> tuple[str, dict]:
    from asynclane_jax.decoding.schedule import get_schedule_class

    sampler = args.sampler or DEFAULT_SAMPLER
    get_schedule_class(sampler)  # an unknown name is an error before the model loads
    opts = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    if args.sampler is None:
        opts = {**DEFAULT_SAMPLER_OPTIONS.get(sampler, {}), **opts}
    return sampler, opts


def _gen_length(args, default: int) -> int:
    if args.gen_length is None:
        return default
    if args.gen_length <= 0:
        raise UsageError(f"--gen-length {args.gen_length}: must be a positive number of tokens")
    return args.gen_length


def unknown_words(tokenizer, text: str) -> list[str]:
    """The pieces of text the tokenizer can only read as its unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [text[a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
            if t == unk]


def _cmd_generate(args) -> int:
    import asynclane_jax

    gen_length = _gen_length(args, 128)
    sampler, opts = _sampler_and_options(args)
    if args.trace:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--trace needs matplotlib: pip install 'asynclane-jax[plots]'") \
                from None
    model, tokenizer, cfg = asynclane_jax.load(args.model or DEFAULT_MODEL, mesh=args.mesh)
    if tokenizer is None:
        raise UsageError(f"model {args.model} has no tokenizer; use the Python API with "
                         "token ids")
    unknown = unknown_words(tokenizer, args.prompt)
    if unknown:
        shown = ", ".join(repr(w) for w in dict.fromkeys(unknown))
        print(f"asynclane-jax generate: warning: {len(unknown)} word(s) of the prompt are "
              f"outside the model's vocabulary and read as {tokenizer.unk_token}: {shown}",
              file=sys.stderr)
    prompt = args.prompt
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("--chat: this tokenizer has no chat template")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UsageError("the prompt is empty after tokenization")
    res = asynclane_jax.generate(model, [list(ids)], sampler=sampler, gen_length=gen_length,
                                 tokenizer=tokenizer, seed=args.seed, **opts)
    stats = res.stats
    if args.trace:
        from asynclane_jax.decoding.trace import save_decode_order

        save_decode_order(res, args.trace, tokenizer=tokenizer, stop_ids=cfg.stop_token_ids)
        print(f"asynclane-jax generate: decode order drawn in {args.trace}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": res.text[0], "tokens": res.tokens[0].tolist(),
                          "stats": stats.to_dict()}))
    else:
        print(res.text[0], flush=True)
        n = stats["generated_tokens"][0]
        if not res.text[0].strip():
            print("asynclane-jax generate: the model generated no text (it ended at once)",
                  file=sys.stderr)
        print(f"[{sampler}: {n} tokens, {stats.steps} steps, {stats.nfe_full} full + "
              f"{stats.nfe_partial} cached calls, {stats.decode_time:.2f}s decoding + "
              f"{stats.compile_time:.2f}s compiling]", file=sys.stderr)
    return 0


def _cmd_eval(args) -> int:
    import asynclane_jax
    from asynclane_jax.testbed.evaluate import evaluate

    if args.n <= 0:
        raise UsageError(f"--n {args.n}: must be a positive number of problems")
    gen_length = _gen_length(args, 256)
    sampler, opts = _sampler_and_options(args)
    model, tokenizer, cfg = asynclane_jax.load(args.model or DEFAULT_MODEL, mesh=args.mesh)
    result = evaluate(model, tokenizer, sampler=sampler, gen_length=gen_length, n=args.n,
                      progress=not args.quiet, **opts)
    if args.json:
        print(json.dumps(result))
    else:
        _print_eval_table(result)
    return 0


EVAL_TABLE_HEAD = ("sampler", "problems", "accuracy", "math", "code", "tokens/s",
                   "calls/token", "decode s", "compile s")


def _print_eval_table(result: dict) -> None:
    """The summary of an `eval` run as a two-line table."""
    cells = (result["sampler"], str(result["n"]), f"{100 * result['accuracy']:.1f}%",
             *(f"{100 * result[f'accuracy_{f}']:.1f}%" if f"accuracy_{f}" in result else "-"
               for f in ("math", "code")),
             f"{result['tps']:.1f}", f"{result['nfe_per_token']:.3f}",
             f"{result['wall_s']:.2f}", f"{result['compile_s']:.1f}")
    widths = [max(len(h), len(c)) for h, c in zip(EVAL_TABLE_HEAD, cells)]
    for line in (EVAL_TABLE_HEAD, cells):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


def register(sub) -> None:
    p = sub.add_parser("generate", help="decode a prompt")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help=f"converted folder or shipped model name (default {DEFAULT_MODEL})")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"}')
    p.add_argument("--trace", default=None, metavar="FILE.png",
                   help="draw the decode order (position against commit step) as a PNG "
                        "(needs matplotlib)")
    _add_sampler_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("eval", help="held-out accuracy and speed on the testbed tasks")
    p.add_argument("--model", default=None, help=f"default {DEFAULT_MODEL}")
    p.add_argument("--n", type=int, default=500, help="held-out problems")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_sampler_args(p)
    p.set_defaults(func=_cmd_eval)
