"""`asynclane-jax generate` and `asynclane-jax eval`."""

from __future__ import annotations

import json

DEFAULT_MODEL = "tiny-llada"
# The fastest sampler available; AsyncLane replaces it when it lands.
DEFAULT_SAMPLER = "fast-dllm"
DEFAULT_SAMPLER_OPTIONS = {"fast-dllm": {"cache": "dual"}}

_OPTION_TYPES = {
    "steps": int, "remasking": str, "temperature": float, "cfg_scale": float,
    "alg": str, "alg_temp": float, "top_p": float, "top_k": int, "eps": float,
    "threshold": float, "factor": float, "cache": str, "relaxed_threshold": float,
    "radius": int,
}


def _add_sampler_args(p) -> None:
    p.add_argument("--sampler", default=None,
                   help=f"vanilla | dream | fast-dllm | localleap (default {DEFAULT_SAMPLER})")
    p.add_argument("--gen-length", type=int, default=None, help="tokens to generate")
    p.add_argument("--block-length", type=int, default=None, help="block size")
    p.add_argument("--seed", type=int, default=0)
    for name, typ in _OPTION_TYPES.items():
        p.add_argument("--" + name.replace("_", "-"), dest="opt_" + name, type=typ,
                       default=None, help=f"sampler option {name}")


def _sampler_options(args) -> tuple[str, dict]:
    from asynclane_jax.decoding import SAMPLERS

    sampler = args.sampler or DEFAULT_SAMPLER
    opts = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    if args.sampler is None:
        opts = {**DEFAULT_SAMPLER_OPTIONS.get(sampler, {}), **opts}
    if sampler not in SAMPLERS:
        from asynclane_jax.cli import UsageError

        raise UsageError(f"unknown sampler {sampler!r}; available: {sorted(SAMPLERS)}")
    return sampler, opts


def _cmd_generate(args) -> int:
    import asynclane_jax
    from asynclane_jax.cli import UsageError

    model, tokenizer, cfg = asynclane_jax.load(args.model or DEFAULT_MODEL)
    sampler, opts = _sampler_options(args)
    gen_length = args.gen_length or 128
    if tokenizer is None:
        raise UsageError(f"model {args.model} has no tokenizer; use the Python API with "
                         "token ids")
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
                                 block_length=args.block_length, tokenizer=tokenizer,
                                 seed=args.seed, **opts)
    stats = res.stats
    if args.json:
        out_stats = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in stats.items()}
        print(json.dumps({"text": res.text[0], "tokens": res.tokens[0].tolist(),
                          "stats": out_stats}))
    else:
        print(res.text[0], flush=True)
        n = stats["generated_tokens"][0]
        print(f"[{sampler}: {n} tokens, {stats['steps']} steps, {stats['nfe_full']} full + "
              f"{stats['nfe_partial']} cached calls, {stats['wall_time']:.2f}s incl. "
              f"compilation]", file=__import__("sys").stderr)
    return 0


def _cmd_eval(args) -> int:
    import asynclane_jax
    from asynclane_jax.testbed.evaluate import evaluate

    model, tokenizer, cfg = asynclane_jax.load(args.model or DEFAULT_MODEL)
    sampler, opts = _sampler_options(args)
    result = evaluate(model, tokenizer, sampler=sampler, gen_length=args.gen_length or 256,
                      block_length=args.block_length, n=args.n, **opts)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{sampler}: accuracy {result['accuracy']:.3f} on {result['n']} held-out "
              f"problems, {result['tps']:.1f} tokens/s, {result['nfe_per_token']:.3f} model "
              "calls per token")
    return 0


def register(sub) -> None:
    p = sub.add_parser("generate", help="decode a prompt")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help=f"converted folder or shipped model name (default {DEFAULT_MODEL})")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"}')
    _add_sampler_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("eval", help="held-out accuracy and speed on the testbed tasks")
    p.add_argument("--model", default=None, help=f"default {DEFAULT_MODEL}")
    p.add_argument("--n", type=int, default=500, help="held-out problems")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_sampler_args(p)
    p.set_defaults(func=_cmd_eval)
