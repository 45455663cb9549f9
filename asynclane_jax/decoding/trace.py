"""The decode-order picture: which generated position was committed at which iteration.

  res = asynclane_jax.generate(model, prompts, sampler="fast-dllm", gen_length=128)
  save_decode_order(res, "order.png", tokenizer=tokenizer)

Main panel: x is the generated position, y the row iteration that committed it
(`stats.commit_step`), colour that same iteration, so positions committed together show
as horizontal runs. A strip above repeats the positions coloured by commit step (with
the token text on it when a tokenizer is given and the row is short enough). AsyncLane
results (stats with lane fields, `asynclane_jax.decoding.lanes.LaneStats`) get their lane
tree drawn over it: each lane a rectangle from (start, birth) to (end, death), styled by
kind, its fork point marked. Block samplers get their block boundaries.

When everything after the first end-of-text is end-of-text, the x axis stops a few
positions after it, or after the last lane's start when that is later (the title says
so). matplotlib is needed (the `plots` extra); it is
imported on first use, and the figure is drawn with the Agg backend (no display).
"""

from __future__ import annotations

import numpy as np

# Lane kinds drawn, by LANE_KINDS name: (edge colour, line style).
LANE_STYLES = {"generate": ("tab:blue", "-"), "refine": ("tab:orange", "--"),
               "done": ("tab:green", "-"), "terminated": ("tab:red", ":")}
# Token text is written on the strip for rows of at most this many shown positions.
MAX_LABELS = 96


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("the decode-order picture needs matplotlib: pip install "
                          "'asynclane-jax[plots]'") from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return Figure, FigureCanvasAgg


