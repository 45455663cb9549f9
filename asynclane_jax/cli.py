"""The `asynclane-jax` command line.

Subcommands:
  info      parameter counts of a preset or converted folder (no weights allocated)
  convert   Hugging Face LLaDA / Dream / LLaDA2 checkpoint -> converted folder (registered by
            checkpoints_convert through the `asynclane_jax.commands` entry points)
  verify    check a converted folder's stored arrays against their digests
  generate  decode a prompt with a sampler
  eval      accuracy and speed of a sampler on the testbed's held-out problems
  bench     samplers side by side (accuracy, tokens/s) at several generation lengths
  aot       compile the decode for a TPU slice without weights or a TPU (asynclane_jax.aot,
            the tpu extra): per-chip memory and whether it fits
  lm-eval   benchmarks through lm-evaluation-harness (asynclane_jax.harness, the eval
            extra)

Errors a user can cause are printed as one line on stderr with exit status 2; no
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata

from asynclane_jax import bench, compile_cache, generate_cli
from asynclane_jax.errors import UsageError, run_command
from asynclane_jax.models.config import PRESETS

# Other installed packages add subcommands through this entry-point group (the
# converter registers `convert`), so this module imports none of them by name.
COMMANDS_GROUP = "asynclane_jax.commands"


def _cmd_info(args) -> int:
    from asynclane_jax.checkpoint import read_config
    from asynclane_jax.models import param_stats, preset

    if (args.preset is None) == (args.model is None):
        raise UsageError("info: give exactly one of --preset NAME or --model PATH")
    cfg = preset(args.preset) if args.preset else read_config(args.model)[0]
    stats = param_stats(cfg)
    out = {"name": args.preset or str(args.model), **stats, "config": cfg.to_dict()}
    if cfg.is_moe:
        from asynclane_jax.models.config import n_active_params

        out["active_params"] = n_active_params(cfg.to_dict())
    if args.quantize != "none":
        from flax import nnx

        from asynclane_jax.models import abstract_model, quantize

        cfg16 = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
        out[f"bytes_{args.quantize}"] = quantize.weight_bytes(nnx.state(
            quantize.abstract_quantized(abstract_model(cfg16), args.quantize)))
    if args.json:
        print(json.dumps(out))
    else:
        line = (f"{out['name']}: {stats['params']:,} parameters in {stats['tensors']} tensors, "
                f"{stats['bytes_bf16'] / 2**30:.2f} GiB in bfloat16")
        if "active_params" in out:
            line += f", {out['active_params']:,} active per token"
        if args.quantize != "none":
            line += (f", {out['bytes_' + args.quantize] / 2**30:.2f} GiB with {args.quantize} "
                     "linear layers (embedding and norms in bfloat16)")
        print(line)
    return 0


def _cmd_verify(args) -> int:
    from asynclane_jax.checkpoint import printable, resolve, verify_folder

    n = verify_folder(args.model)
    print(f"OK: {printable(resolve(args.model))}: {n} arrays match their digests")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynclane-jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts of a preset or converted folder")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named config")
    p.add_argument("--model", help="a converted folder or shipped model name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="also give the bytes with int8 linear layers")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("verify", help="check a converted folder's arrays against their digests",
                       description="Reads every stored array of a converted folder and "
                                   "checks it against the digest recorded when the folder "
                                   "was written (digests.json): exit 0 with one OK line, or "
                                   "2 naming the arrays that differ.")
    p.add_argument("model", metavar="DIR", help="a converted folder or shipped model name")
    p.set_defaults(func=_cmd_verify)

    generate_cli.register(sub)
    bench.register(sub)
    for entry in sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        entry.load()(sub)
    for name in compile_cache.COMMANDS:
        if name in sub.choices:
            if name in compile_cache.CACHED_COMMANDS:
                compile_cache.add_flag(sub.choices[name])
            _add_compact_flag(sub.choices[name])
            _add_mixed_flag(sub.choices[name])
    return parser


def _add_compact_flag(parser) -> None:
    """`--compact-full` / `--no-compact-full` on every decoding command (once: a command
    that declares it itself keeps its own)."""
    try:
        parser.add_argument(
            "--compact-full", action=argparse.BooleanOptionalAction, default=None,
            help="a full forward that serves at most half the batch computes only the rows "
                 "it serves (faster; on by default for the samplers that allow it); "
                 "--no-compact-full trades that speed for the memory of its temporary "
                 "cache (up to half the batch's K/V)")
    except argparse.ArgumentError:
        pass


def _add_mixed_flag(parser) -> None:
    """`--mixed-calls` / `--no-mixed-calls` on every decoding command (once)."""
    try:
        parser.add_argument(
            "--mixed-calls", action=argparse.BooleanOptionalAction, default=None,
            help="at batch > 1, rows due a full forward are served in the same model call "
                 "as the other rows' cached queries, so none waits (asynclane, and the "
                 "block samplers with row_refresh); off by default: it pays where a "
                 "few rows' full forward costs about a cached call (a weight-bound chip), "
                 "and costs on this CPU")
    except argparse.ArgumentError:
        pass


def apply_compact_flag(args) -> None:
    """Sets the driver's compaction and mixing switches from `--compact-full` /
    `--no-compact-full` and `--mixed-calls` / `--no-mixed-calls`; each unchanged when
    the command line names neither."""
    for name, switch in (("compact_full", "COMPACT_FULL"), ("mixed_calls", "MIXED_CALLS")):
        on = getattr(args, name, None)
        if on is not None:
            from asynclane_jax.decoding import driver

            getattr(driver, switch)["on"] = bool(on)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        compile_cache.enable(getattr(args, "compile_cache", None))
    except OSError as e:
        print(f"asynclane-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    apply_compact_flag(args)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
