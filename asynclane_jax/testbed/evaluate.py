"""Held-out exact-match evaluation of a model on the testbed tasks.

  python -m asynclane_jax.testbed.evaluate tiny-llada --sampler vanilla --gen-length 256 \\
      --n 500 --out results.json

Decoding goes through `asynclane_jax.decoding.generate`, the same loop every benchmark
uses; this module only builds prompts, checks answers and aggregates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from asynclane_jax.testbed import tasks
from asynclane_jax.testbed import tokenizer as tok
from asynclane_jax.testbed.tasks import check, line_accuracy

__all__ = ["evaluate", "check", "line_accuracy", "prompts_for", "SpeedTally", "SPLIT_SIZES",
           "check_n"]

# The most problems a split offers. The held-out split is the first HELDOUT_POOL problems
# of its seed: those are what the training stream skips, so only they are held out. The
# training stream is endless; this is a sane maximum (the problems are built in memory).
SPLIT_SIZES = {"heldout": tasks.HELDOUT_POOL, "train": 100_000}


def check_n(n, split: str = "heldout") -> None:
    """Raises ValueError unless n is a number of problems the split has."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"split={split!r}: expected one of {sorted(SPLIT_SIZES)}")
    most = SPLIT_SIZES[split]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise ValueError(f"n={n!r}: the {split} split has {most} problems; ask for 1 to {most}")


class SpeedTally:
    """Speed figures summed over `generate` calls: what `evaluate` reports, and what
    the lm-eval model (asynclane_jax.harness) reports beside the scores.

    `figures()`: tps, generated tokens (before the first EOS) per second of decoding
    wall time (compilation excluded; reported as compile_s); nfe_per_token, model calls
    serving a row (full + cached) per generated token; nfe_per_row, model calls per row;
    generated_tokens_per_row; wall_s; compile_s.
    """

    def __init__(self):
        self.rows = self.gen_tokens = self.row_nfe = 0
        self.wall = self.compile_s = 0.0

    def add(self, stats) -> None:
        """Adds one GenerationResult's stats (its real rows)."""
        self.wall += stats.decode_time
        self.compile_s += stats.compile_time
        self.rows += len(stats["generated_tokens"])
        self.gen_tokens += int(np.sum(stats["generated_tokens"]))
        self.row_nfe += int(np.sum(np.asarray(stats["row_nfe_full"])
                                   + np.asarray(stats["row_nfe_partial"])))

    def merge(self, other: SpeedTally) -> SpeedTally:
        """Adds another tally's counts to this one; returns self."""
        self.rows += other.rows
        self.gen_tokens += other.gen_tokens
        self.row_nfe += other.row_nfe
        self.wall += other.wall
        self.compile_s += other.compile_s
        return self

    def to_dict(self) -> dict:
        """The counts, for a result file a later run resumes from."""
        return {"rows": self.rows, "gen_tokens": self.gen_tokens, "row_nfe": self.row_nfe,
                "wall": self.wall, "compile_s": self.compile_s}

    @classmethod
    def from_dict(cls, d: dict) -> SpeedTally:
        tally = cls()
        tally.rows, tally.gen_tokens, tally.row_nfe = d["rows"], d["gen_tokens"], d["row_nfe"]
        tally.wall, tally.compile_s = d["wall"], d["compile_s"]
        return tally

    def figures(self) -> dict:
        return {
            "tps": self.gen_tokens / self.wall if self.wall else 0.0,
            "nfe_per_token": self.row_nfe / max(1, self.gen_tokens),
            "nfe_per_row": self.row_nfe / max(1, self.rows),
            "generated_tokens_per_row": self.gen_tokens / max(1, self.rows),
            "wall_s": self.wall,
            "compile_s": self.compile_s,
        }


def accuracy_by(ok, keys, order=None) -> dict:
    """{key: {"n", "accuracy"}} of rows' right / wrong `ok` grouped by their `keys`
    (e.g. family, answer-length bucket), in `order` (default: first appearance)."""
    counts: dict = {}
    for right, key in zip(ok, keys):
        n, r = counts.get(key, (0, 0))
        counts[key] = (n + 1, r + bool(right))
    return {k: {"n": counts[k][0], "accuracy": counts[k][1] / counts[k][0]}
            for k in (order or counts) if k in counts}


def _line_share(lines: list[tuple[int, int]]) -> float:
    return sum(r for r, _ in lines) / max(1, sum(t for _, t in lines))


def prompts_for(problems, tokenizer=None) -> list[list[int]]:
    """Chat-formatted prompt ids; through the HF tokenizer when one is given."""
    if tokenizer is None:
        return [tok.prompt_ids(p.prompt) for p in problems]
    return [tokenizer.encode(f"{tok.USER} {p.prompt} {tok.ASSISTANT}", add_special_tokens=False)
            for p in problems]


