"""Plot val/reward and train/reward of one or more runs and print their first/last validation.

    python scripts/plot_runs.py docs/quickstart_curve.png runs/quickstart_seed0 runs/quickstart_seed1 ...

In metrics.csv, ``val/reward`` at step N is measured after N RL steps (step 0: before any update);
``train/reward`` at step N is the mean reward of the completions sampled for RL step N + 1.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from lit_gspo.runtime.extras import pyplot

plt = pyplot("Plotting")


def read_run(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    path = sorted(run_dir.rglob("metrics.csv"))[-1]
    val, train = [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("val/reward"):
                val.append((int(row["step"]), float(row["val/reward"])))
            if row.get("train/reward"):
                train.append((int(row["step"]) + 1, float(row["train/reward"])))
    return sorted(val), sorted(train)


def smooth(points: list[tuple[int, float]], window: int = 10) -> list[tuple[int, float]]:
    out = []
    for i in range(len(points)):
        chunk = points[max(0, i - window + 1) : i + 1]
        out.append((points[i][0], sum(v for _, v in chunk) / len(chunk)))
    return out


def main(out: str, *run_dirs: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=90)
    print("| run | val/reward at step 0 | last val/reward (step) | gain |\n|---|---|---|---|")
    for i, run in enumerate(run_dirs):
        val, train = read_run(Path(run))
        name = Path(run).name
        ax.plot(*zip(*val), "o-", ms=3, color=f"C{i}", label=f"{name} val (greedy)")
        if train:
            ax.plot(*zip(*smooth(train)), color=f"C{i}", alpha=0.35, lw=1)
        (_, v0), (s1, v1) = val[0], val[-1]
        print(f"| {name} | {v0:.3f} | {v1:.3f} ({s1}) | {v1 - v0:+.3f} |")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("val/reward (dots) and sampled train/reward (faint, smoothed)", fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
