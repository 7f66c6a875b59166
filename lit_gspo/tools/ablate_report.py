"""Summaries and the report of an ablation: one row per arm × seed, mean ± spread per arm, plots (matplotlib Agg).

Definitions (also printed in every report):

* ``initial_val_reward`` / ``final_val_reward`` / ``best_val_reward``: first (before any update), last and
  highest ``val/reward`` (greedy, held-out prompts).
* ``steps_to_target``: first RL step whose ``target_metric`` is ≥ the target (empty: never).
* ``mean_*``: mean over RL steps of ``train/*`` (clip_frac, kl, response_length, grad_norm, ...).
* ``collapsed``: a non-finite ``train/loss``, or ``final_val_reward < collapse_fraction · best_val_reward``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from lit_gspo.runtime.extras import MissingExtraError, pyplot

SUMMARY_COLUMNS = [
    "arm",
    "seed",
    "status",
    "initial_val_reward",
    "final_val_reward",
    "best_val_reward",
    "steps_to_target",
    "final_train_reward",
    "mean_train_reward",
    "mean_clip_frac",
    "mean_kl",
    "mean_response_length",
    "mean_grad_norm",
    "mean_entropy",
    "mean_seq_logratio_std",
    "mean_seq_logratio_len_corr",
    "mean_routing_volatility",
    "mean_rerouted_tokens",
    "mean_abs_logratio_rerouted",
    "mean_abs_logratio_kept",
    "num_steps",
    "collapsed",
    "wall_s",
    "error",
]
#: train metrics kept per step in curves.csv and averaged into ``mean_<name>``
CURVE_METRICS = [
    "reward",
    "clip_frac",
    "kl",
    "response_length",
    "grad_norm",
    "entropy",
    "ratio/seq_logratio_std",
    "ratio/seq_logratio_len_corr",
    "routing_volatility",
    "routing/rerouted_tokens",
    "routing/abs_logratio_rerouted",
    "routing/abs_logratio_kept",
]
MEAN_COLUMNS = {
    "mean_train_reward": "reward",
    "mean_clip_frac": "clip_frac",
    "mean_kl": "kl",
    "mean_response_length": "response_length",
    "mean_grad_norm": "grad_norm",
    "mean_entropy": "entropy",
    "mean_seq_logratio_std": "ratio/seq_logratio_std",
    "mean_seq_logratio_len_corr": "ratio/seq_logratio_len_corr",
    "mean_routing_volatility": "routing_volatility",
    "mean_rerouted_tokens": "routing/rerouted_tokens",
    "mean_abs_logratio_rerouted": "routing/abs_logratio_rerouted",
    "mean_abs_logratio_kept": "routing/abs_logratio_kept",
}
#: MoE columns, in a table of their own (``Learner.measure_routing``)
ROUTING_COLUMNS = [
    "mean_routing_volatility",
    "mean_rerouted_tokens",
    "mean_abs_logratio_rerouted",
    "mean_abs_logratio_kept",
]
#: columns averaged over seeds in the report table
REPORT_COLUMNS = [
    "initial_val_reward",
    "final_val_reward",
    "best_val_reward",
    "steps_to_target",
    "final_train_reward",
    "mean_clip_frac",
    "mean_kl",
    "mean_response_length",
    "mean_grad_norm",
    "mean_seq_logratio_std",
    "mean_seq_logratio_len_corr",
    "mean_routing_volatility",
    "wall_s",
]
PLOTS = [
    ("reward", "train/reward (moving mean of 5 steps)"),
    ("clip_frac", "train/clip_frac"),
    ("grad_norm", "train/grad_norm"),
    ("response_length", "train/response_length"),
    ("kl", "train/kl"),
    ("ratio/seq_logratio_std", "std over sequences of Σ_t log r_t"),
    ("routing_volatility", "train/routing_volatility"),
]


def metrics_file(run_dir: Path) -> Path | None:
    files = sorted(run_dir.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def _float(x) -> float | None:
    if x in (None, ""):
        return None
    try:
        return float(x)
    except ValueError:
        return None


def read_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metric → [(step, value)] for every ``val/*`` and ``train/*`` metric of a run's metrics.csv (NaN kept)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(path) as f:
        reader = csv.DictReader(f)
        keys = [k for k in reader.fieldnames or [] if k.startswith(("val/", "train/"))]
        for row in reader:
            step = int(float(row["step"]))
            for key in keys:
                v = _float(row.get(key))
                if v is not None:
                    curves.setdefault(key, []).append((step, v))
    return curves


def _finite(values):
    return [v for v in values if v is not None and math.isfinite(v)]


def _mean(values):
    values = _finite(values)
    return sum(values) / len(values) if values else None


def summarise_run(
    run_dir: Path,
    *,
    arm: str,
    seed: int,
    target: float,
    target_metric: str = "val/reward",
    collapse_fraction: float = 0.5,
) -> tuple[dict, dict]:
    """The summary row and the curves of one run directory."""
    row: dict = {"arm": arm, "seed": seed, "status": "missing", "error": ""}
    status_file = run_dir / "status.json"
    if status_file.exists():
        row.update(json.loads(status_file.read_text()))
    path = metrics_file(run_dir)
    if path is None:
        if row["status"] == "ok":
            row["status"] = "failed"
            row["error"] = "no metrics.csv"
        return row, {}
    curves = read_curves(path)
    val = [v for _, v in curves.get("val/reward", [])]
    train_reward = [v for _, v in curves.get("train/reward", [])]
    row["initial_val_reward"] = val[0] if val else None  # before the first update (after any warm start)
    row["final_val_reward"] = val[-1] if val else None
    row["best_val_reward"] = max(_finite(val)) if _finite(val) else None
    hits = [s for s, v in curves.get(target_metric, []) if math.isfinite(v) and v >= target]
    row["steps_to_target"] = min(hits) if hits else None
    row["target_logged"] = target_metric in curves  # else steps_to_target is not "never" but not measurable
    row["final_train_reward"] = _mean(train_reward[-5:])
    for column, metric in MEAN_COLUMNS.items():
        row[column] = _mean([v for _, v in curves.get(f"train/{metric}", [])])
    row["num_steps"] = len(train_reward)
    with open(path) as f:  # every ratio diagnostic (length / position buckets), for the report's second table
        keys = [k for k in (csv.DictReader(f).fieldnames or []) if k.startswith("train/ratio/")]
    with open(path) as f:
        table = list(csv.DictReader(f))
    row["ratio_means"] = {k[len("train/ratio/") :]: _mean([_float(r.get(k)) for r in table]) for k in keys}
    losses = [v for _, v in curves.get("train/loss", [])]
    nan_loss = any(not math.isfinite(v) for v in losses)
    best, final = row["best_val_reward"], row["final_val_reward"]
    dropped = best is not None and final is not None and best > 0 and final < collapse_fraction * best
    row["collapsed"] = bool(nan_loss or dropped or (final is not None and not math.isfinite(final)))
    return row, curves


def _mean_pm(values: list[float], digits: int = 3) -> str:
    values = _finite(values)
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ± {statistics.stdev(values):.2g}"


def paired_by_seed(rows: list[dict], arms: list[str], column: str = "final_val_reward") -> list[str]:
    """Markdown: ``column`` per seed and arm, then each later arm minus the first, paired by seed.

    Seeds differ far more than arms often do (every arm of a seed starts from the same warm-started weights),
    so the difference of a pair is the comparison to read: its mean ± standard error (s.d. / √n over the seeds
    both arms finished) and how many seeds it was ahead, level or behind. Empty when fewer than two arms ran.
    """
    value = {(r["arm"], r["seed"]): r.get(column) for r in rows if r.get("status") == "ok"}
    if len(arms) < 2:
        return []
    seeds = sorted({seed for _, seed in value})
    lines = [f"| seed | {' | '.join(arms)} |", "|---" * (len(arms) + 1) + "|"]
    for seed in seeds:
        cells = [value.get((arm, seed)) for arm in arms]
        lines.append(f"| {seed} | " + " | ".join("–" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines += ["", f"| arm − {arms[0]} | seeds | mean Δ ± s.e. | ahead / level / behind |", "|---|---|---|---|"]
    for arm in arms[1:]:
        deltas = _finite(
            [
                value[(arm, seed)] - value[(arms[0], seed)]
                for seed in seeds
                if value.get((arm, seed)) is not None and value.get((arms[0], seed)) is not None
            ]
        )
        if not deltas:
            continue
        se = statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else float("nan")
        ahead, behind = sum(d > 0 for d in deltas), sum(d < 0 for d in deltas)
        lines.append(
            f"| {arm} | {len(deltas)} | {statistics.fmean(deltas):+.3f} ± {se:.3f} | "
            f"{ahead} / {len(deltas) - ahead - behind} / {behind} |"
        )
    return lines


def _bucket_order(key: str):
    kind = 0 if key.startswith("seq_logratio_std") else 1 if key.startswith("seq_logratio_absmax") else 2
    lo = key.rsplit("len", 1)[-1] if "_len" in key else key.rsplit("pos", 1)[-1]
    return kind, int(lo.split("-")[0]) if lo.split("-")[0].isdigit() else 0


def write_curves(path: Path, curves: dict) -> None:
    keys = ["val/reward"] + [f"train/{m}" for m in CURVE_METRICS]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "step"] + keys)
        for (arm, seed), curve in curves.items():
            by_step: dict[int, dict] = {}
            for key in keys:
                for step, v in curve.get(key, []):
                    by_step.setdefault(step, {})[key] = v
            for step in sorted(by_step):
                writer.writerow(
                    [arm, seed, step] + [f"{by_step[step][k]:.6g}" if k in by_step[step] else "" for k in keys]
                )


def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = _finite(values[max(0, i - window + 1) : i + 1])
        out.append(sum(chunk) / len(chunk) if chunk else float("nan"))
    return out


def plot(path: Path, curves: dict, arms: list[str], key: str, title: str, smooth: int = 1) -> bool:
    """One line per arm (mean over seeds), shaded min–max over seeds; False when no arm has the metric."""
    plt = pyplot("Plotting an ablation report")

    fig, ax = plt.subplots(figsize=(5.2, 3.2), dpi=80)
    drawn = False
    for i, arm in enumerate(arms):
        per_seed = [dict(c[key]) if c.get(key) else None for (a, _), c in curves.items() if a == arm]
        per_seed = [s for s in per_seed if s]
        if not per_seed:
            continue
        if smooth > 1:
            per_seed = [dict(zip(sorted(s), _smooth([s[t] for t in sorted(s)], smooth))) for s in per_seed]
        steps = sorted({t for s in per_seed for t in s})
        mean, lo, hi = [], [], []
        for t in steps:
            vals = _finite([s.get(t) for s in per_seed])
            mean.append(sum(vals) / len(vals) if vals else float("nan"))
            lo.append(min(vals) if vals else float("nan"))
            hi.append(max(vals) if vals else float("nan"))
        (line,) = ax.plot(steps, mean, label=arm, lw=1.4, ls=["-", "--", ":", "-."][i % 4])  # overlaps stay visible
        if len(per_seed) > 1:
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
        drawn = True
    if drawn:
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path)
    plt.close(fig)
    return drawn


def _arm_table(rows: list[dict], arms: list[str], columns: list[str], value) -> list[str]:
    """Markdown table: one line per arm, ``value(row, column)`` as mean ± std over the arm's finished runs."""
    lines = ["| arm | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for arm in arms:
        ok = [r for r in rows if r["arm"] == arm and r.get("status") == "ok"]
        lines.append(f"| {arm} | " + " | ".join(_mean_pm([value(r, c) for r in ok]) for c in columns) + " |")
    return lines


def write_report(ab, rows: list[dict], curves: dict, arms: list[str]) -> None:
    """report.md, curves.csv and PNG plots in ``ab.report_dir``; a hand-written ``reading.md`` there is included."""
    out = ab.report_dir
    write_curves(out / "curves.csv", curves)
    images, no_plots = [], None
    try:
        if plot(out / "val_reward.png", curves, arms, "val/reward", "val/reward (greedy, held-out prompts)"):
            images.append("val_reward.png")
        for key, title in PLOTS:
            name = key.replace("/", "_") + ".png"
            if plot(out / name, curves, arms, f"train/{key}", title, smooth=5 if key == "reward" else 1):
                images.append(name)
    except MissingExtraError as err:  # the runs are done: write the tables, say how to get the plots
        no_plots = str(err)
        print(f"no plots: {no_plots}")
    lines = [f"# Ablation: {ab.name}", ""]
    if ab.description:
        lines += [ab.description.strip(), ""]
    base = ab.base if isinstance(ab.base, str) else "(inline)"
    lines += [
        f"Config: `{ab.source}` (base `{base}`), seeds {ab.seeds}. Reproduce with "
        f"`lit-gspo ablate --config {ab.source}`.",
        "",
    ]
    if ab.overrides:
        lines += ["Common overrides: " + ", ".join(f"`{k}={v}`" for k, v in ab.overrides.items()), ""]
    lines += ["| arm | objective | overrides |", "|---|---|---|"]
    for arm in ab.arms:
        if arm.name in arms:
            over = ", ".join(f"`{k}={v}`" for k, v in arm.overrides.items()) or "–"
            lines.append(f"| {arm.name} | {arm.objective or '(base)'} | {over} |")
    lines += ["", "## Results (mean ± std over seeds)", ""]
    lines += [
        "| arm | ok runs | " + " | ".join(REPORT_COLUMNS) + " | reached target | collapsed |",
        "|---" * (len(REPORT_COLUMNS) + 5) + "|",
    ]
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        ok = [r for r in mine if r.get("status") == "ok"]
        cells = [_mean_pm([r.get(c) for r in ok]) for c in REPORT_COLUMNS]
        reached = sum(r.get("steps_to_target") is not None for r in ok)
        collapsed = sum(bool(r.get("collapsed")) for r in ok)
        lines.append(
            f"| {arm} | {len(ok)}/{len(mine)} | " + " | ".join(cells) + f" | {reached}/{len(ok)} | "
            f"{collapsed}/{len(ok)} |"
        )
    if any(_finite([r.get("mean_rerouted_tokens") for r in rows])):
        lines += [
            "",
            "MoE routing after each RL step (mean over steps, then mean ± std over seeds): the share of expert "
            "choices changed (`routing_volatility`), of completion tokens with a changed expert in some layer "
            "(`rerouted_tokens`), and the mean |log π_θ − log π_old| over those tokens and over the others.",
            "",
            *_arm_table(rows, arms, ROUTING_COLUMNS, lambda row, column: row.get(column)),
        ]
    paired = paired_by_seed(rows, arms)
    if paired:
        lines += [
            "",
            "## Final val/reward, paired by seed",
            "",
            "Every arm of a seed starts from the same weights; Δ is an arm minus the first arm on the same seed, "
            "± its standard error over seeds.",
            "",
            *paired,
        ]
    ratio_keys = sorted(
        {
            k
            for r in rows
            for k in (r.get("ratio_means") or {})
            if ("_len" in k or "_pos" in k) and not k.endswith("_corr")
        },
        key=_bucket_order,
    )
    if ratio_keys:
        lines += [
            "",
            "Ratio diagnostics by length / position bucket (mean over steps, then mean ± std over seeds): "
            "`seq_logratio_std_lenA-B` = std of Σ_t log r_t over sequences of length A..B; "
            "`token_ratio_var_posA-B` = variance of r_t at positions A..B.",
            "",
            *_arm_table(rows, arms, ratio_keys, lambda row, key: (row.get("ratio_means") or {}).get(key)),
        ]
    unlogged = [r for r in rows if r.get("status") == "ok" and r.get("target_logged") is False]
    if unlogged:
        runs = ", ".join(f"{r['arm']} seed {r['seed']}" for r in unlogged)
        lines += [
            "",
            f"**`{ab.target_metric}` is not in the metrics of {runs}**: their steps_to_target is not measured (each "
            "validation logs `val/*` names, each RL step `train/*` names; the run's metrics.csv lists them).",
        ]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"{r['arm']} seed {r['seed']}: {r.get('error')}" for r in failed)]
    lines += [
        "",
        f"steps_to_target: first RL step with `{ab.target_metric}` ≥ {ab.target_reward} (mean over the seeds "
        f"that reached it). collapsed: non-finite loss, or final val/reward < {ab.collapse_fraction} × best. "
        "mean_*: mean over RL steps of the `train/` metric; `seq_logratio` = Σ_t log r_t per sequence "
        "(log of the product of token ratios, measured in the minibatches after the step's first optimiser "
        "step; see `lit_gspo/rl/learn/diagnostics.py`). Per-run numbers: `summary.csv`; curves: `curves.csv`.",
        "",
    ]
    reading = out / "reading.md"
    if reading.exists():
        lines += ["## Reading", "", reading.read_text().strip(), ""]
    lines += ["## Plots", "", "Lines: mean over seeds; shaded: min–max over seeds.", ""]
    lines += [f"![{name}]({name})" for name in images] + ([f"No plots: {no_plots}"] if no_plots else [])
    (out / "report.md").write_text("\n".join(lines) + "\n")
