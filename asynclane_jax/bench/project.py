"""Projected tokens/s of bench rows on other chips: each row's recorded model calls
(`calls`, by shape) priced by the cost model (asynclane_jax.costs).

A projection is not a measurement. It prices every call shape of the decodes the bench
timed on this machine as the same call of a real preset (by default the 8B LLaDA preset
for LLaDA-style models, the 7B Dream preset for Dream-style ones, LLaDA2-mini for
LLaDA2-style mixture-of-experts ones) on a chip's roofline,
so the samplers keep the tiny model's decisions (which calls, how many) and take the
large model's cost per call. `cpu` prices them instead on this machine (`CpuCosts`):
each call shape of the bench's own model timed (asynclane_jax.costs.measure), plus the
schedule's own work per call, timed with the model's layers taken out
(asynclane_jax.costs.loop): a check of the method against the decode times the bench
measured.
"""

from __future__ import annotations

from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.errors import UsageError

CHIPS = ("cpu", "v5e", "v6e", "h200")
WEIGHTS = ("bf16", "int8")
# The weights a chip is projected with when the spec names none: the 8B preset's
# bfloat16 weights do not fit one v5e chip's memory, so v5e runs it in int8.
DEFAULT_WEIGHTS = {"v5e": "int8"}
DEFAULT_PROJECT_MODELS = {"llada": "llada-8b-instruct", "dream": "dream-7b-instruct",
                          "llada2": "llada2-mini"}


def family_of_name(name: str) -> str:
    """The family a bench's model name points to (its key in DEFAULT_PROJECT_MODELS),
    for a bench file that records the model's name, not its config: "llada2" when the
    name holds "llada2" (checked first: such a name holds "llada" too), "dream" when it
    holds "dream", else "llada"; case ignored."""
    name = str(name).lower()
    if "llada2" in name:
        return "llada2"
    return "dream" if "dream" in name else "llada"


