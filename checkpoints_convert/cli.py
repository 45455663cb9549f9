"""`asynclane-jax convert SRC DST` and `python -m checkpoints_convert SRC DST`."""

from __future__ import annotations

import argparse
import sys

from asynclane_jax.errors import USER_ERRORS
from checkpoints_convert.convert import OUTPUT_DTYPES, sigterm_as_interrupt

DESCRIPTION = ("Convert a Hugging Face PyTorch LLaDA / Dream checkpoint, or a LLaDA2 "
               "mixture-of-experts one (llada2_moe: its experts stacked per layer), "
               "optionally with a PEFT LoRA adapter merged in, into an asynclane-jax "
               "folder: streaming, atomic, verified.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC",
                   help="snapshot folder (config.json + *.safetensors or pytorch_model*.bin), "
                        "or a hub id already in the local Hugging Face cache")
    p.add_argument("dst", metavar="DST", help="output folder (created atomically)")
    p.add_argument("--dtype", choices=OUTPUT_DTYPES, default=None,
                   help="parameter dtype of the output (default: the source tensors' dtype)")
    p.add_argument("--lora", metavar="ADAPTER_DIR",
                   help="PEFT LoRA adapter to merge (W + alpha/r * B @ A), e.g. a D2F student")
    p.add_argument("--block-causal", action="store_true",
                   help="the weights were trained block-causal (a D2F student): the d2f "
                        "sampler then caches finished blocks")
    p.add_argument("--scan-layers", action="store_true",
                   help="store the layers stacked ([L, ...] per tensor) for the scanned "
                        "layer loop; load reads either layout into either")
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="int8: store the linear layers' kernels as int8 with one scale per "
                        "output channel (what load(..., quantize='int8') computes; about "
                        "half the bytes of bfloat16); default none")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--verify", action="store_true",
                   help="compare logits with transformers' Llama/Qwen2 (is_causal=False) "
                        "built from the same tensors (needs torch and transformers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    """Adds the `convert` subcommand to the asynclane-jax command line (through the
    `asynclane_jax.commands` entry point in pyproject.toml)."""
    p = subparsers.add_parser("convert", help="Hugging Face LLaDA / Dream / LLaDA2 checkpoint -> "
                                              "converted folder", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Runs one conversion from parsed arguments; returns the exit status."""
    from checkpoints_convert import convert as conv

    # SIGINT / SIGTERM: the conversion removes its temporary folder (see convert).
    with sigterm_as_interrupt():
        result = conv.convert(args.src, args.dst, dtype=args.dtype, lora=args.lora,
                              force=args.force, progress=not args.no_progress,
                              block_causal=args.block_causal,
                              scan_layers=args.scan_layers, quantize=args.quantize)
        try:
            print(result.summary())
            return _verify(args, result) if args.verify else 0
        except KeyboardInterrupt:  # the folder is in place: say so, not "nothing written"
            print(f"interrupted{' during --verify' if args.verify else ''}; the converted "
                  f"folder {result.dst} is complete", file=sys.stderr)
            return 130


def _verify(args, result) -> int:
    if result.cfg.is_moe:  # transformers has no llada2_moe class to compare with
        print(f"verify: FAILED (no transformers reference for {result.cfg.family}; the "
              "folder is complete, its parity is tested against tests/models/"
              "test_llada2_reference.py)", file=sys.stderr)
        return 1
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("verify: skipped (needs torch and transformers: pip install torch transformers)")
        return 0
    from checkpoints_convert import convert as conv
    from checkpoints_convert.verify import verify_converted

    snap, cfg, _, adapter = conv.prepare(args.src, dtype=result.cfg.param_dtype, lora=args.lora)
    report = verify_converted(snap, result.dst, adapter=adapter, out_dtype=cfg.param_dtype)
    print(report.line())
    if report.nonfinite_params or report.nonfinite_logits:
        print(f"verify: FAILED ({report.nonfinite_params:,} non-finite weights, "
              f"{report.nonfinite_logits:,} non-finite logits)", file=sys.stderr)
        return 1
    if report.top1_rate < 0.9:
        print("verify: FAILED (top-1 agreement below 90%)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m checkpoints_convert SRC DST [...]`."""
    parser = argparse.ArgumentParser(prog="python -m checkpoints_convert",
                                     description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except USER_ERRORS as e:
        print(f"checkpoints_convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("checkpoints_convert: interrupted; nothing was written", file=sys.stderr)
        return 130