def evaluate(model, tokenizer=None, *, sampler: str = "vanilla", gen_length: int = 256,
             n: int = 500, split: str = "heldout", batch_size: int = 50,
             block_length: int | None = None, progress: bool = False, on_batch=None,
             task_set: str = tasks.DEFAULT_TASK_SET, resume: dict | None = None,
             families: Sequence[str] | None = None, buckets: Sequence[str] | None = None,
             **sampler_options) -> dict:
    """Exact-match accuracy (`tasks.check`) on n problems of a split, or on those of
    them in some families and answer-length buckets.

    Args:
      model: a DiffusionLM trained on the testbed vocabulary (e.g. load("tiny-llada")[0]).
      tokenizer: the model's tokenizer, or None for the built-in encoder (same ids).
      sampler: a sampler name of `asynclane_jax.decoding.generate`.
      gen_length: tokens generated per problem.
      n: number of problems (the first n of the split; families alternate).
      split: "heldout" (never trained on) or "train".
      batch_size: prompts per generate call.
      block_length: passed to generate (None: the sampler's default).
      progress: a tqdm bar on stderr (problems done, accuracy and tokens/s so far).
      on_batch: optional callback(partial_result_dict) after each batch.
      task_set: the task set the problems come from (`tasks.TASK_SETS`).
      resume: a result this function returned (or wrote through on_batch) for the same
        settings and an n no larger than this one: its problems are not decoded again,
        and the run goes on from the first problem it had not done.
      families, buckets: when given, only the first n problems of these families
        (`tasks.families_of(task_set)`) and answer-length buckets
        (`tasks.LENGTH_BUCKETS` names, e.g. ">256") are decoded; the result's
        "problems" lists their indices in the split, and its "n" counts them.
      **sampler_options: the sampler's options (steps, threshold, ...).
    Returns:
      {"accuracy", "n", "correct", "accuracy_<family>", "line_accuracy",
       "line_accuracy_<family>", "accuracy_length" (per answer-length bucket: n and
       accuracy), "tps", "per_problem" ([right, right lines, lines] of each problem,
       in order) and "tally" (the speed counts; both for `resume`),
       "nfe_per_token", "nfe_per_row", "wall_s", "sampler", "gen_length", ...}.
      tps: generated tokens (before the first EOS) per second of decoding wall time
      (compilation excluded; it is reported as compile_s);
      nfe_per_token: model calls per generated token (a row's calls over its tokens
      before EOS); nfe_per_row: model calls per problem.
    """
    from asynclane_jax.decoding import generate

    check_n(n, split)
    problems = tasks.split(split, n, task_set)
    buckets = None if buckets is None else list(buckets)
    families = None if families is None else list(families)
    indices = select(problems, task_set, families, buckets)
    problems = [problems[i] for i in indices]
    n = len(problems)
    lengths = [tasks.length_bucket(tasks.answer_tokens(p)) for p in problems]
    prompts = prompts_for(problems, tokenizer)
    bucket = max(len(p) for p in prompts)  # one prompt shape for the whole run
    ok: list[bool] = []
    lines: list[tuple[int, int]] = []
    speed = SpeedTally()
    settings = run_settings(sampler, gen_length, block_length, sampler_options, split,
                            task_set, families, buckets)
    if resume is not None:
        check_resumable(resume, settings, n)
        ok = [bool(r[0]) for r in resume["per_problem"]]
        lines = [(int(r[1]), int(r[2])) for r in resume["per_problem"]]
        speed = SpeedTally.from_dict(resume["tally"])
    batches = range(len(ok), n, batch_size)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, initial=len(ok), desc=f"eval ({sampler})", unit="problem",
                   file=sys.stderr, dynamic_ncols=True)
    result: dict = resume or {}
    for start in batches:
        chunk = problems[start:start + batch_size]
        res = generate(model, prompts[start:start + batch_size], sampler=sampler,
                       gen_length=gen_length, block_length=block_length, bucket=bucket,
                       tokenizer=tokenizer or tok.hf_tokenizer(), **sampler_options)
        speed.add(res.stats)
        for p, row in zip(chunk, res.tokens):
            ok.append(check(p, row))
            lines.append(line_accuracy(p, row))
        done = len(ok)
        result = {
            **settings, "n": done,
            **({} if families is None and buckets is None
               else {"problems": indices[:done]}),
            "correct": int(sum(ok)), "accuracy": float(np.mean(ok)),
            "line_accuracy": _line_share(lines),
            **speed.figures(),
        }
        for fam in tasks.families_of(task_set):
            sel = [i for i, p in enumerate(problems[:done]) if p.family == fam]
            if sel:
                result[f"accuracy_{fam}"] = float(np.mean([ok[i] for i in sel]))
                result[f"line_accuracy_{fam}"] = _line_share([lines[i] for i in sel])
                result[f"n_{fam}"] = len(sel)
        result["accuracy_length"] = accuracy_by(
            ok, lengths[:done], [name for name, _, _ in tasks.LENGTH_BUCKETS])
        result["per_problem"] = [[bool(o), r, t] for o, (r, t) in zip(ok, lines)]
        result["tally"] = speed.to_dict()
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix_str(f"accuracy {result['accuracy']:.3f}, "
                                f"{result['tps']:.1f} tok/s")
        if on_batch is not None:
            on_batch(result)
    if bar is not None:
        bar.close()
    return result


