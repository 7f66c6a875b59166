"""``lit-gspo ablate --config configs/ablate/<name>.yaml``: every arm × seed of one base fit config, then a report.

The ablation file::

    name: gspo_vs_grpo
    base: configs/quickstart.yaml        # a fit config (path), or inline: base: {trainer: {...}, model: {...}}
    overrides:                            # dotted fit flags applied to every arm (as on the command line)
      trainer.max_steps: 40
      model.update.num_minibatches: 4
    arms:
      - name: GRPO                        # optional; defaults to the objective's class name
        objective: GRPO                   # class name or class path, as ``--model.objective``
        overrides: {model.objective.clip_high: 0.28}
    seeds: [0, 1, 2]                      # each sets seed_everything and data.seed (``seed_keys``)
    output_dir: runs/ablate/gspo_vs_grpo  # one fit per arm × seed under <output_dir>/<arm>/seed<S>/
    report_dir: docs/ablations/gspo_vs_grpo   # summary.csv, curves.csv, report.md, *.png (default: output_dir)
    target_reward: 0.5                    # steps_to_target: first step where ``target_metric`` ≥ this
    target_metric: val/reward            # any val/* or train/* metric the runs log (val/pass@4, train/reward, ...)
    collapse_fraction: 0.5                # collapsed: final val/reward < fraction · best, or a non-finite loss

Runs are sequential, in this process (no import cost per run; a failing run is recorded with its error
and the others go on). Every arm of a seed starts from the same model init, data and sampling seeds,
so on CPU the same config and seed reproduce the same summary numbers (wall time aside).
``--report-only`` rebuilds summary and report from the runs' metrics already on disk.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser

from lit_gspo.lightning.callbacks.signals import RunInterrupted
from lit_gspo.lightning.cli import cli_main
from lit_gspo.lightning.quiet import CLI_ARGS_WARNING
from lit_gspo.runtime.own_context import run_in_own_context
from lit_gspo.tools.ablate_report import SUMMARY_COLUMNS, summarise_run, write_report

SEED_KEYS = ("seed_everything", "data.seed")


@dataclass
class Arm:
    name: str
    objective: str | None = None
    overrides: dict = field(default_factory=dict)


@dataclass
class Ablation:
    name: str
    base: str | dict
    arms: list[Arm]
    seeds: list[int]
    output_dir: Path
    report_dir: Path
    overrides: dict = field(default_factory=dict)
    seed_keys: tuple[str, ...] = SEED_KEYS
    target_reward: float = 0.5
    target_metric: str = "val/reward"
    collapse_fraction: float = 0.5
    description: str = ""
    source: Path | None = None


def load_ablation(path: str | Path) -> Ablation:
    """Parse and check an ablation YAML (paths relative to the working directory)."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping")
    unknown = set(raw) - {
        "name",
        "base",
        "arms",
        "seeds",
        "output_dir",
        "report_dir",
        "overrides",
        "seed_keys",
        "target_reward",
        "target_metric",
        "collapse_fraction",
        "description",
    }
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    for key in ("base", "arms", "seeds"):
        if key not in raw:
            raise ValueError(f"{path}: missing {key!r}")
    arms = []
    for i, a in enumerate(raw["arms"]):
        if isinstance(a, str):
            a = {"objective": a}
        extra = set(a) - {"name", "objective", "overrides"}
        if extra:
            raise ValueError(f"{path}: arm {i}: unknown keys {sorted(extra)}")
        name = a.get("name") or (a.get("objective") or "").rsplit(".", 1)[-1]
        if not name:
            raise ValueError(f"{path}: arm {i} needs a name or an objective")
        arms.append(Arm(name=str(name), objective=a.get("objective"), overrides=dict(a.get("overrides") or {})))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: arm names must be distinct, got {names}")
    name = raw.get("name") or path.stem
    base = raw["base"]
    if isinstance(base, str) and not Path(base).exists():
        raise FileNotFoundError(f"{path}: base config {base!r} not found (paths are relative to the working directory)")
    output_dir = Path(raw.get("output_dir") or f"runs/ablate/{name}")
    target_metric = str(raw.get("target_metric", "val/reward"))
    if not target_metric.startswith(("val/", "train/")):
        raise ValueError(
            f"{path}: target_metric {target_metric!r} is never logged: name a val/* metric (each validation: "
            "val/reward, val/rewards/<function>/mean, val/pass@<k>, ...) or a train/* one (each RL step)"
        )
    return Ablation(
        name=name,
        base=base,
        arms=arms,
        seeds=[int(s) for s in raw["seeds"]],
        output_dir=output_dir,
        report_dir=Path(raw.get("report_dir") or output_dir),
        overrides=dict(raw.get("overrides") or {}),
        seed_keys=tuple(raw.get("seed_keys") or SEED_KEYS),
        target_reward=float(raw.get("target_reward", 0.5)),
        target_metric=target_metric,
        collapse_fraction=float(raw.get("collapse_fraction", 0.5)),
        description=str(raw.get("description") or ""),
        source=path,
    )


