"""`asynclane-jax bench`: the command line (flags, then runner, table, JSON, plot)."""

from __future__ import annotations

import argparse
import sys

from asynclane_jax.bench import runner, table
from asynclane_jax.bench.spec import DEFAULT_GEN_LENGTHS, DEFAULT_SAMPLERS, default_specs, validate
from asynclane_jax.errors import UsageError, run_command

DESCRIPTION = "`asynclane-jax bench`: samplers side by side on the testbed's held-out problems."


def _require_matplotlib(flag: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install 'asynclane-jax[plots]'") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _cmd_bench(args) -> int:
    import asynclane_jax

    if args.samplers is None:
        specs = default_specs()
    else:
        specs = [s.strip() for s in args.samplers.split(",") if s.strip()]
    gen_lengths = args.gen_lengths or list(DEFAULT_GEN_LENGTHS)
    from asynclane_jax.testbed.evaluate import check_n

    try:
        check_n(args.n)
    except ValueError as e:
        raise UsageError(f"--n {args.n}: {e}") from None
    if args.batch <= 0:
        raise UsageError(f"--batch {args.batch}: must be a positive number of prompts")
    validate(specs, gen_lengths)  # before the model loads
    from asynclane_jax.testbed import tasks

    if args.tasks is not None:
        try:
            tasks.families_of(args.tasks)
        except ValueError as e:
            raise UsageError(f"--tasks: {e}") from None
    if args.plot:
        _require_matplotlib("--plot")
    chips = None
    if args.project is not None:
        from asynclane_jax.bench import project

        chips = project.parse_chips(args.project)
    elif args.project_model is not None:
        raise UsageError("--project-model needs --project CHIPS")
    model_name = args.model
    model, tokenizer, _ = asynclane_jax.load(model_name, quantize=args.quantize,
                                              scan_layers=args.scan_layers)
    meta = runner.bench_meta(str(model_name), args.n, args.batch, specs, gen_lengths)
    meta["quantize"] = args.quantize
    task_set = args.tasks or tasks.model_task_set(model_name)
    meta["task_set"] = task_set
    # The comparison step: the rows' comparison and speed-up fields (bench.compare).
    from asynclane_jax.bench import compare

    annotate = compare.add_speedups
    if chips is not None:
        annotate = _with_projections(annotate, chips, model, tokenizer, task_set,
                                     args.project_model, meta)

    def on_length(rows):
        if args.json:
            runner.write_json(args.json, meta, rows)

    rows = runner.run_bench(model, tokenizer, specs, gen_lengths, args.n, args.batch,
                            progress=not args.quiet, on_length=on_length,
                            model_name=str(model_name), quantize=args.quantize,
                            task_set=task_set, annotate=annotate)
    table.print_table(rows, labels=compare.COMPARISON_LABELS)
    if chips is not None:
        print(table.PROJECTION_NOTE.format(model=meta["project_model"]))
    if args.plot:
        from asynclane_jax.bench.report import plot_rows

        plot_rows(rows, args.plot, meta)
    return 0


def _with_projections(annotate, chips, model, tokenizer, task_set, project_model, meta):
    """The comparison step followed by the projections of every row (bench.project);
    records what was projected with in meta."""
    from asynclane_jax.bench import project

    cfg = project.project_model_config(project_model, model.cfg.family)
    meta["project_model"] = project_model or project.DEFAULT_PROJECT_MODELS[model.cfg.family]
    meta["projected"] = [project.label(c, w) for c, w in chips]
    measure = None
    if any(c == "cpu" for c, _ in chips):
        measure = project.CpuCosts(model, tokenizer, task_set)

    def step(rows):
        annotate(rows)
        project.add_projections(rows, chips, cfg, measure=measure)

    return step


def register(sub) -> None:
    """Adds the `bench` subcommand to an argparse subparsers object."""
    p = sub.add_parser("bench", help="samplers side by side: accuracy and tokens/s on the "
                                     "testbed's held-out problems",
                       description=DESCRIPTION)
    from asynclane_jax.generate_cli import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"shipped model name or converted folder (default {DEFAULT_MODEL})")
    p.add_argument("--samplers", default=None,
                   help="comma-separated sampler specs NAME[:key=value[|alt]...] (default: "
                        f"{','.join(DEFAULT_SAMPLERS)}, those registered)")
    p.add_argument("--gen-lengths", type=_int_list, default=None,
                   help="comma-separated generation lengths (default 128,256,512)")
    p.add_argument("--n", type=int, default=50, help="held-out problems (default 50)")
    p.add_argument("--tasks", default=None, metavar="v1|v2|v3|v4",
                   help="testbed task set of the problems (default: the one the model "
                        "was trained on, v1 when it records none)")
    p.add_argument("--batch", type=int, default=1, help="prompts per call (default 1)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help='write {"meta", "rows"} here (rewritten after each gen length)')
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="tokens/s and accuracy against gen length (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--project", default=None, metavar="CHIPS",
                   help="also project each row's tokens/s on these chips from the model "
                        "calls it made (comma-separated CHIP[:bf16|int8], chips cpu, v5e, "
                        "v6e, h200; v5e defaults to int8 weights, the others to bf16; cpu "
                        "times each call shape of this model here). Projections, not "
                        "measurements: JSON rows hold them as \"projected\"")
    p.add_argument("--project-model", default=None, metavar="PRESET",
                   help="the model preset the chips are projected with (default "
                        "llada-8b-instruct for a LLaDA-style model, dream-7b-instruct "
                        "for a Dream-style one)")
    from asynclane_jax.models.quantize import add_flag

    add_flag(p)
    from asynclane_jax.generate_cli import add_scan_flag

    add_scan_flag(p)
    p.set_defaults(func=_cmd_bench)


def main(argv: list[str] | None = None) -> int:
    """`asynclane-jax bench ARGS`: returns the exit status (2 on a user error)."""
    parser = argparse.ArgumentParser(prog="asynclane-jax")
    register(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))