def shown_length(tokens, generated: int, stop_ids, margin: int | None = None) -> int:
    """How many positions the picture shows: all of them, unless every position from the
    first end-of-text on is an end-of-text token; then the first end-of-text plus
    `margin` (default max(4, G // 16)) positions.

    Args:
      tokens: [G] the row's generated tokens.
      generated: tokens before the first end-of-text (`stats.generated_tokens[row]`).
      stop_ids: the end-of-text token ids.
    """
    G = len(tokens)
    margin = max(4, G // 16) if margin is None else margin
    if generated >= G:
        return G
    tail = np.asarray(tokens[generated:])
    if not np.all(np.isin(tail, np.asarray(list(stop_ids)))):
        return G
    return min(G, generated + margin)


def _token_label(tokenizer, token: int) -> str:
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        text = tokenizer.convert_ids_to_tokens(int(token))
    else:
        text = tokenizer.decode([int(token)])
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= 8 else text[:7] + "~"


def plot_decode_order(result, path=None, row: int = 0, tokenizer=None, title=None, *,
                      stop_ids=None, margin: int | None = None):
    """Draws the decode order of one row of a `generate` result.

    Args:
      result: a GenerationResult.
      path: when given, the figure is saved there (PNG, dpi 150).
      row: the batch row drawn.
      tokenizer: optional; writes the token text on the strip (rows of at most
        MAX_LABELS shown positions) and supplies the end-of-text ids (its special
        tokens) when stop_ids is not given.
      title: the title's first line (default: sampler, row, steps and model calls).
      stop_ids: the end-of-text token ids (e.g. `model.cfg.stop_token_ids`); default the
        tokenizer's special tokens, else the token at the first end-of-text.
      margin: positions shown after the first end-of-text when the rest is cut
        (`shown_length`), and after the last lane's start.
    Returns:
      The matplotlib Figure, with three attributes added:
        lane_patches: the lane rectangles drawn (one per non-free lane; [] without lanes);
        block_boundaries: the generated positions at which a block starts and a
          boundary line was drawn ([] for samplers without blocks, or with lanes);
        shown_positions: how many generated positions the x axis shows.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    stats = result.stats
    tokens = np.asarray(result.tokens)[row]
    commit = np.asarray(stats.commit_step)[row]
    G = len(commit)
    generated = int(stats.generated_tokens[row])
    if stop_ids is None:
        if tokenizer is not None and getattr(tokenizer, "all_special_ids", None):
            stop_ids = tokenizer.all_special_ids
        else:
            stop_ids = [int(tokens[generated])] if generated < G else []
    shown = shown_length(tokens, generated, stop_ids, margin)
    lanes = stats.lane_tree(row) if getattr(stats, "lane_kind", None) is not None else None
    if lanes and shown < G:  # every lane's fork point stays in view
        shown = max(shown, min(G, max(lane["start"] for lane in lanes)
                               + (max(4, G // 16) if margin is None else margin)))
    last_step = max(int(np.asarray(stats.row_steps)[row]) - 1, int(commit.max()), 0)

    labels = tokenizer is not None and shown <= MAX_LABELS
    fig = Figure(figsize=(min(20.0, max(8.0, 3.0 + 0.14 * shown)), 6.5 if labels else 5.5),
                 layout="constrained")
    FigureCanvasAgg(fig)
    ax_strip, ax = fig.subplots(2, 1, sharex=True,
                                gridspec_kw={"height_ratios": [1.6 if labels else 0.6, 6]})
    cmap, norm = "viridis", Normalize(0, max(last_step, 1))

    # The strip: positions coloured by commit step (white: never committed).
    strip = np.ma.masked_less(commit[None, :shown].astype(float), 0)
    ax_strip.imshow(strip, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest",
                    extent=(-0.5, shown - 0.5, 0, 1))
    ax_strip.set_yticks([])
    ax_strip.tick_params(labelbottom=False)
    if labels:
        for j in range(shown):
            shade = norm(commit[j]) if commit[j] >= 0 else 1.0
            ax_strip.text(j, 0.5, _token_label(tokenizer, tokens[j]), rotation=90,
                          ha="center", va="center", fontsize=6, family="monospace",
                          color="white" if shade < 0.6 else "black")

    # The main panel: one marker per committed position.
    pos = np.flatnonzero(commit[:shown] >= 0)
    size = max(6.0, min(40.0, 2400.0 / max(shown, 1)))
    sc = ax.scatter(pos, commit[pos], c=commit[pos], cmap=cmap, norm=norm, s=size, marker="s",
                    linewidths=0, zorder=3)
    fig.colorbar(sc, ax=[ax_strip, ax], label="commit step", pad=0.01)
    ax.set_xlim(-0.5, shown - 0.5)
    ax.set_ylim(-0.5, last_step + 0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generated position")
    ax.set_ylabel("row iteration (commit step)")
    ax.grid(True, alpha=0.25, zorder=0)

    lane_patches: list = []
    boundaries: list[int] = []
    if lanes is not None:
        handles = {}
        forks = 0
        for lane in lanes:
            color, style = LANE_STYLES.get(lane["kind"], ("black", "-"))
            top = lane["death"] if lane["death"] >= 0 else last_step
            rect = Rectangle((lane["start"] - 0.5, lane["birth"] - 0.5),
                             lane["end"] - lane["start"], top - lane["birth"] + 1,
                             fill=False, edgecolor=color, linestyle=style, linewidth=1.6,
                             zorder=4)
            ax.add_patch(rect)
            lane_patches.append(rect)
            handles.setdefault(lane["kind"], Line2D([], [], color=color, linestyle=style,
                                                    linewidth=1.6, label=f"{lane['kind']} lane"))
            if lane.get("split", -1) >= 0:  # the lane forked: a refine lane from here on
                ax.plot([lane["start"] - 0.5, lane["end"] - 0.5],
                        [lane["split"] + 0.5] * 2, color=LANE_STYLES["refine"][0],
                        linestyle=LANE_STYLES["refine"][1], linewidth=1.6, zorder=4)
                handles.setdefault("refine", Line2D(
                    [], [], color=LANE_STYLES["refine"][0], linestyle=LANE_STYLES["refine"][1],
                    linewidth=1.6, label="refine from here (after its fork)"))
            if lane["parent"] >= 0:
                ax.plot(lane["start"], lane["birth"], marker="D", markersize=6,
                        color=color, markeredgecolor="black", zorder=5)
                forks += 1
        legend = list(handles.values())
        if forks:
            legend.append(Line2D([], [], marker="D", color="gray", markeredgecolor="black",
                                 linestyle="none", label="fork point"))
        if legend:
            ax.legend(handles=legend, loc="best", fontsize=8, framealpha=0.85)
    else:
        B = (stats.options or {}).get("block_length")
        if B and 0 < B < G:
            for k, s in enumerate(range(0, shown, B)):
                if k % 2:
                    for a in (ax, ax_strip):
                        a.axvspan(s - 0.5, min(s + B, shown) - 0.5, color="0.93", zorder=0)
                if s > 0:
                    boundaries.append(s)
                    for a in (ax, ax_strip):
                        a.axvline(s - 0.5, color="0.35", linewidth=1.0, linestyle="--",
                                  zorder=2)

    steps = int(np.asarray(stats.row_steps)[row])
    calls = int(np.asarray(stats.row_nfe_full)[row] + np.asarray(stats.row_nfe_partial)[row])
    head = title or (f"{stats.sampler}: decode order of row {row} ({generated} tokens before "
                     f"end-of-text, {steps} iterations, {calls} model calls)")
    if shown < G:
        head += f"\npositions {shown}..{G - 1} are end-of-text and not shown"
    fig.suptitle(head, fontsize=10)
    fig.lane_patches = lane_patches
    fig.block_boundaries = boundaries
    fig.shown_positions = shown
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig


def save_decode_order(result, path, row: int = 0, tokenizer=None, title=None, **kwargs):
    """Draws the decode order (`plot_decode_order`) and saves it as PNG at path; returns
    the Figure."""
    return plot_decode_order(result, path=path, row=row, tokenizer=tokenizer, title=title,
                             **kwargs)
