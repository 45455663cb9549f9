"""The bench's comparisons: which rows are baselines of which footing, and speed-ups.

The runner (bench.runner) measures; this step classifies its rows and fills the
comparison fields. Every row belongs to one comparison (its `comparison` field, a
column of the table), and the rows of the sampler under study get a speed-up over the
fastest baseline of each:
  (a) `published`: the baselines as published (no early stop, no cascade);
  (b) `early-stop`: the baselines with early_stop=true (no cascade);
  (c) `equal-footing`: the baselines given the mid-block cascade of the sampler under
    study (cascade=true; the default specs add early_stop=true and run each baseline
    at its published threshold and at AsyncLane's, reporting the faster).
Rows of the sampler under study are in the comparison named after it (`asynclane`).

Results files hold rows of options since removed. A row with `renew` > 0 (renewal
calls, an option of AsyncLane and of the dual-cache baselines until they were removed)
keeps its footing: it meets only (c) rows of the same `renew` (`footing`), and a
baseline with renewals but no cascade is `other`, in no comparison. Rows with a
`horizon` option (the visible horizon, removed before) are rendered from their stored
comparison fields.

What a sampler is to these rules, its schedule class declares (decoding/schedule.py):
`under_study` (True for AsyncLane), and `footing_options`, the options it takes among
FOOTING_ROLES, named by role. An option of a role it does not declare is read as off.
A new sampler that declares them is classified without a change here.

Fields filled (bench.runner.COMPARISON_FIELDS):
  comparison: published | early-stop | equal-footing | <sampler under study> | other;
  speedup_vs_fastest_baseline: tps over the highest tps at the same gen_length among
    the (a) published rows (None when there is none);
  speedup_vs_fastest_early_stop: the same over the (b) early-stop rows;
  speedup_vs_fastest_equal_footing: the same over the (c) equal-footing rows with the
    row's footing;
  speedup_family_vs_equal_footing: per family, tps_family over the highest tps_family
    of the (c) rows of the row's footing (None without such rows).
"""

from __future__ import annotations

from asynclane_jax.bench.runner import SPEEDUP_FIELDS
from asynclane_jax.bench.spec import sampler_of, schedule_class

# The footing options by role: early_stop (stop once a finished block holds an
# end-of-text) and cascade (an end-of-text committed ends the row at once).
FOOTING_ROLES = ("early_stop", "cascade")
# The comparisons: the row field's value -> the speed-up field against its fastest row.
COMPARISONS = dict(zip(("published", "early-stop", "equal-footing"), SPEEDUP_FIELDS))
OTHER = "other"
# Labels of the printed table and the report (a row of the sampler under study shows
# its comparison, the sampler's name, as it is).
COMPARISON_LABELS = {"published": "(a) published", "early-stop": "(b) early stop",
                     "equal-footing": "(c) equal footing", OTHER: OTHER}


def _declared(name: str):
    """(footing roles the sampler takes, its class or None). A sampler not registered
    (a results file's) is read from its options alone, every role allowed."""
    cls = schedule_class(name)
    return (FOOTING_ROLES if cls is None else cls.footing_options), cls


def under_study(sampler: str) -> bool:
    """Whether a spec's sampler is the one under study (its class says so)."""
    cls = schedule_class(sampler_of(sampler))
    return cls is not None and cls.under_study


def is_study_row(row: dict) -> bool:
    """A row of the sampler under study (by its comparison field, as written)."""
    c = row.get("comparison")
    return c is not None and c not in COMPARISONS and c != OTHER


def comparison_of(sampler: str, options: dict) -> str:
    """The comparison a row belongs to (module docstring): published, early-stop,
    equal-footing, the name of the sampler under study, or other."""
    name = sampler_of(sampler)
    roles, cls = _declared(name)
    if cls is not None and cls.under_study:
        return name

    def on(role):
        return options.get(role) if role in roles else None

    if on("cascade") is True:
        return "equal-footing"
    if options.get("renew"):  # a results file's row with renewal calls (docstring)
        return OTHER
    return "early-stop" if on("early_stop") is True else "published"


def footing(row: dict) -> int:
    """The footing a (c) row must share to meet a row: its `renew` as written (0 for
    every sampler today; results files hold rows with renewal calls, module
    docstring)."""
    return int(row["options"].get("renew") or 0)


def add_speedups(rows: list[dict]) -> list[dict]:
    """Fills `comparison` and the speed-up fields in place, per gen_length (see the
    module docstring); returns rows."""
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
