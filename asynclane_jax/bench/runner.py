"""The bench's runner: every sampler spec on the testbed's held-out problems, timed.

Measurement. All runs share one prompt bucket (the longest prompt), so each program
compiles once. Per generation length, every variant is first compiled by one call on the
first batch (not timed; its compile time is reported as compile_s); then every batch of
prompts is decoded by every variant in turn, in an order drawn afresh for each batch
(`run_order`), so that machine noise, and the warmth a program leaves behind for the
next call of the same program, hit all variants alike. Times are `stats.decode_time`
(compilation excluded). A spec with alternatives (`a|b`, bench.spec) reports its fastest
variant.

Row fields (one row per spec and generation length; the JSON file's `rows`):
  model, sampler (the spec as given), options (the options of the variant chosen),
  gen_length, n, batch;
  accuracy: exact-match accuracy of the final answer;
  tps: tokens before the first end-of-text, summed over problems, per second of decoding;
  nfe_per_token: model calls serving a row (full + cached) per generated token, summed
    over problems; tokens_per_call: its inverse (both None when nothing was generated);
  steps: mean loop iterations serving a problem;
  wall_s: seconds of decoding; compile_s: seconds compiling (0 when the program was
    already compiled in this process);
  task_set, accuracy_family, accuracy_length: the task set, and accuracy (with counts)
    per family and per answer-length bucket;
  tps_family: tokens/s per family (a call's decoding time shared evenly among its
    rows: exact at batch 1, where every call decodes one problem);
  comparison, the speed-up fields (COMPARISON_FIELDS): None here; a comparison step
    passed as `annotate` fills them (the command's is bench.compare.add_speedups, whose
    docstring defines them);
  calls: the model calls the timed decodes made, one dict per call shape (the
    `CallShape` fields, `calls`: program calls of that shape, `row_calls`: calls
    serving a problem, summed), from each decode's counters (`DecodeStats`);
  projected: {chip: tokens/s} projected from `calls` by a cost model (bench.project),
    or None when no projection was asked for.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

import numpy as np

from asynclane_jax.bench.spec import split_model, validate
from asynclane_jax.errors import UsageError

# The speed-up fields of a row, in the table's order: each is tokens/s over the fastest
# row of one comparison (bench.compare.COMPARISONS).
SPEEDUP_FIELDS = ("speedup_vs_fastest_baseline", "speedup_vs_fastest_early_stop",
                  "speedup_vs_fastest_equal_footing")
# The fields a comparison step fills (None without one).
COMPARISON_FIELDS = ("comparison", *SPEEDUP_FIELDS, "speedup_family_vs_equal_footing")
METRICS = ("accuracy", "tps", "nfe_per_token", "tokens_per_call", "steps", "wall_s",
           "compile_s", "accuracy_family", "accuracy_length", "tps_family", "calls",
           "gen_tokens")
ROW_KEYS = ("model", "sampler", "options", "gen_length", "n", "batch", "comparison",
            "accuracy", "tps", "nfe_per_token", "tokens_per_call", "steps", "wall_s",
            "compile_s", *SPEEDUP_FIELDS, "task_set", "accuracy_family",
            "accuracy_length", "tps_family", "speedup_family_vs_equal_footing", "calls",
            "gen_tokens", "projected")


class _Tally:
    """What one variant has measured at one generation length."""

    def __init__(self):
        self.ok: list[bool] = []
        self.groups: list[tuple[str, str]] = []  # (family, answer-length bucket) per row
        self.steps: list[int] = []
        self.gen_tokens = self.row_nfe = 0
        self.wall = self.compile = 0.0
        self.family_tokens: dict[str, int] = {}
        self.family_wall: dict[str, float] = {}
        self.shape_calls: dict = {}  # CallShape -> [program calls, row calls]

    def add(self, res, ok: list[bool], groups: list[tuple[str, str]]) -> None:
        self.groups.extend(groups)
        st = res.stats
        self.wall += st.decode_time
        self.gen_tokens += int(np.sum(st.generated_tokens))
        share = st.decode_time / max(len(groups), 1)  # exact at batch 1
        for (family, _), tokens in zip(groups, st.generated_tokens):
            self.family_tokens[family] = self.family_tokens.get(family, 0) + int(tokens)
            self.family_wall[family] = self.family_wall.get(family, 0.0) + share
        self.row_nfe += int(np.sum(np.asarray(st.row_nfe_full) + np.asarray(st.row_nfe_partial)))
        self.steps.extend(int(x) for x in st.row_steps)
        for i, shape in enumerate(st.call_shapes):
            n = self.shape_calls.setdefault(shape, [0, 0])
            n[0] += int(st.shape_calls[i])
            n[1] += int(np.sum(st.row_shape_calls[:, i]))
        self.ok.extend(ok)

    def metrics(self) -> dict:
        gen, nfe, wall = self.gen_tokens, self.row_nfe, self.wall
        return {
            "accuracy": float(np.mean(self.ok)) if self.ok else 0.0,
            "tps": gen / wall if wall > 0 else 0.0,
            "nfe_per_token": nfe / gen if gen else None,
            "tokens_per_call": gen / nfe if nfe else None,
            "steps": float(np.mean(self.steps)) if self.steps else 0.0,
            "wall_s": wall,
            "compile_s": self.compile,
            "accuracy_family": self._by(0),
            "accuracy_length": self._by(1),
            "tps_family": {f: (self.family_tokens[f] / w if w > 0 else 0.0)
                           for f, w in self.family_wall.items()},
            "calls": [{**shape.to_dict(), "calls": n, "row_calls": m}
                      for shape, (n, m) in self.shape_calls.items() if n],
            "gen_tokens": gen,
        }

    def _by(self, which: int) -> dict:
        """Accuracy per family (which 0) or per answer-length bucket (1), with counts."""
        from asynclane_jax.testbed.evaluate import accuracy_by

        return accuracy_by(self.ok, [g[which] for g in self.groups])


def run_order(batch: int, n: int) -> list[int]:
    """The order in which n variants decode batch number `batch`: a permutation drawn
    from a generator seeded by the batch number, the same in every run.

    Not a rotation: the task sets' problems cycle through their families, so a rotation
    whose period divides the cycle gives each family a fixed order (with two variants
    and four families, one variant always ran first on every math problem). What ran
    just before a call, its own program or another, changes a short decode's time,
    so a fixed order can tilt a per-family ratio; a drawn order cannot, on average.
    """
    return [int(k) for k in np.random.default_rng(batch).permutation(n)]


def run_bench(model, tokenizer, specs, gen_lengths, n, batch, progress=True, on_length=None,
              *, model_name: str | None = None, variants: list | None = None,
              quantize: str | None = None, task_set: str = "v1",
              annotate=None) -> list[dict]:
    """Runs every sampler spec at every generation length on the first n held-out
    problems of the testbed, interleaved (see the module docstring).

    Args:
      model, tokenizer: as `asynclane_jax.load` returns them (tokenizer may be None: the
        testbed's own encoder).
      specs: sampler specs (`parse_spec`).
      gen_lengths: generation lengths, run in this order.
      n: problems; batch: prompts per generate call.
      progress: a tqdm bar over all runs on stderr.
      on_length: optional callback(rows so far), called after each generation length
        (after `annotate`).
      model_name: the `model` field of the rows (default: the config's family).
      variants: an optional list that receives one dict per variant measured (spec,
        sampler, options, gen_length and the metrics of a row), chosen or not.
      task_set: the testbed task set the problems come from (`tasks.TASK_SETS`); the rows
        give accuracy per family and per answer-length bucket beside the overall figure.
      annotate: an optional comparison step, callback(rows so far) filling
        COMPARISON_FIELDS in place after each generation length (the command passes
        bench.compare.add_speedups); without it they stay None.
    Returns:
      The rows, ROW_KEYS each, in (gen_length, spec) order.
    """
    from asynclane_jax.decoding.api import generate
    from asynclane_jax.testbed import evaluate, tasks

    try:
        evaluate.check_n(n)
    except ValueError as e:
        raise UsageError(f"--n {n}: {e}") from None
    if batch <= 0:
        raise UsageError(f"--batch {batch}: must be a positive number of prompts")
    gen_lengths = list(gen_lengths)
    parsed = validate(list(specs), gen_lengths)
    cfg = model.cfg
    try:
        problems = tasks.split("heldout", n, task_set)
    except ValueError as e:
        raise UsageError(f"--tasks: {e}") from None
    groups = [(p.family, tasks.length_bucket(tasks.answer_tokens(p))) for p in problems]
    prompts = evaluate.prompts_for(problems, tokenizer)
    bucket = max(len(p) for p in prompts)  # one prompt shape for the whole run
    too_long = [g for g in gen_lengths if bucket + g > cfg.max_seq_len]
    if too_long:
        raise UsageError(f"gen length(s) {too_long} do not fit the model: prompts of "
                         f"{bucket} tokens + gen length > max_seq_len {cfg.max_seq_len}")
    model_name = model_name or cfg.family
    models = {None: model}  # a spec's own model (SPEC@MODEL), loaded once
    for spec, _, _ in parsed:
        other = split_model(spec)[1]
        if other is not None and other not in models:
            import asynclane_jax

            models[other] = asynclane_jax.load(other, quantize=quantize)[0]
            if models[other].cfg.vocab_size != cfg.vocab_size:
                raise UsageError(f"{spec}: model {other} has another vocabulary than "
                                 f"{model_name}")
    chunks = [range(s, min(s + batch, n)) for s in range(0, n, batch)]
    runs = [(spec, name, opts) for spec, name, alts in parsed for opts in alts]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(gen_lengths) * len(runs) * (len(chunks) + 1), unit="run",
                   file=sys.stderr, dynamic_ncols=True)
    rows: list[dict] = []
    try:
        for g in gen_lengths:
            accs = [_Tally() for _ in runs]

            def decode(i, chunk, g=g, accs=accs):
                spec, name, opts = runs[i]
                if bar is not None:
                    bar.set_description(f"{g} {spec} {opts}"[:60])
                res = generate(models[split_model(spec)[1]], [prompts[j] for j in chunk],
                               sampler=name,
                               gen_length=g, bucket=bucket, tokenizer=tokenizer, **opts)
                accs[i].compile += res.stats.compile_time
                if bar is not None:
                    bar.update(1)
                return res

            for i in range(len(runs)):  # warm-up: compile every program once
                decode(i, chunks[0])
            for c, chunk in enumerate(chunks):
                for i in run_order(c, len(runs)):  # every variant on this chunk
                    res = decode(i, chunk)
                    accs[i].add(res, [evaluate.check(problems[j], row)
                                      for j, row in zip(chunk, res.tokens)],
                                [groups[j] for j in chunk])
            measured = [{"spec": spec, "sampler": name, "options": opts, "gen_length": g,
                         **acc.metrics()}
                        for (spec, name, opts), acc in zip(runs, accs)]
            if variants is not None:
                variants.extend(measured)
            for spec, _, _ in parsed:
                best = max((m for m in measured if m["spec"] == spec),
                           key=lambda m: m["tps"])
                row = {"model": model_name, "sampler": spec, "options": best["options"],
                       "gen_length": g, "n": n, "batch": batch, "comparison": None,
                       **{k: best[k] for k in METRICS},
                       "task_set": task_set,
                       **dict.fromkeys(SPEEDUP_FIELDS),
                       "speedup_family_vs_equal_footing": None, "projected": None}
                rows.append(row)
            if annotate is not None:
                annotate(rows)
            if on_length is not None:
                on_length(rows)
    finally:
        if bar is not None:
            bar.close()
    return rows


def bench_meta(model_name: str, n: int, batch: int, specs, gen_lengths) -> dict:
    """The `meta` object of the JSON file: what ran where."""
    import jax

    import asynclane_jax

    dev = jax.devices()[0]
    return {"model": model_name, "samplers": list(specs), "gen_lengths": list(gen_lengths),
            "n": n, "batch": batch, "split": "heldout", "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
            "jax": jax.__version__, "asynclane_jax": asynclane_jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_json(path, meta: dict, rows: list[dict]) -> None:
    """Writes {"meta", "rows"} atomically (a temporary file renamed over path)."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    os.replace(tmp, path)
