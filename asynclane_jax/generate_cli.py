"""`asynclane-jax generate` and `asynclane-jax eval`.

`generate --trace FILE.png` draws the decode order of the prompt
(asynclane_jax.decoding.trace).

Sampler options are not listed here: every option of every registered sampler becomes a
flag (`--relaxed-threshold`), read with the chosen sampler's field type, and `--help`
lists each sampler's options in a section of its own, their help taken from the
schedule's dataclass fields and docstring (asynclane_jax.decoding.registry).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap

from asynclane_jax.errors import UsageError

DEFAULT_MODEL = "tiny-llada-v4b"


def sampler_help(width: int | None = None) -> str:
    """The sampler options as help text: one section per sampler, each option with its
    type, help (from the schedule's docstring) and default."""
    from asynclane_jax.decoding.registry import (
        DEFAULT_SAMPLER,
        option_docs,
        option_fields,
        option_type,
        samplers,
    )

    width = width or max(60, shutil.get_terminal_size((100, 24)).columns - 2)
    out = ["sampler options (each sampler reads its own; a value is read as the chosen "
           f"sampler's type; default sampler: {DEFAULT_SAMPLER}):"]
    for sampler, cls in samplers().items():
        first = (cls.__doc__ or "").strip().splitlines()[0]
        out += ["", f"  --sampler {sampler}: {first}"]
        docs = option_docs(cls)
        for name, field in option_fields(cls).items():
            typ = option_type(cls, name).__name__.upper()
            head = f"    --{name.replace('_', '-')} {typ}"
            text = f"{docs.get(name, '')} (default: {field.default})"
            out += textwrap.wrap(text, width, initial_indent=head.ljust(30) + " ",
                                 subsequent_indent=" " * 31)
    return "\n".join(out)


def add_scan_flag(p) -> None:
    """`--scan-layers` / `--no-scan-layers`: the layer layout the model is loaded into
    (`ModelConfig.scan_layers`); default the folder's."""
    import argparse

    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="run the layers as one scan over stacked parameters (fewer, smaller "
                        "compiled programs; --no-scan-layers: unrolled; default: the "
                        "folder's layout)")


def _add_sampler_args(p) -> None:
    from asynclane_jax.decoding.registry import DEFAULT_SAMPLER, option_fields, samplers

    names = samplers()
    p.add_argument("--sampler", default=None,
                   help=f"one of {', '.join(names)} (default {DEFAULT_SAMPLER}); its options "
                        "are listed below")
    p.add_argument("--gen-length", type=int, default=None, help="tokens to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="decode sharded over this device mesh, e.g. data=2,tensor=4 or "
                        "tensor (every device on one axis); the model is loaded straight "
                        "into its shards (see asynclane_jax.sharding)")
    from asynclane_jax.models.quantize import add_flag

    add_flag(p)
    add_scan_flag(p)
    # Each option name is one flag whatever samplers have it; its text is read by the
    # chosen sampler's own field type (registry.convert_option), so two samplers may give
    # one name different types. The help lists each sampler's options in its own section.
    for name in sorted({n for cls in names.values() for n in option_fields(cls)}):
        p.add_argument("--" + name.replace("_", "-"), dest="opt_" + name, default=None,
                       metavar="VALUE", help=argparse.SUPPRESS)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = sampler_help()


def _sampler_and_options(args) -> tuple[str, dict]:
    from asynclane_jax.decoding.registry import (
        DEFAULT_SAMPLER,
        convert_option,
        get_schedule_class,
    )

    sampler = args.sampler or DEFAULT_SAMPLER
    cls = get_schedule_class(sampler)  # an unknown name is an error before the model loads
    raw = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    return sampler, {k: convert_option(cls, k, v) for k, v in raw.items()}


def _gen_length(args, default: int) -> int:
    if args.gen_length is None:
        return default
    if args.gen_length <= 0:
        raise UsageError(f"--gen-length {args.gen_length}: must be a positive number of tokens")
    return args.gen_length


def check_utf8(text: str, what: str = "the prompt") -> str:
    """The text, if it is valid Unicode; UsageError otherwise.

    Command-line bytes that are not UTF-8 reach Python as lone surrogates
    (surrogateescape), which a tokenizer cannot encode; they are named here, as the
    bytes they were.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        try:
            raw = text[e.start:e.end].encode("utf-8", "surrogateescape")
            shown = " ".join(f"0x{b:02x}" for b in raw[:8])
        except UnicodeEncodeError:
            shown = repr(text[e.start:e.end])
        raise UsageError(f"{what} is not valid UTF-8 text (bytes {shown} at character "
                         f"{e.start}); pass it as UTF-8") from None
    return text


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

    check_utf8(args.prompt)
    gen_length = _gen_length(args, 128)
    sampler, opts = _sampler_and_options(args)
    if args.trace:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--trace needs matplotlib: pip install 'asynclane-jax[plots]'") \
                from None
    model, tokenizer, cfg = asynclane_jax.load(args.model or DEFAULT_MODEL, mesh=args.mesh,
                                               quantize=args.quantize,
                                               scan_layers=args.scan_layers)
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
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed.evaluate import SPLIT_SIZES, evaluate

    if args.n <= 0:
        raise UsageError(f"--n {args.n}: must be a positive number of problems")
    if args.n > SPLIT_SIZES["heldout"]:
        raise UsageError(f"--n {args.n}: the held-out split has {SPLIT_SIZES['heldout']} "
                         f"problems; ask for at most {SPLIT_SIZES['heldout']}")
    sampler, opts = _sampler_and_options(args)
    name = args.model or DEFAULT_MODEL
    task_set = tasks.model_task_set(name)
    gen_length = _gen_length(args, tasks.default_gen_length(task_set))
    model, tokenizer, cfg = asynclane_jax.load(name, mesh=args.mesh, quantize=args.quantize,
                                               scan_layers=args.scan_layers)
    result = evaluate(model, tokenizer, sampler=sampler, gen_length=gen_length, n=args.n,
                      progress=not args.quiet, task_set=task_set, **opts)
    result["quantize"] = args.quantize
    if args.json:
        print(json.dumps(result))
    else:
        _print_eval_table(result)
    return 0


def _print_eval_table(result: dict) -> None:
    """The summary of an `eval` run as a two-line table: overall accuracy, accuracy per
    family of the run's task set, speed."""
    from asynclane_jax.testbed import tasks

    families = tasks.families_of(result.get("task_set", tasks.DEFAULT_TASK_SET))
    head = ("sampler", "problems", "accuracy", *families, "tokens/s", "calls/token",
            "decode s", "compile s")
    cells = (result["sampler"], str(result["n"]), f"{100 * result['accuracy']:.1f}%",
             *(f"{100 * result[f'accuracy_{f}']:.1f}%" if f"accuracy_{f}" in result else "-"
               for f in families),
             f"{result['tps']:.1f}", f"{result['nfe_per_token']:.3f}",
             f"{result['wall_s']:.2f}", f"{result['compile_s']:.1f}")
    widths = [max(len(h), len(c)) for h, c in zip(head, cells)]
    for line in (head, cells):
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
