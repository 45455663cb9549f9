"""Training curves of testbed runs side by side, at equal steps.

  git show 9469dfa:experiments/results/testbed_tiny-llada.json > /tmp/llada-old.json
  python experiments/compare_runs.py --out curriculum \\
      "tiny-llada, no curriculum=/tmp/llada-old.json" \\
      "tiny-llada, curriculum=experiments/results/testbed_tiny-llada.json"

Each argument is LABEL=PATH to a training log (Trainer.log_dict(), as written by
train_testbed.py). Writes experiments/results/runs_<out>.{md,png}: the masked-token
cross-entropy and accuracy averaged over windows of steps, and the monitored held-out
accuracy. Cross-entropy is comparable between runs only where both draw t from the same
range (the "t_max" column: a curriculum masks fewer tokens early, which is easier).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


def windows(history: list[dict], every: int) -> list[dict]:
    out = []
    for start in range(0, len(history) - every + 1, every):
        w = history[start:start + every]
        out.append({"step": w[-1]["step"], "ce": float(np.mean([h["ce"] for h in w])),
                    "acc": float(np.mean([h["acc"] for h in w])),
                    "t_max": w[-1].get("t_max", 1.0)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=PATH of a training log JSON")
    ap.add_argument("--out", required=True, help="results/runs_<out>.{md,png}")
    ap.add_argument("--every", type=int, default=500, help="steps per window")
    args = ap.parse_args(argv)

    runs = []
    for spec in args.runs:
        label, sep, path = spec.rpartition("=")
        if not sep or not label:
            ap.error(f"{spec!r}: expected LABEL=PATH")
        log = json.loads(pathlib.Path(path).read_text())
        runs.append((label, log, windows(log["history"], args.every)))

    md = [f"# Training runs compared: {args.out}", "",
          f"Masked-token cross-entropy / accuracy, mean over windows of {args.every} steps "
          "(t_max: the curriculum's largest mask ratio at the window's end; values are "
          "comparable only where both runs are at t_max = 1).", ""]
    n = max(len(w) for _, _, w in runs)
    md.append("| step | " + " | ".join(label for label, _, _ in runs) + " |")
    md.append("|---|" + "---|" * len(runs))
    for i in range(n):
        cells = []
        for _, _, w in runs:
            cells.append(f"{w[i]['ce']:.3f} / {w[i]['acc']:.3f} (t_max {w[i]['t_max']:.2f})"
                         if i < len(w) else "")
        step = next(w[i]["step"] for _, _, w in runs if i < len(w))
        md.append(f"| {step} | " + " | ".join(cells) + " |")
    md += ["", "Monitored held-out accuracy (vanilla, gen length 64, 32 problems): "
           "step: exact answer / lines exact.", ""]
    for label, log, _ in runs:
        mon = ", ".join(f"{e['step']}: {100 * e['acc']:.0f}% / {100 * e['line_acc']:.0f}%"
                        for e in log.get("evals", []))
        md.append(f"- {label} ({log['step']:,} steps, {log['elapsed_s'] / 60:.0f} min): {mon}")
    md.append("")
    RESULTS.mkdir(parents=True, exist_ok=True)
    md_path = RESULTS / f"runs_{args.out}.md"
    md_path.write_text("\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asynclane_jax.testbed.train import smoothed

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, log, _ in runs:
        h = log["history"]
        ax[0].plot([x["step"] for x in h], smoothed([x["ce"] for x in h], 100), label=label)
        ev = log.get("evals", [])
        ax[1].plot([e["step"] for e in ev], [e["acc"] for e in ev], "o-", label=label)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_title("masked-token cross-entropy (smoothed)")
    ax[0].legend(fontsize=8)
    ax[1].set_ylim(0, 1)
    ax[1].set_xlabel("step")
    ax[1].set_title("held-out monitor: exact answer")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"runs_{args.out}.png", dpi=110)
    plt.close(fig)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
