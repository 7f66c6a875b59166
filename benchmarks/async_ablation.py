"""The per-step timing and off-policy table of the staleness ablation (configs/ablate/async_staleness.yaml), from the
runs' metrics on disk, paired by seed against the synchronous arm (issue 38; docs/async.md).

    lit-gspo ablate --config configs/ablate/async_staleness.yaml          # the 16 fits (runs/ablate/async_staleness)
    python benchmarks/async_ablation.py runs/ablate/async_staleness       # this table

Per RL step: ``step_s`` = the time the trainer spent on the step's rollout and update — ``time/rollout_s`` +
``time/update_s`` synchronously, ``time/rollout_wait_s`` + ``time/update_s`` with a worker (the rollout it waited
for, not the one it did not) — median over steps 2..N (step 1 primes the worker). ``Δ val`` is the arm's final
val/reward minus the synchronous arm's of the same seed. clip fraction, gradient norm and ``mismatch/k3`` are means
over the run's steps.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path


def read_run(run_dir: Path) -> list[dict]:
    rows = []
    for f in sorted(run_dir.glob("**/metrics.csv")):
        with open(f) as fh:
            rows += list(csv.DictReader(fh))
    return rows


def values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.fmean(xs) if xs else float("nan")


def summarise(rows: list[dict]) -> dict:
    steps = [r for r in rows if r.get("time/update_s")]
    waited = "time/rollout_wait_s" in steps[0] and steps[0]["time/rollout_wait_s"] not in ("", None)
    rollout_key = "time/rollout_wait_s" if waited else "time/rollout_s"
    step_s = [float(r[rollout_key]) + float(r["time/update_s"]) for r in steps][1:]
    val = values(rows, "val/reward")
    return {
        "step_s": statistics.median(step_s) if step_s else float("nan"),
        "rollout_s": statistics.median(values(rows, "time/rollout_s")[1:] or [float("nan")]),
        "update_s": statistics.median(values(rows, "time/update_s")[1:] or [float("nan")]),
        "val_first": val[0] if val else float("nan"),
        "val_last": val[-1] if val else float("nan"),
        "train_reward": mean(values(rows, "train/reward")),
        "clip_frac": mean(values(rows, "train/clip_frac")),
        "grad_norm": mean(values(rows, "train/grad_norm")),
        "k3": mean(values(rows, "train/mismatch/k3")),
        "staleness": mean(values(rows, "train/staleness")) if waited else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, help="the ablation's output_dir (<arm>/seed<S>/ under it)")
    parser.add_argument("--baseline", default="GSPO K=0", help="the arm the others are paired against")
    args = parser.parse_args()
    arms = sorted(p.name for p in args.runs.iterdir() if p.is_dir())
    runs = {
        arm: {int(s.name[4:]): summarise(read_run(s)) for s in sorted((args.runs / arm).glob("seed*")) if read_run(s)}
        for arm in arms
    }
    base = runs.get(args.baseline, {})
    print(
        "| arm | seeds | step_s (median of seeds) | vs sync (paired) | rollout_s | update_s | staleness | "
        "val/reward first → last | Δ val vs sync (paired) | train/reward | clip_frac | grad_norm | k3 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in [args.baseline] + [a for a in arms if a != args.baseline]:
        if arm not in runs or not runs[arm]:
            continue
        by_seed = runs[arm]
        paired = [s for s in by_seed if s in base]
        speed = [base[s]["step_s"] / by_seed[s]["step_s"] for s in paired]
        dval = [by_seed[s]["val_last"] - base[s]["val_last"] for s in paired]

        def med(key):
            return statistics.median(r[key] for r in by_seed.values())

        def avg(key):
            return mean([r[key] for r in by_seed.values()])

        print(
            f"| {arm} | {len(by_seed)} | {med('step_s'):.2f} s | "
            f"{statistics.median(speed):.2f}× ({', '.join(f'{x:.2f}' for x in speed)}) | "
            f"{med('rollout_s'):.2f} s | {med('update_s'):.2f} s | {avg('staleness'):.2f} | "
            f"{avg('val_first'):.3f} → {avg('val_last'):.3f} | "
            f"{mean(dval):+.3f} ({', '.join(f'{x:+.3f}' for x in dval)}) | {avg('train_reward'):.3f} | "
            f"{avg('clip_frac'):.4f} | {avg('grad_norm'):.3f} | {avg('k3'):.2e} |"
        )


if __name__ == "__main__":
    main()