def _flag_value(value) -> str:
    """A YAML/JSON scalar or structure as jsonargparse reads it on the command line."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def fit_args(ab: Ablation, arm: Arm, seed: int, run_dir: Path, base_path: Path) -> list[str]:
    """The ``lit-gspo fit`` arguments of one run (order matters: the objective class before its init args)."""
    args = ["--config", str(base_path)]
    for key, value in ab.overrides.items():
        args += [f"--{key}", _flag_value(value)]
    if arm.objective:
        args += ["--model.objective", arm.objective]
    for key, value in arm.overrides.items():
        args += [f"--{key}", _flag_value(value)]
    for key in ab.seed_keys:
        args += [f"--{key}", str(seed)]
    args += ["--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false"]
    return args


def run_one(args: list[str]) -> None:
    """One fit, in this process, as ``lit-gspo fit`` runs it, in its own context: an arm leaves nothing (its
    model, its torch config) to the arms after it (``lit_gspo.runtime.own_context``)."""
    run_in_own_context(_fit, args)


def _fit(args: list[str]) -> None:
    # sys.argv holds `lit-gspo ablate ...`, which this process consumed: passing `args` is no mistake here. Not
    # in a catch_warnings block: that would also undo the filters RLModule installs for the fit below.
    warnings.filterwarnings("ignore", message=CLI_ARGS_WARNING)
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # as `lit-gspo fit`


def run_dir_of(ab: Ablation, arm: Arm, seed: int) -> Path:
    return ab.output_dir / arm.name / f"seed{seed}"


def run_ablation(ab: Ablation, *, only: list[str] | None = None, report_only: bool = False) -> list[dict]:
    """Run (unless ``report_only``) every arm × seed, then write the summary and report; returns the summary rows."""
    ab.output_dir.mkdir(parents=True, exist_ok=True)
    base_path = None if report_only else _base_path(ab)
    arms = [a for a in ab.arms if not only or a.name in only]
    for seed in ab.seeds:
        for arm in arms:
            run_dir = run_dir_of(ab, arm, seed)
            if report_only:
                continue
            if run_dir.exists():
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            args = fit_args(ab, arm, seed, run_dir, base_path)
            (run_dir / "args.json").write_text(json.dumps(args, indent=1))
            print(f"[ablate] {ab.name}: arm {arm.name}, seed {seed}", flush=True)
            start = time.perf_counter()
            status = {"status": "ok", "error": ""}
            try:
                run_one(args)
            except BaseException as exc:  # a failed arm is reported, not fatal (SystemExit from argument errors too)
                if isinstance(exc, (KeyboardInterrupt, RunInterrupted)):  # the user stopped the ablation, not the arm
                    (run_dir / "status.json").write_text(
                        json.dumps({"status": "interrupted", "error": str(exc), "wall_s": time.perf_counter() - start})
                    )
                    print(
                        f"[ablate] stopped by a signal during arm {arm.name}, seed {seed}; the runs after it were "
                        "not started",
                        flush=True,
                    )
                    raise
                status = {"status": "failed", "error": f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]}
                (run_dir / "error.txt").write_text(traceback.format_exc())
                print(f"[ablate] {arm.name} seed {seed} FAILED: {status['error']}", flush=True)
            status["wall_s"] = time.perf_counter() - start
            (run_dir / "status.json").write_text(json.dumps(status))
    rows, curves = [], {}
    for seed in ab.seeds:
        for arm in arms:
            row, curve = summarise_run(
                run_dir_of(ab, arm, seed),
                arm=arm.name,
                seed=seed,
                target=ab.target_reward,
                target_metric=ab.target_metric,
                collapse_fraction=ab.collapse_fraction,
            )
            rows.append(row)
            curves[(arm.name, seed)] = curve
    ab.report_dir.mkdir(parents=True, exist_ok=True)
    write_summary(ab.report_dir / "summary.csv", rows)
    write_report(ab, rows, curves, [a.name for a in arms])
    print(f"[ablate] wrote {ab.report_dir / 'summary.csv'} and {ab.report_dir / 'report.md'}", flush=True)
    return rows


def _base_path(ab: Ablation) -> Path:
    """A copy of the base config taken once, next to the runs: every run reads the same file, even if the
    original is edited while the ablation runs (this happened: a quickstart commit landed mid-ablation)."""
    path = ab.output_dir / "base_config.yaml"
    if isinstance(ab.base, dict):
        path.write_text(yaml.safe_dump(ab.base, sort_keys=False))
    else:
        shutil.copyfile(ab.base, path)
    return path


def write_summary(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k)) for k in SUMMARY_COLUMNS})


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def make_parser() -> ArgumentParser:
    """The ``lit-gspo ablate`` arguments (the entry point also lists this parser in ``lit-gspo --help``)."""
    parser = ArgumentParser(
        prog="lit-gspo ablate", description="Every arm × seed of one base fit config, then a report."
    )
    parser.add_argument("--config", type=str, required=True, help="the ablation YAML (configs/ablate/<name>.yaml)")
    parser.add_argument("--output_dir", type=str, help="override output_dir (runs)")
    parser.add_argument("--report_dir", type=str, help="override report_dir (summary.csv, report.md, plots)")
    parser.add_argument("--arms", type=str, help="comma-separated arm names to run (null: all)")
    parser.add_argument("--seeds", type=str, help="comma-separated seeds (null: the config's)")
    parser.add_argument("--report-only", action="store_true", help="rebuild summary/report from finished runs")
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = make_parser().parse_args(argv)
    ab = load_ablation(ns.config)
    if ns.output_dir:
        ab.output_dir = Path(ns.output_dir)
        ab.report_dir = Path(ns.report_dir or ns.output_dir)
    elif ns.report_dir:
        ab.report_dir = Path(ns.report_dir)
    if ns.seeds:
        ab.seeds = [int(s) for s in ns.seeds.split(",")]
    run_ablation(ab, only=ns.arms.split(",") if ns.arms else None, report_only=ns.report_only)


__all__ = ["Ablation", "Arm", "fit_args", "load_ablation", "main", "make_parser", "run_ablation"]
