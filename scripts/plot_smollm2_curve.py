"""Plot val/reward (greedy accuracy on the held-out prompts) and train/reward against updates from a run's metrics.csv.

python scripts/plot_smollm2_curve.py runs/smollm2_gspo_bf16 docs/smollm2_gspo_arithmetic.png [updates_per_step=2]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from lit_gspo.runtime.extras import pyplot

plt = pyplot("Plotting")


def main(
    run_dir: str, out: str, updates_per_step: str = "2", title: str = "SmolLM2-135M-Instruct, GSPO, two-digit + and −"
) -> None:
    """The CSV ``step`` counts RL steps (rollouts); each is ``updates_per_step`` optimiser steps."""
    k = int(updates_per_step)
    path = sorted(Path(run_dir).rglob("metrics.csv"))[-1]
    val, train = [], []
    rows = list(csv.DictReader(open(path)))
    last = max(int(r["step"]) for r in rows if r.get("train/reward"))
    for row in rows:
        step = int(row["step"])
        if row.get("val/reward"):  # logged at step = RL steps done (0: before any update)
            updates = min(k * step, k * (last + 1))
            val.append((updates, 100 * float(row["val/reward"])))
        if row.get("train/reward"):  # sampled at the start of RL step `step`
            train.append((k * step, 100 * float(row["train/reward"])))
    fig, ax = plt.subplots(figsize=(5.5, 3.2), dpi=90)
    if train:
        ax.plot(*zip(*train), color="0.7", lw=1, label="train reward (sampled)")
    ax.plot(*zip(*val), "o-", color="C0", label="val accuracy (greedy, held-out prompts)")
    ax.set_xlabel("update (optimiser step)")
    ax.set_ylabel("% correct (last number)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    print(f"{path}: val {val}")


if __name__ == "__main__":
    main(*sys.argv[1:])
