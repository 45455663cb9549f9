"""`asynclane-jax bench`: samplers side by side on the testbed's held-out problems.

  asynclane-jax bench --model tiny-llada --samplers vanilla,fast-dllm,localleap \\
      --gen-lengths 128,256,512 --n 50 [--batch 1] [--json FILE] [--plot FILE.png]

A sampler spec is `NAME` or `NAME:key=value:key=value`; a value reads as JSON when it
parses (0.8, true) and as a string otherwise. A value may list alternatives with `|`
(`fast-dllm:cache=prefix|dual`): every combination is run and the spec's row reports
the fastest one (highest tokens/s), with the options it used. `fast-dllm` and
`localleap` take `cache=prefix|dual` when the spec names no cache (their best setting:
the faster of prefix and dual cache, their other options at their defaults).
`SPEC@MODEL` runs that spec on another model of the same vocabulary, e.g.
`d2f@tiny-llada-d2f`: D2F on its block-causal student beside the samplers on --model.

Measurement. All runs share one prompt bucket (the longest prompt), so each program
compiles once. Per generation length, every variant is first compiled by one call on the
first batch (not timed; its compile time is reported as compile_s); then every batch of
prompts is decoded by every variant in turn, the order rotated from batch to batch, so
that machine noise hits all variants alike. Times are `stats.decode_time` (compilation
excluded).

Three comparisons. Every row belongs to one (its `comparison` field, a column of the
table), and AsyncLane's speed-ups are reported against the fastest baseline of each
separately:
  (a) `published`: the baselines as published (no early stop, no horizon, no cascade);
  (b) `early-stop`: the baselines with early_stop=true (no horizon, no cascade);
  (c) `equal-footing`: the block baselines given AsyncLane's mid-block cascade
    (cascade=true; the default specs add early_stop=true, and run each baseline at
    its published threshold, 0.9, and at AsyncLane's, 0.95, reporting the faster),
    the visible horizon
    AsyncLane's row uses (none by default, as AsyncLane's default is none) and its
    renewal calls (`renew`: none by default, as AsyncLane's default is none; the
    default specs also run the baselines with the dual cache and renew=256 against
    `asynclane:renew=256`). An asynclane row's (c) speed-up is over the fastest (c)
    row of its own footing (`footing`: horizon and renew, the sampler's defaults when
    not given), so `asynclane:horizon=96` meets `fast-dllm:horizon=96:cascade=true`,
    the default asynclane meets the (c) rows without renewals and
    `asynclane:renew=256` those with renew=256.
Rows of `asynclane` itself are `asynclane`; a baseline with a horizon or renewals but
no cascade is `other` and in no comparison.

Row fields (one row per spec and generation length):
  model, sampler (the spec as given), options (the options of the variant chosen),
  gen_length, n, batch;
  comparison: published | early-stop | equal-footing | asynclane | other (above);
  accuracy: exact-match accuracy of the final answer;
  tps: tokens before the first end-of-text, summed over problems, per second of decoding;
  nfe_per_token: model calls serving a row (full + cached) per generated token, summed
    over problems; tokens_per_call: its inverse (both None when nothing was generated);
  steps: mean loop iterations serving a problem;
  wall_s: seconds of decoding; compile_s: seconds compiling (0 when the program was
    already compiled in this process);
  speedup_vs_fastest_baseline: tps over the highest tps at the same gen_length among
    the (a) published rows (None when there is none);
  speedup_vs_fastest_early_stop: the same over the (b) early-stop rows;
  speedup_vs_fastest_equal_footing: the same over the (c) equal-footing rows with the
    row's footing (horizon and renewals);
  task_set, accuracy_family, accuracy_length: the task set, and accuracy (with counts)
    per family and per answer-length bucket;
  tps_family: tokens/s per family (a call's decoding time shared evenly among its
    rows: exact at batch 1, where every call decodes one problem);
  speedup_family_vs_equal_footing: per family, tps_family over the highest tps_family
    of the (c) rows of the row's footing (None without such rows).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import platform
import sys

import numpy as np

from asynclane_jax.errors import UsageError, run_command

# The (c) specs: AsyncLane's default cascade and horizon (none) and early stop (its
# block_length, 32, is the default), its threshold beside the baseline's published one
# (the faster is reported), and with the renewal calls AsyncLane offers as an option
# (renew=256, the dual cache; met by `asynclane:renew=256`).
EQUAL_FOOTING = "cascade=true:early_stop=true:threshold=0.9|0.95"
RENEWAL = "cache=dual:renew=256"
DEFAULT_SAMPLERS = ("vanilla", "fast-dllm", "localleap", "fast-dllm:early_stop=true",
                    "localleap:early_stop=true", f"fast-dllm:{EQUAL_FOOTING}",
                    f"localleap:{EQUAL_FOOTING}", f"fast-dllm:{EQUAL_FOOTING}:{RENEWAL}",
                    f"localleap:{EQUAL_FOOTING}:{RENEWAL}", "asynclane", "asynclane:renew=256")
DEFAULT_GEN_LENGTHS = (128, 256, 512)
# Options a spec gets when it does not set them: each sampler at its best setting.
DEFAULT_OPTIONS = {"fast-dllm": {"cache": "prefix|dual"},
                   "localleap": {"cache": "prefix|dual"}}
# Rows of this sampler are not baselines: they are compared with each comparison's.
NEW_SAMPLER = "asynclane"
# The comparisons (module docstring): the row field's value -> the speed-up field
# against that comparison's fastest row, and the label of the printed table.
COMPARISONS = {"published": "speedup_vs_fastest_baseline",
               "early-stop": "speedup_vs_fastest_early_stop",
               "equal-footing": "speedup_vs_fastest_equal_footing"}
COMPARISON_LABELS = {"published": "(a) published", "early-stop": "(b) early stop",
                     "equal-footing": "(c) equal footing", NEW_SAMPLER: NEW_SAMPLER,
                     "other": "other"}

ROW_KEYS = ("model", "sampler", "options", "gen_length", "n", "batch", "comparison",
            "accuracy", "tps", "nfe_per_token", "tokens_per_call", "steps", "wall_s",
            "compile_s", *COMPARISONS.values(), "task_set", "accuracy_family",
            "accuracy_length", "tps_family", "speedup_family_vs_equal_footing")


def default_specs() -> list[str]:
    """DEFAULT_SAMPLERS, those whose sampler is registered."""
    from asynclane_jax.decoding.registry import samplers

    return [s for s in DEFAULT_SAMPLERS if s.split(":")[0] in samplers()]


def split_model(spec: str) -> tuple[str, str | None]:
    """`SPEC@MODEL` -> (SPEC, MODEL): the variant runs on another model (e.g. d2f on
    the D2F student `d2f@tiny-llada-d2f`); plain SPEC -> (SPEC, None)."""
    base, at, other = spec.partition("@")
    if at and not other.strip():
        raise UsageError(f"sampler spec {spec!r}: no model name after '@'")
    return base, (other.strip() or None)


def parse_spec(spec: str) -> tuple[str, list[dict]]:
    """Reads a sampler spec.

    Args:
      spec: `NAME` or `NAME:key=value:...`; a value may list alternatives with `|`.
    Returns:
      (sampler name, one options dict per combination of alternatives, in order).
      DEFAULT_OPTIONS are filled in for the keys the spec leaves out.
    Raises:
      UsageError: an empty name, a part without `=`, a key given twice, an empty
        alternative.
    """
    from asynclane_jax.decoding.registry import parse_options

    name, *parts = spec.strip().split(":")
    name = name.strip()
    if not name:
        raise UsageError(f"sampler spec {spec!r}: no sampler name")
    choices: dict[str, list] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"sampler spec {spec!r}: {part!r} is not key=value")
        if key in choices:
            raise UsageError(f"sampler spec {spec!r}: option {key!r} given twice")
        alts = value.split("|")
        if any(not a.strip() for a in alts):
            raise UsageError(f"sampler spec {spec!r}: {part!r} has an empty value")
        choices[key] = [parse_options([f"{key}={a.strip()}"])[key] for a in alts]
    for key, value in DEFAULT_OPTIONS.get(name, {}).items():
        if key not in choices:
            choices[key] = [parse_options([f"{key}={a}"])[key] for a in value.split("|")]
    keys = list(choices)
    return name, [dict(zip(keys, combo)) for combo in itertools.product(*choices.values())]


def _check_types(name: str, options: dict) -> None:
    """An option value of the wrong type is a one-line error (e.g. threshold=high)."""
    from asynclane_jax.decoding.registry import get_schedule_class, option_fields, option_type

    cls = get_schedule_class(name)
    fields = option_fields(cls)
    for key, value in options.items():
        if key not in fields or value is None:
            continue  # unknown options are reported by the schedule itself
        typ = option_type(cls, key)
        if typ is bool:
            ok = isinstance(value, bool)
        elif typ is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, typ) and not isinstance(value, bool)
        if not ok:
            raise UsageError(f"{name}: option {key}={value!r} is not a {typ.__name__}")


def validate(specs, gen_lengths) -> list[tuple[str, str, list[dict]]]:
    """Parses every spec and builds every schedule it asks for at every generation
    length, so that a bad name or option fails before any decoding.

    Returns:
      [(spec, sampler name, options per variant)].
    """
    from asynclane_jax.decoding.api import make_schedule

    if not specs:
        raise UsageError("no samplers given")
    if len(set(specs)) != len(specs):
        raise UsageError(f"a sampler spec is given twice: {list(specs)}")
    for g in gen_lengths:
        if g <= 0:
            raise UsageError(f"gen length {g}: must be a positive number of tokens")
    parsed = []
    for spec in specs:
        name, variants = parse_spec(split_model(spec)[0])
        for opts in variants:
            _check_types(name, opts)
            for g in gen_lengths:
                make_schedule(name, gen_length=g, **opts)
        parsed.append((spec, name, variants))
    return parsed


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
        }

    def _by(self, which: int) -> dict:
        """Accuracy per family (which 0) or per answer-length bucket (1), with counts."""
        from asynclane_jax.testbed.evaluate import accuracy_by

        return accuracy_by(self.ok, [g[which] for g in self.groups])


def comparison_of(sampler: str, options: dict) -> str:
    """The comparison a row belongs to (module docstring): published, early-stop,
    equal-footing, asynclane or other."""
    if parse_spec(split_model(sampler)[0])[0] == NEW_SAMPLER:
        return NEW_SAMPLER
    if options.get("cascade") is True:
        return "equal-footing"
    if options.get("horizon") or options.get("renew"):
        return "other"
    return "early-stop" if options.get("early_stop") is True else "published"


def footing(row: dict) -> tuple[int, int]:
    """(horizon, renew) of a row: its options, else its sampler's defaults (0 where
    the sampler has no such option; renew 0 under a horizon). A (c) row meets an
    asynclane row of the same footing only."""
    from asynclane_jax.decoding.registry import get_schedule_class, option_fields
    from asynclane_jax.decoding.schedule import SamplerError

    name = parse_spec(split_model(row["sampler"])[0])[0]
    try:
        fields = option_fields(get_schedule_class(name))
    except SamplerError:  # an unknown sampler has no defaults to read
        fields = {}

    def value(key: str) -> int:
        if key in row["options"]:
            return int(row["options"][key] or 0)
        f = fields.get(key)
        return int(f.default or 0) if f is not None and isinstance(f.default, int) else 0

    horizon = value("horizon")
    # Renewals do not go with a horizon (asynclane keeps its full forwards, the block
    # samplers refuse the pair).
    return horizon, 0 if horizon else value("renew")


def add_speedups(rows: list[dict]) -> list[dict]:
    """Fills `comparison` and the three speed-up fields in place, per gen_length (see
    the module docstring); returns rows."""
    for r in rows:
        r["comparison"] = comparison_of(r["sampler"], r["options"])
    for g in {r["gen_length"] for r in rows}:
        same = [r for r in rows if r["gen_length"] == g]
        for which, field in COMPARISONS.items():
            for r in same:
                # (c) rows meet a row only at its own footing; (a) and (b) have none.
                best = max((o["tps"] for o in same if o["comparison"] == which
                            and (which != "equal-footing" or footing(o) == footing(r))),
                           default=0.0)
                r[field] = r["tps"] / best if best > 0 else None
        for r in same:
            rivals = [o for o in same if o["comparison"] == "equal-footing"
                      and footing(o) == footing(r)]
            fams = r.get("tps_family") or {}
            per = {}
            for f, tps in fams.items():
                best = max((o.get("tps_family", {}).get(f, 0.0) for o in rivals), default=0.0)
                per[f] = tps / best if best > 0 else None
            r["speedup_family_vs_equal_footing"] = per if rivals else None
    return rows


def run_bench(model, tokenizer, specs, gen_lengths, n, batch, progress=True, on_length=None,
              *, model_name: str | None = None, variants: list | None = None,
              quantize: str | None = None, task_set: str = "v1") -> list[dict]:
    """Runs every sampler spec at every generation length on the first n held-out
    problems of the testbed, interleaved (see the module docstring).

    Args:
      model, tokenizer: as `asynclane_jax.load` returns them (tokenizer may be None: the
        testbed's own encoder).
      specs: sampler specs (`parse_spec`).
      gen_lengths: generation lengths, run in this order.
      n: problems; batch: prompts per generate call.
      progress: a tqdm bar over all runs on stderr.
      on_length: optional callback(rows so far), called after each generation length.
      model_name: the `model` field of the rows (default: the config's family).
      variants: an optional list that receives one dict per variant measured (spec,
        sampler, options, gen_length and the metrics of a row), chosen or not.
      task_set: the testbed task set the problems come from (`tasks.TASK_SETS`); the rows
        give accuracy per family and per answer-length bucket beside the overall figure.
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
                for k in range(len(runs)):  # every variant on this chunk, order rotated
                    i = (c + k) % len(runs)
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
                       "gen_length": g, "n": n, "batch": batch,
                       "comparison": comparison_of(spec, best["options"]),
                       **{k: best[k] for k in ("accuracy", "tps", "nfe_per_token",
                                               "tokens_per_call", "steps", "wall_s",
                                               "compile_s", "accuracy_family",
                                               "accuracy_length", "tps_family")},
                       "task_set": task_set,
                       **dict.fromkeys(COMPARISONS.values()),
                       "speedup_family_vs_equal_footing": None}
                rows.append(row)
            add_speedups(rows)
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


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _opts_text(opts: dict) -> str:
    return " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                    for k, v in opts.items())


TABLE_HEAD = ("gen", "comparison", "sampler", "chosen options", "accuracy", "tokens/s",
              "vs (a)", "vs (b)", "vs (c)", "calls/token", "steps", "decode s", "compile s")


def table_rows(rows: list[dict]) -> list[tuple[str, ...]]:
    """The cells of the summary table, one tuple per row (TABLE_HEAD)."""
    return [(str(r["gen_length"]),
             COMPARISON_LABELS.get(r.get("comparison"), str(r.get("comparison"))),
             r["sampler"], _opts_text(r["options"]),
             f"{100 * r['accuracy']:.1f}%", f"{r['tps']:.1f}",
             *(_fmt(r.get(field), ".2f", "x") for field in COMPARISONS.values()),
             _fmt(r["nfe_per_token"], ".3f"), f"{r['steps']:.1f}", f"{r['wall_s']:.2f}",
             f"{r['compile_s']:.1f}") for r in rows]


def to_markdown(rows: list[dict], meta: dict) -> str:
    """A markdown report: what ran (and the command, when meta has one), then one table
    row per bench row."""
    lines = [f"# Samplers on `{meta.get('model')}`", ""]
    if meta.get("command"):
        lines += ["Made by:", "", "```", meta["command"], "```", ""]
    lines += [f"{meta.get('n')} held-out problems per row, batch {meta.get('batch')}; backend "
              f"{meta.get('backend')} ({meta.get('device')}, {meta.get('machine')}), "
              f"{meta.get('date')}. Tokens/s: tokens before the first end-of-text per second "
              "of decoding, compilation excluded; samplers interleaved batch by batch. A "
              "spec with alternatives (`a|b`) reports its fastest; `chosen options` names "
              "it.", "",
              "Three comparisons, each row in one (`comparison`); vs (a) / (b) / (c): "
              "tokens/s over the fastest row of that comparison at the same length.",
              "- (a) published: the baselines as published (no early stop, no horizon, no "
              "cascade). They decode every position of the canvas.",
              "- (b) early stop: the same with early_stop=true; they still attend to the "
              "whole canvas.",
              "- (c) equal footing: block baselines given AsyncLane's mid-block cascade "
              "(cascade=true; the default specs add early_stop=true and run each baseline "
              "at its published threshold, 0.9, and at AsyncLane's, 0.95, keeping the "
              "faster: `chosen options` names it), the visible "
              "horizon AsyncLane's row uses (none by default) and its renewal calls "
              "(none by default; with renew=256 the refreshes are renewals: the block "
              "before the window and the 256 positions after it are re-encoded in a "
              "wide cached call instead of a full forward, where that call is narrower "
              "than the canvas). An asynclane row is "
              "compared with the (c) rows of its own footing (horizon, renew); a row "
              "with a horizon attends only to the first block_length + horizon generated "
              "positions until the window nears their end.",
              "- asynclane rows are compared with each; `other` rows with none.", "",
              "| " + " | ".join(TABLE_HEAD) + " |",
              "|" + "---|" * len(TABLE_HEAD)]
    lines += [_md_row(cells) for cells in table_rows(rows)]
    lines += breakdown_markdown(rows)
    return "\n".join(lines) + "\n"


def breakdown_markdown(rows: list[dict]) -> list[str]:
    """Markdown lines: per generation length, each row's accuracy per family and per
    answer-length bucket, and its tokens/s per family with (for asynclane rows) the
    speed-up over the fastest (c) row on that family. Empty when no row has them."""
    from asynclane_jax.testbed.tasks import LENGTH_BUCKETS

    if not any(r.get("accuracy_family") for r in rows):
        return []
    out = ["", "Per family and per answer-length bucket (accuracy, then tokens/s per "
           "family; for asynclane rows, in brackets, its speed-up over the fastest (c) "
           "row on that family; bucket sizes in the header):"]
    for g in sorted({r["gen_length"] for r in rows}):
        same = [r for r in rows if r["gen_length"] == g]
        fams = list(dict.fromkeys(f for r in same for f in (r.get("accuracy_family") or {})))
        seen = {b for r in same for b in (r.get("accuracy_length") or {})}
        lens = [name for name, *_ in LENGTH_BUCKETS if name in seen]
        first = same[0]

        def count(which, key, first=first):
            return (first.get(which) or {}).get(key, {}).get("n", "?")

        head = (["sampler"] + [f"{f} ({count('accuracy_family', f)})" for f in fams]
                + [f"{b} tok ({count('accuracy_length', b)})" for b in lens]
                + [f"{f} tok/s" for f in fams])
        out += ["", f"gen_length {g}:", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]
        for r in same:
            acc_f = r.get("accuracy_family") or {}
            acc_l = r.get("accuracy_length") or {}
            tps_f = r.get("tps_family") or {}
            spd = r.get("speedup_family_vs_equal_footing") or {}
            cells = [r["sampler"]]
            cells += [f"{100 * acc_f[f]['accuracy']:.1f}%" if f in acc_f else "-" for f in fams]
            cells += [f"{100 * acc_l[b]['accuracy']:.1f}%" if b in acc_l else "-" for b in lens]
            for f in fams:
                cell = f"{tps_f[f]:.0f}" if f in tps_f else "-"
                if r.get("comparison") == NEW_SAMPLER and spd.get(f) is not None:
                    cell += f" ({spd[f]:.2f}x)"
                cells.append(cell)
            out.append(_md_row(cells))
    return out


def _md_row(cells) -> str:
    """One markdown table row; a `|` inside a cell (a spec's alternatives) escaped."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def print_table(rows: list[dict], file=None) -> None:
    """The summary table: drawn with `rich` on a terminal when it is installed, else
    plain aligned text."""
    file = file or sys.stdout
    cells = table_rows(rows)
    try:
        if not file.isatty():
            raise ImportError  # plain text for files and pipes
        from rich.console import Console
        from rich.table import Table
    except (ImportError, AttributeError):
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(TABLE_HEAD)]
        for line in (TABLE_HEAD, *cells):
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip(), file=file)
        return
    table = Table(*TABLE_HEAD)
    for c in cells:
        table.add_row(*c)
    Console(file=file).print(table)


def _require_matplotlib(flag: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install 'asynclane-jax[plots]'") from None


def plot_rows(rows: list[dict], path, meta: dict | None = None):
    """Two panels against gen_length, one line per sampler spec: tokens/s (log scale) and
    accuracy. Saved as PNG (Agg); returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_tps, ax_acc = fig.subplots(1, 2)
    markers = "osD^v<>ph*"
    # Line style by comparison: (a) solid, (b) dashed, (c) dotted, asynclane thick.
    lines = {"published": "-", "early-stop": "--", "equal-footing": ":"}
    for k, spec in enumerate(dict.fromkeys(r["sampler"] for r in rows)):
        sel = sorted((r for r in rows if r["sampler"] == spec), key=lambda r: r["gen_length"])
        x = [r["gen_length"] for r in sel]
        which = sel[0].get("comparison")
        label = f"{COMPARISON_LABELS[which][:3]} {spec}" if which in COMPARISONS else spec
        style = dict(marker=markers[k % len(markers)], label=label,
                     linestyle=lines.get(which, "-"),
                     linewidth=2.5 if which == NEW_SAMPLER else 1.5)
        ax_tps.plot(x, [r["tps"] for r in sel], **style)
        ax_acc.plot(x, [100 * r["accuracy"] for r in sel], **style)
    lengths = sorted({r["gen_length"] for r in rows})
    for ax in (ax_tps, ax_acc):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("gen length")
        ax.set_xticks(lengths, labels=[str(g) for g in lengths])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    ax_tps.set_yscale("log")
    ax_tps.set_ylabel("tokens / s (decoding)")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.set_ylim(-2, 102)
    ax_acc.legend(fontsize=8)
    if meta:
        fig.suptitle(f"{meta.get('model')}: {meta.get('n')} held-out problems, batch "
                     f"{meta.get('batch')}, {meta.get('backend')} ({meta.get('device')})")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return fig


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
    model_name = args.model
    model, tokenizer, _ = asynclane_jax.load(model_name, quantize=args.quantize,
                                              scan_layers=args.scan_layers)
    meta = bench_meta(str(model_name), args.n, args.batch, specs, gen_lengths)
    meta["quantize"] = args.quantize
    task_set = args.tasks or tasks.model_task_set(model_name)
    meta["task_set"] = task_set

    def on_length(rows):
        if args.json:
            write_json(args.json, meta, rows)

    rows = run_bench(model, tokenizer, specs, gen_lengths, args.n, args.batch,
                     progress=not args.quiet, on_length=on_length, model_name=str(model_name),
                     quantize=args.quantize, task_set=task_set)
    print_table(rows)
    if args.plot:
        plot_rows(rows, args.plot, meta)
    return 0


def register(sub) -> None:
    """Adds the `bench` subcommand to an argparse subparsers object."""
    p = sub.add_parser("bench", help="samplers side by side: accuracy and tokens/s on the "
                                     "testbed's held-out problems",
                       description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    sys.exit(main())
