"""Plot multi-turn runs: greedy val/success per seed, and the sampled success at turn 1 against after feedback.

    python scripts/plot_multiturn.py docs/multiturn_seeds.png runs/multiturn_seed0 runs/multiturn_seed1 ...

Prints, per run, val/success, val/success_turn{k} and val/success_after_feedback at the first and last
validation, and the sampled train/success_turn{k} and train/success_after_feedback averaged over windows
of 50 RL steps. success_after_feedback (of the episodes that got feedback, the share solved later) is read
from the log, or for runs logged before it existed derived exactly as (success − success_turn1) / reached_turn2
(reached_turn2 = 1 − success_turn1 for validation, which does not log it: no token budget binds there).
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from lit_gspo.runtime.extras import pyplot

plt = pyplot("Plotting")


def read(run: Path) -> list[dict]:
    with open(sorted(run.rglob("metrics.csv"))[-1]) as f:
        return list(csv.DictReader(f))


def value(row: dict, key: str) -> float | None:
    """``row[key]``, with ``<prefix>/success_after_feedback`` derived when it was not logged."""
    if row.get(key):
        return float(row[key])
    prefix, name = key.split("/", 1)
    if name != "success_after_feedback" or not row.get(f"{prefix}/success"):
        return None
    first = float(row[f"{prefix}/success_turn1"])
    # validation logs no reached_turn2: every unsolved first reply gets feedback there (no token budget binds)
    reached = float(row.get(f"{prefix}/reached_turn2") or 1 - first)
    return (float(row[f"{prefix}/success"]) - first) / reached if reached > 0 else None


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), v) for r in rows if (v := value(r, key)) is not None]


def window_means(points: list[tuple[int, float]], width: int = 50) -> list[tuple[int, float]]:
    out = []
    for start in range(0, max((s for s, _ in points), default=0) + 1, width):
        values = [v for s, v in points if start <= s < start + width and not math.isnan(v)]
        if values:
            out.append((start + width // 2, sum(values) / len(values)))
    return out


def main(out: str, *runs: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, run in enumerate(map(Path, runs)):
        color = f"C{i}"  # one color per run in both panels
        rows = read(run)
        val = series(rows, "val/success")
        left.plot(*zip(*val), marker="o", color=color, label=run.name)
        first, last = (
            rows[[i for i, r in enumerate(rows) if r.get("val/success")][0]],
            [r for r in rows if r.get("val/success")][-1],
        )
        keys = [
            "val/success",
            "val/success_turn1",
            "val/success_turn2",
            "val/success_turn3",
            "val/success_after_feedback",
            "val/turns",
        ]
        rounded = lambda row: {k[4:]: None if (v := value(row, k)) is None else round(v, 3) for k in keys}  # noqa: E731
        print(run.name, "first:", rounded(first), "last:", rounded(last))
        for key, style in (("success_turn1", "-"), ("success_after_feedback", "--")):
            windows = window_means(series(rows, f"train/{key}"))
            if windows:
                right.plot(*zip(*windows), style, color=color, label=f"{run.name} {key.replace('success_', '')}")
            print(f"  train/{key} per 50 steps:", [round(v, 2) for _, v in windows])
        for k in (2, 3):
            print(
                f"  train/success_turn{k} per 50 steps:",
                [round(v, 2) for _, v in window_means(series(rows, f"train/success_turn{k}"))],
            )
    left.set(xlabel="RL step", ylabel="val/success (greedy, by the last turn)", ylim=(-0.02, 1.02))
    right.set(xlabel="RL step", ylabel="sampled success: turn 1 (—), after feedback (--)", ylim=(-0.02, 1.02))
    left.legend(fontsize=7)
    right.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
