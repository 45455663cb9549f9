"""The bench's comparisons (asynclane_jax.bench.compare) and its report: every row in one
of (a) published, (b) early stop, (c) equal footing, the sampler under study or other;
speed-ups over the fastest row of each, (c) at the row's own footing; the rules read
from the schedule classes' declarations, so a new sampler needs no change there; the
table and the markdown; the results files on record still render."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from asynclane_jax.bench import compare, report, runner
from asynclane_jax.bench.compare import add_speedups, comparison_of, footing
from asynclane_jax.bench.spec import EQUAL_FOOTING, default_specs, parse_spec, validate
from asynclane_jax.bench.table import table_rows
from asynclane_jax.decoding import registry
from asynclane_jax.decoding.registry import option_fields, samplers
from asynclane_jax.decoding.schedule import Schedule

# The (c) setting.
ON = dict(cascade=True, early_stop=True)
RESULTS = pathlib.Path(__file__).parents[2] / "experiments" / "results"


def test_speedups():
    def row(sampler, tps, **opts):
        return {"sampler": sampler, "tps": tps, "gen_length": 128, "options": opts}

    rows = add_speedups([row("vanilla", 10.0), row("fast-dllm", 40.0),
                               row("fast-dllm:early_stop=true", 50.0, early_stop=True),
                               row("asynclane", 100.0)])
    assert [r["speedup_vs_fastest_baseline"] for r in rows] == [0.25, 1.0, 1.25, 2.5]
    assert [r["speedup_vs_fastest_early_stop"] for r in rows] == [0.2, 0.8, 1.0, 2.0]
    lone = add_speedups([row("vanilla", 10.0)])[0]
    assert lone["speedup_vs_fastest_baseline"] == 1.0
    assert lone["speedup_vs_fastest_early_stop"] is None


def test_every_row_is_in_one_comparison_and_speedups_are_per_comparison():
    def row(sampler, tps, **opts):
        return {"sampler": sampler, "tps": tps, "gen_length": 512, "options": opts}

    rows = add_speedups([
        row("fast-dllm", 100.0, cache="dual"),
        row("localleap:early_stop=true", 500.0, early_stop=True, cache="dual"),
        row(f"localleap:{EQUAL_FOOTING}", 2000.0, cache="dual", cascade=True,
            early_stop=True),
        # Rows of a results file written while renewal calls were an option (renew).
        row(f"fast-dllm:{EQUAL_FOOTING}:cache=dual:renew=256", 2400.0, cache="dual",
            cascade=True, early_stop=True, renew=256),
        row("fast-dllm:renew=256", 700.0, cache="dual", renew=256),
        row("asynclane:renew=0", 1800.0, renew=0),
        row("asynclane:renew=256", 3000.0, renew=256)])
    assert [r["comparison"] for r in rows] == [
        "published", "early-stop", "equal-footing", "equal-footing", "other",
        "asynclane", "asynclane"]
    lane, renewing = rows[-2:]
    assert lane["speedup_vs_fastest_baseline"] == pytest.approx(18.0)
    assert lane["speedup_vs_fastest_early_stop"] == pytest.approx(3.6)
    # (c) of the row's own footing, as written: no renewals (2000 tokens/s), or
    # renewals of 256 (2400).
    assert lane["speedup_vs_fastest_equal_footing"] == pytest.approx(0.9)
    assert renewing["speedup_vs_fastest_equal_footing"] == pytest.approx(1.25)
    assert footing(renewing) == 256 and footing(lane) == 0
    # Today's rows: no renewals.
    assert footing(row("asynclane", 1.0)) == 0
    assert {"comparison", *compare.COMPARISONS.values()} <= set(runner.ROW_KEYS)
    # The defaults hold all three comparisons, and they build at the bench's lengths.
    specs = default_specs()
    assert {comparison_of(s, parse_spec(s)[1][0]) for s in specs} == {
        "published", "early-stop", "equal-footing", "asynclane"}
    validate(specs, [128, 256, 512])


def test_per_family_speedups_meet_the_fastest_equal_footing_row_of_each_family():
    def row(sampler, fams, **opts):
        return {"sampler": sampler, "tps": sum(fams.values()), "gen_length": 512,
                "options": opts, "tps_family": fams}

    eq = dict(cache="dual", cascade=True, early_stop=True)
    rows = add_speedups([
        row("fast-dllm", {"math": 50.0, "walk": 10.0}, cache="dual"),
        row(f"fast-dllm:{EQUAL_FOOTING}", {"math": 400.0, "walk": 100.0}, **eq),
        row(f"localleap:{EQUAL_FOOTING}", {"math": 300.0, "walk": 200.0}, **eq),
        row(f"fast-dllm:{EQUAL_FOOTING}:cache=dual:renew=256", {"math": 900.0, "walk": 900.0},
            renew=256, **eq),
        row("asynclane:renew=0", {"math": 400.0, "walk": 260.0}, renew=0)])
    # Each family against its own fastest (c) row, of the row's footing (no renewals
    # here): the walk figure meets LocalLeap (200), the math figure Fast-dLLM (400); the
    # renewing row of a results file (900) is another footing's rival and is not met.
    assert rows[-1]["speedup_family_vs_equal_footing"] == {
        "math": pytest.approx(1.0), "walk": pytest.approx(1.3)}
    assert rows[2]["speedup_family_vs_equal_footing"]["walk"] == pytest.approx(1.0)
    md = "\n".join(report.breakdown_markdown([dict(
        r, n=2, accuracy_family={f: {"n": 1, "accuracy": 1.0} for f in r["tps_family"]},
        accuracy_length={}) for r in rows]))
    assert "walk tok/s" in md and "260 (1.30x)" in md and "400 (1.00x)" in md
    # Without (c) rows there is nothing to meet.
    lone = add_speedups([row("asynclane", {"math": 1.0})])[0]
    assert lone["speedup_family_vs_equal_footing"] is None


def test_the_table_names_the_comparison_and_the_command():
    r = {"model": "m", "sampler": f"localleap:{EQUAL_FOOTING}", "gen_length": 256,
         "n": 2, "batch": 1, "options": dict(ON, cache="dual"), "accuracy": 0.5,
         "tps": 10.0, "nfe_per_token": 0.2, "tokens_per_call": 5.0, "steps": 4.0,
         "wall_s": 1.0, "compile_s": 1.0}
    add_speedups([r])
    cells = table_rows([r], compare.COMPARISON_LABELS)[0]
    assert cells[1] == "(c) equal footing" and cells[6:9] == ("-", "-", "1.00x")
    md = report.to_markdown([r], {"model": "m", "n": 2, "batch": 1,
                                 "command": "python experiments/bench_samplers.py --n 2"})
    assert "python experiments/bench_samplers.py --n 2" in md and "(c) equal footing" in md


# ------------------------------------------------------------ the rules read the samplers

def test_every_sampler_declares_footing_options_it_takes():
    found = samplers()
    for name, cls in found.items():
        assert set(cls.footing_options) <= set(compare.FOOTING_ROLES), name
        assert set(cls.footing_options) <= set(option_fields(cls)), name
    assert [n for n, c in found.items() if c.under_study] == ["asynclane"]
    # The fixed-step samplers have no cache: early stop and cascade only.
    assert found["vanilla"].footing_options == ("early_stop", "cascade")


@dataclasses.dataclass(frozen=True)
class _Rival(Schedule):
    """A baseline with both footing options (not registered: no `name`)."""

    footing_options = ("early_stop", "cascade")
    early_stop: bool = False
    cascade: bool = False


@dataclasses.dataclass(frozen=True)
class _Quiet(Schedule):
    """Has a `cascade` option but declares no footing: compared as published."""

    cascade: bool = False


@dataclasses.dataclass(frozen=True)
class _Study(Schedule):
    """Another sampler under study."""

    under_study = True


def test_a_new_sampler_is_classified_from_its_declarations(monkeypatch):
    real = registry.samplers
    monkeypatch.setattr(registry, "samplers",
                        lambda: {**real(), "rival": _Rival, "quiet": _Quiet, "study": _Study})

    def row(sampler, tps, **opts):
        return {"sampler": sampler, "tps": tps, "gen_length": 256, "options": opts}

    rows = add_speedups([
        row("rival", 100.0),
        row("rival:early_stop=true", 200.0, early_stop=True),
        row("rival:cascade=true", 400.0, cascade=True),
        row("rival:cascade=true:threshold=0.5", 500.0, cascade=True),
        row("quiet:cascade=true", 300.0, cascade=True),
        row("study", 1000.0)])
    assert [r["comparison"] for r in rows] == [
        "published", "early-stop", "equal-footing", "equal-footing", "published", "study"]
    study = rows[-1]
    assert study["speedup_vs_fastest_baseline"] == pytest.approx(1000 / 300)  # quiet's
    assert study["speedup_vs_fastest_early_stop"] == pytest.approx(5.0)
    assert study["speedup_vs_fastest_equal_footing"] == pytest.approx(2.0)
    # The table shows the study's comparison by its name.
    assert table_rows([dict(study, accuracy=1.0, nfe_per_token=None, steps=1.0,
                            wall_s=1.0, compile_s=0.0)], compare.COMPARISON_LABELS)[0][1] == "study"
    assert compare.is_study_row(study) and not compare.is_study_row(rows[2])


def test_without_a_comparison_step_the_table_shows_dashes():
    r = {"sampler": "vanilla", "gen_length": 64, "options": {}, "accuracy": 0.5, "tps": 1.0,
         "nfe_per_token": 1.0, "steps": 2.0, "wall_s": 1.0, "compile_s": 0.0,
         **dict.fromkeys(runner.COMPARISON_FIELDS)}
    cells = table_rows([r])[0]
    assert cells[1] == "-" and cells[6:9] == ("-", "-", "-")


def test_the_results_on_record_render():
    # Every bench results file renders from its stored fields (older files lack some:
    # no comparison, no breakdowns), one table line per row.
    files = [p for p in sorted(RESULTS.rglob("bench*.json"))
             if "rows" in json.loads(p.read_text())]
    if not files:
        pytest.skip("no bench results under experiments/results")
    for path in files:
        data = json.loads(path.read_text())
        md = report.to_markdown(data["rows"], data["meta"])
        table = md.partition("Per family")[0]
        assert table.count("\n| ") == len(data["rows"]) + 1, path
        assert "| None |" not in table, path
