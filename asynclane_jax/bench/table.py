"""The table `asynclane-jax bench` prints: one line per row (bench.runner)."""

from __future__ import annotations

import json
import sys

from asynclane_jax.bench.runner import SPEEDUP_FIELDS

TABLE_HEAD = ("gen", "comparison", "sampler", "chosen options", "accuracy", "tokens/s",
              "vs (a)", "vs (b)", "vs (c)", "calls/token", "steps", "decode s", "compile s")


# Printed under a table with projected columns.
PROJECTION_NOTE = ("Columns marked * are projections, not measurements: each row's model "
                   "calls priced as the same calls of {model} on the chip's roofline "
                   "(asynclane_jax.costs); cpu* times this model's calls here.")


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _opts_text(opts: dict) -> str:
    return " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                    for k, v in opts.items())


def table_rows(rows: list[dict], labels: dict | None = None) -> list[tuple[str, ...]]:
    """The cells of the summary table, one tuple per row (TABLE_HEAD).

    Args:
      rows: bench rows.
      labels: comparison value -> its label (bench.compare.COMPARISON_LABELS); a value
        without one is shown as it is, a row without a comparison as `-`.
    """
    labels = labels or {}

    def label(c):
        return "-" if c is None else labels.get(c, str(c))

    chips = projected_chips(rows)
    return [(str(r["gen_length"]), label(r.get("comparison")),
             r["sampler"], _opts_text(r["options"]),
             f"{100 * r['accuracy']:.1f}%", f"{r['tps']:.1f}",
             *(_fmt(r.get(field), ".2f", "x") for field in SPEEDUP_FIELDS),
             _fmt(r["nfe_per_token"], ".3f"), f"{r['steps']:.1f}", f"{r['wall_s']:.2f}",
             f"{r['compile_s']:.1f}",
             *(_fmt((r.get("projected") or {}).get(c), ".1f") for c in chips))
            for r in rows]


def projected_chips(rows: list[dict]) -> list[str]:
    """The projection labels the rows carry, in first-seen order."""
    out: list[str] = []
    for r in rows:
        out.extend(c for c in (r.get("projected") or {}) if c not in out)
    return out


def table_head(rows: list[dict]) -> tuple[str, ...]:
    """TABLE_HEAD, plus a `CHIP tokens/s*` column per projection the rows carry."""
    return TABLE_HEAD + tuple(f"{c} tokens/s*" for c in projected_chips(rows))


def print_table(rows: list[dict], file=None, labels: dict | None = None) -> None:
    """The summary table: drawn with `rich` on a terminal when it is installed, else
    plain aligned text."""
    file = file or sys.stdout
    cells = table_rows(rows, labels)
    head = table_head(rows)
    try:
        if not file.isatty():
            raise ImportError  # plain text for files and pipes
        from rich.console import Console
        from rich.table import Table
    except (ImportError, AttributeError):
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
        for line in (head, *cells):
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip(), file=file)
        return
    table = Table(*head)
    for c in cells:
        table.add_row(*c)
    Console(file=file).print(table)
