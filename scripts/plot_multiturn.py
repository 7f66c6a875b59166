"""Plot multi-turn runs: greedy val/success per seed, and the sampled success rate at each turn index.

    python scripts/plot_multiturn.py docs/multiturn_seeds.png runs/multiturn_seed0 runs/multiturn_seed1 ...

Prints, per run, val/success and val/success_turn{k} at the first and last validation, and the
sampled train/success_turn{k} averaged over windows of 50 RL steps.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from lit_gspo.extras import require

require("matplotlib", "Plotting").use("Agg")
plt = require("matplotlib.pyplot", "Plotting")


def read(run: Path) -> list[dict]:
    with open(sorted(run.rglob("metrics.csv"))[-1]) as f:
        return list(csv.DictReader(f))


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def window_means(points: list[tuple[int, float]], width: int = 50) -> list[tuple[int, float]]:
    out = []
    for start in range(0, max((s for s, _ in points), default=0) + 1, width):
        values = [v for s, v in points if start <= s < start + width and not math.isnan(v)]
        if values:
            out.append((start + width // 2, sum(values) / len(values)))
    return out


def main(out: str, *runs: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in map(Path, runs):
        rows = read(run)
        val = series(rows, "val/success")
        left.plot(*zip(*val), marker="o", label=run.name)
        first, last = rows[[i for i, r in enumerate(rows) if r.get("val/success")][0]], [r for r in rows if r.get("val/success")][-1]
        keys = ["val/success", "val/success_turn1", "val/success_turn2", "val/success_turn3", "val/turns"]
        print(run.name, "first:", {k[4:]: first.get(k) and round(float(first[k]), 3) for k in keys},
              "last:", {k[4:]: last.get(k) and round(float(last[k]), 3) for k in keys})
        for k, style in ((1, "-"), (2, "--"), (3, ":")):
            windows = window_means(series(rows, f"train/success_turn{k}"))
            if windows:
                right.plot(*zip(*windows), style, label=f"{run.name} turn {k}")
            print(f"  train/success_turn{k} per 50 steps:", [round(v, 2) for _, v in windows])
    left.set(xlabel="RL step", ylabel="val/success (greedy, by the last turn)", ylim=(-0.02, 1.02))
    right.set(xlabel="RL step", ylabel="train/success_turn{k} (sampled, of episodes reaching turn k)", ylim=(-0.02, 1.02))
    left.legend(fontsize=7)
    right.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