def select(problems, task_set: str, families=None, buckets=None) -> list[int]:
    """Indices of the problems in `families` and answer-length `buckets` (None: any);
    ValueError on a name that is not one of the task set's families or of
    `tasks.LENGTH_BUCKETS`, or when no problem is left."""
    known_families = tasks.families_of(task_set)
    known_buckets = [name for name, _, _ in tasks.LENGTH_BUCKETS]
    for wanted, known, what in ((families, known_families, "family"),
                                (buckets, known_buckets, "answer-length bucket")):
        bad = [w for w in wanted or () if w not in known]
        if bad:
            raise ValueError(f"unknown {what} {bad[0]!r}: expected one of {list(known)}")
    out = [i for i, p in enumerate(problems)
           if (families is None or p.family in families) and (
               buckets is None or tasks.length_bucket(tasks.answer_tokens(p)) in buckets)]
    if not out:
        raise ValueError(f"none of the {len(problems)} problems is in families "
                         f"{families or 'any'} and buckets {buckets or 'any'}")
    return out


def run_settings(sampler, gen_length, block_length, options, split, task_set, families,
                 buckets) -> dict:
    """What a result records of the run that made it, and a resume must match."""
    return {"sampler": sampler, "gen_length": gen_length, "block_length": block_length,
            "options": options, "split": split, "task_set": task_set,
            "families": families, "buckets": buckets}


def check_resumable(previous: dict, settings: dict, n: int) -> None:
    """Raises ValueError unless `previous` is a partial result of the same settings."""
    if "per_problem" not in previous or "tally" not in previous:
        raise ValueError("the result has no per-problem record (written by an older "
                         "version?); it cannot be resumed")
    differ = [f"{k}: {previous.get(k)!r} there, {v!r} here" for k, v in settings.items()
              if previous.get(k) != v]
    if differ:
        raise ValueError("the result was made with other settings (" + "; ".join(differ) + ")")
    if len(previous["per_problem"]) > n:
        raise ValueError(f"the result has {len(previous['per_problem'])} problems, "
                         f"more than the {n} asked for")


def write_json(path, obj) -> None:
    """Writes JSON through a temporary file, so an interrupted write leaves the last
    whole file in place."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Held-out accuracy on the testbed tasks.")
    ap.add_argument("model", help="shipped model name (tiny-llada, tiny-dream) or folder")
    ap.add_argument("--sampler", default="vanilla")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=None)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--tasks", default=None, choices=list(tasks.TASK_SETS),
                    help="task set (default: the one the model was trained on)")
    ap.add_argument("--option", action="append", default=[],
                    help="sampler option KEY=VALUE (repeatable), e.g. threshold=0.9")
    ap.add_argument("--families", default=None,
                    help="comma-separated families: only the first --n problems of these "
                         "(e.g. math)")
    ap.add_argument("--buckets", default=None,
                    help="comma-separated answer-length buckets: only the first --n problems "
                         "whose answers fall in them (<=64, 65-128, 129-256, >256)")
    ap.add_argument("--out", default=None, help="write the result JSON here (after each batch)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from the partial result in --out (same settings) instead of "
                         "starting again")
    args = ap.parse_args(argv)
    if args.resume and not args.out:
        ap.error("--resume needs --out (the result file to go on from)")
    try:
        check_n(args.n, args.split)
    except ValueError as e:
        print(f"evaluate: error: --n {args.n}: {e}", file=sys.stderr)
        sys.exit(2)

    from asynclane_jax import load
    from asynclane_jax.decoding.registry import parse_options

    options = parse_options(args.option)
    task_set = args.tasks or tasks.model_task_set(args.model)
    families = None if args.families is None else [f.strip() for f in args.families.split(",")]
    buckets = None if args.buckets is None else [b.strip() for b in args.buckets.split(",")]
    try:
        select(tasks.split(args.split, args.n, task_set), task_set, families, buckets)
    except ValueError as e:
        ap.error(str(e))
    previous = None
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)
        settings = run_settings(args.sampler, args.gen_length, args.block_length, options,
                                args.split, task_set, families, buckets)
        try:
            if previous.get("model") != args.model:
                raise ValueError(f"it is of model {previous.get('model')!r}")
            check_resumable(previous, settings, args.n)
        except ValueError as e:
            ap.error(f"--resume {args.out}: {e}")
    model, tokenizer, _ = load(args.model)
    t0 = time.time() - (previous or {}).get("elapsed_s", 0.0)

    def write(res):
        res = dict(res, model=args.model, elapsed_s=round(time.time() - t0, 1))
        if args.out:
            write_json(args.out, res)
        brief = {k: v for k, v in res.items()
                 if k not in ("per_problem", "tally", "problems")}
        print(json.dumps(brief), flush=True)

    write(evaluate(model, tokenizer, sampler=args.sampler, gen_length=args.gen_length, n=args.n,
                   split=args.split, batch_size=args.batch_size,
                   block_length=args.block_length, on_batch=write, task_set=task_set,
                   families=families, buckets=buckets,
                   resume=previous, **options))


if __name__ == "__main__":
    main()