def parse_chips(text: str) -> list[tuple[str, str]]:
    """`--project` CHIP[:WEIGHTS],... -> [(chip, weights)]; `cpu` takes the bench's
    own model as it was loaded (its weights are not chosen here)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        chip, _, weights = item.partition(":")
        if chip not in CHIPS:
            raise UsageError(f"--project {item!r}: unknown chip {chip!r}; expected one of "
                             f"{', '.join(CHIPS)}")
        if chip == "cpu" and weights:
            raise UsageError(f"--project {item!r}: cpu times the bench's own model; "
                             "it takes no weights")
        weights = weights or DEFAULT_WEIGHTS.get(chip, "bf16")
        if weights not in WEIGHTS:
            raise UsageError(f"--project {item!r}: weights {weights!r}; expected one of "
                             f"{', '.join(WEIGHTS)}")
        if (chip, weights) in out:
            raise UsageError(f"--project: {item!r} is named twice")
        out.append((chip, weights))
    if not out:
        raise UsageError("--project: name at least one chip (cpu, v5e, v6e, h200)")
    return out


def label(chip: str, weights: str) -> str:
    """The key of a projection in a row's `projected`: the chip, with `-int8` for int8
    weights (e.g. `v6e`, `v5e-int8`)."""
    return chip if chip == "cpu" or weights == "bf16" else f"{chip}-{weights}"


def project_model_config(name: str | None, family: str):
    """The preset the chips are projected with (`--project-model`; default by family)."""
    from asynclane_jax.models import config

    name = name or DEFAULT_PROJECT_MODELS[family]
    try:
        return config.preset(name)
    except (KeyError, ValueError) as e:
        raise UsageError(f"--project-model {name!r}: {e}") from None


def row_counts(row: dict) -> list[tuple[CallShape, int]]:
    """[(CallShape, calls)] of a bench row."""
    return [(CallShape.from_dict(c), int(c["calls"])) for c in row.get("calls") or []]


class CpuCosts:
    """The `cpu` projection of a bench row: its calls priced by this machine's measured
    cost of each shape, plus, per call, the schedule's own work (the loop overhead of
    its sampler and options at the row's canvas and batch), measured once per variant.

    Args:
      model, tokenizer: the bench's model (a row of a spec on another model, SPEC@MODEL,
        is priced with that model, loaded here once).
      task_set: the testbed task set whose first held-out prompts the loop overhead is
        measured on.
      calls: the per-shape call costs (default: MeasuredCosts of the model).

    The loop overhead is the mean over `overhead_groups` batches of held-out prompts
    (one prompt's decode path is not every prompt's).
    """

    overhead_groups = 4

    def __init__(self, model, tokenizer=None, task_set: str = "v1", calls=None):
        from asynclane_jax.costs.measure import MeasuredCosts

        self.model, self.tokenizer, self.task_set = model, tokenizer, task_set
        self.calls = calls if calls is not None else MeasuredCosts(model)
        self.cfg = model.cfg
        self._overhead: dict = {}
        self._others: dict = {}  # SPEC@MODEL's model -> (model, MeasuredCosts)

    def _model_of(self, row: dict):
        """(model, its call costs) of a row: the bench's, or its spec's own."""
        from asynclane_jax.bench.spec import split_model

        other = split_model(row["sampler"])[1]
        if other is None:
            return self.model, self.calls
        if other not in self._others:
            import asynclane_jax
            from asynclane_jax.costs.measure import MeasuredCosts

            m = asynclane_jax.load(other)[0]
            self._others[other] = (m, MeasuredCosts(m))
        return self._others[other]

    def overhead(self, row: dict) -> float:
        """Seconds per call the row's decodes spend outside their calls."""
        from asynclane_jax.bench.spec import split_model
        from asynclane_jax.costs.loop import loop_overhead
        from asynclane_jax.testbed import evaluate, tasks

        counts = row_counts(row)
        if not counts:
            return 0.0
        canvas = counts[0][0].canvas
        sampler = split_model(row["sampler"])[0].split(":")[0]
        key = (row["sampler"].split(":")[0], json_key(row["options"]), row["gen_length"],
               row["batch"], canvas)
        if key not in self._overhead:
            b, groups = row["batch"], self.overhead_groups
            problems = tasks.split("heldout", b * groups, self.task_set)
            prompts = evaluate.prompts_for(problems, self.tokenizer)
            self._overhead[key] = sum(loop_overhead(
                self._model_of(row)[0], prompts[g * b:(g + 1) * b], sampler=sampler,
                gen_length=row["gen_length"], bucket=canvas - row["gen_length"],
                tokenizer=self.tokenizer, **row["options"]) for g in range(groups)) / groups
        return self._overhead[key]

    def prepare(self, rows: list[dict]) -> None:
        """Measures the call shapes of every row, each model's in one set of
        interleaved rounds (`MeasuredCosts.measure_all`), before any row is priced."""
        shapes: dict[int, tuple] = {}
        for row in rows:
            measured = self._model_of(row)[1]
            shapes.setdefault(id(measured), (measured, []))[1].extend(
                shape for shape, _ in row_counts(row))
        for measured, todo in shapes.values():
            if hasattr(measured, "measure_all"):
                measured.measure_all(todo)

    def row_seconds(self, row: dict) -> tuple[float, float]:
        """(seconds of the row's calls, seconds of its loop overhead)."""
        from asynclane_jax.costs import roofline

        counts = row_counts(row)
        calls = sum(n for _, n in counts)
        measured = self._model_of(row)[1]
        return (roofline.decode_time(measured, measured.cfg, counts),
                calls * self.overhead(row))


def json_key(options: dict) -> str:
    import json

    return json.dumps(options, sort_keys=True)


def add_projections(rows: list[dict], chips: list[tuple[str, str]], project_cfg,
                    measure=None) -> None:
    """Fills each row's `projected` {label: tokens/s} in place.

    Args:
      rows: bench rows with `calls` and `gen_tokens`.
      chips: [(chip, weights)] (`parse_chips`).
      project_cfg: the ModelConfig the accelerators are projected with.
      measure: for `cpu`, a `CpuCosts` (or any object with `row_seconds(row)` ->
        (calls' seconds, overhead seconds); its `prepare(rows)`, when it has one, is
        called first).
    """
    from asynclane_jax.costs import roofline

    if measure is not None and hasattr(measure, "prepare") and any(
            chip == "cpu" for chip, _ in chips):
        measure.prepare(rows)
    for row in rows:
        counts = row_counts(row)
        projected = dict(row.get("projected") or {})
        for chip, weights in chips:
            if chip == "cpu":
                if measure is None:
                    raise UsageError("--project cpu: no measurement of this machine's calls")
                seconds = sum(measure.row_seconds(row))
            else:
                seconds = roofline.decode_time(chip, project_cfg, counts, weights=weights)
            projected[label(chip, weights)] = (row["gen_tokens"] / seconds
                                               if seconds > 0 else None)
        row["projected"] = projected
