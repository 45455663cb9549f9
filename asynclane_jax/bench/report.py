"""The bench's report: the markdown of a results file and the plot.

`to_markdown` renders a bench JSON's rows and meta (experiments/bench_samplers.py
writes it beside the JSON; any earlier results file renders the same way, from its
stored fields); `plot_rows` draws tokens/s and accuracy against gen_length
(`asynclane-jax bench --plot`, matplotlib). Both read the comparison fields that
bench.compare fills.
"""

from __future__ import annotations

from asynclane_jax.bench.compare import COMPARISON_LABELS, COMPARISONS, is_study_row
from asynclane_jax.bench.table import PROJECTION_NOTE, table_head, table_rows


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
              "- (a) published: the baselines as published (no early stop, no cascade). "
              "They decode every position of the canvas.",
              "- (b) early stop: the same with early_stop=true; they still attend to the "
              "whole canvas.",
              "- (c) equal footing: block baselines given AsyncLane's mid-block cascade "
              "(cascade=true; the default specs add early_stop=true and run each baseline "
              "at its published threshold, 0.9, and at AsyncLane's, 0.95, keeping the "
              "faster: `chosen options` names it).",
              "- asynclane rows are compared with each; `other` rows with none.", ""]
    if meta.get("project_model"):
        lines += [PROJECTION_NOTE.format(model=meta["project_model"]), ""]
    head = table_head(rows)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_md_row(cells) for cells in table_rows(rows, COMPARISON_LABELS)]
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
                if is_study_row(r) and spd.get(f) is not None:
                    cell += f" ({spd[f]:.2f}x)"
                cells.append(cell)
            out.append(_md_row(cells))
    return out


def _md_row(cells) -> str:
    """One markdown table row; a `|` inside a cell (a spec's alternatives) escaped."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def plot_rows(rows: list[dict], path, meta: dict | None = None):
    """Two panels against gen_length, one line per sampler spec: tokens/s (log scale) and
    accuracy. Saved as PNG (Agg); returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_tps, ax_acc = fig.subplots(1, 2)
    markers = "osD^v<>ph*"
    # Line style by comparison: (a) solid, (b) dashed, (c) dotted; the sampler under
    # study thick.
    lines = {"published": "-", "early-stop": "--", "equal-footing": ":"}
    for k, spec in enumerate(dict.fromkeys(r["sampler"] for r in rows)):
        sel = sorted((r for r in rows if r["sampler"] == spec), key=lambda r: r["gen_length"])
        x = [r["gen_length"] for r in sel]
        which = sel[0].get("comparison")
        label = f"{COMPARISON_LABELS[which][:3]} {spec}" if which in COMPARISONS else spec
        style = dict(marker=markers[k % len(markers)], label=label,
                     linestyle=lines.get(which, "-"),
                     linewidth=2.5 if is_study_row(sel[0]) else 1.5)
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
