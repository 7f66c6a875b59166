"""The habits a Lightning user brings, tried on lit_gspo one at a time: what each does to a quickstart run.

    python benchmarks/lightning_habits.py                 # every habit on the quickstart, 20 RL steps each
    python benchmarks/lightning_habits.py --steps 8 --only fast_dev_run gradient_clip_val

Each habit is a ``lit-gspo fit`` command line (the flag or ``--trainer.callbacks+=...`` a user types) and a check of what
that user expects to find afterwards. The table says, per habit, "works: <what was checked>" or "refused at start:
<the one-line error>", and ✗ where the expectation failed. ``tests/test_lightning_habits.py`` runs the same habits on a
tiny configuration; ``docs/usage.md`` has this script's output.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lit_gspo.runtime.hardware import cpu_model  # noqa: E402

#: the quickstart, shortened; the tests use a tinier one (tests/test_lightning_habits.py)
QUICKSTART = [
    "--config",
    str(ROOT / "configs/quickstart.yaml"),
    "--model.validation.every_n_steps",
    "5",
    "--trainer.enable_progress_bar",
    "false",
]


@dataclass
class Outcome:
    """What a habit's run left: the CLI object (None when it failed before), the error, the run directory."""

    root: Path
    cli: object | None = None
    error: BaseException | None = None

    def rows(self) -> list[dict]:
        files = sorted(glob.glob(str(self.root / "**/metrics.csv"), recursive=True))
        if not files:
            return []
        with open(files[-1]) as f:
            return list(csv.DictReader(f))

    def steps_with(self, key: str) -> list[int]:
        return [int(r["step"]) for r in self.rows() if r.get(key) not in (None, "")]

    @property
    def module(self):
        return self.cli.model

    @property
    def trainer(self):
        return self.cli.trainer


@dataclass
class Habit:
    name: str
    args: list[str]
    check: Callable[[Outcome, int], str]  # (outcome, RL steps asked for) -> what was verified; AssertionError if not
    refused: bool = False  # the expected outcome is a one-line refusal before anything runs
    extra: dict = field(default_factory=dict)


def callback(outcome: Outcome, name: str):
    found = [c for c in outcome.trainer.callbacks if type(c).__name__ == name]
    assert found, f"no {name} among the trainer's callbacks"
    return found[0]


def check_model_checkpoint(o: Outcome, steps: int) -> str:
    import torch

    cb = next(c for c in o.trainer.checkpoint_callbacks if getattr(c, "monitor", None) == "val/reward")
    assert len(cb.best_k_models) == 2, f"best_k_models: {cb.best_k_models}"
    assert all(Path(p).is_file() for p in cb.best_k_models)
    fit_vals = [float(r["val/reward"]) for r in o.rows() if r.get("val/reward") and int(r["step"]) > 0]
    assert abs(float(cb.best_model_score) - max(fit_vals)) < 1e-6, (cb.best_model_score, fit_vals)
    last = torch.load(o.root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert last["rl_step"] == steps, f"last.ckpt holds RL step {last['rl_step']}, not {steps}"
    return f"2 best by val/reward kept (best {float(cb.best_model_score):.3f}) + checkpoints/last.ckpt of step {steps}"


def check_last_is_final(o: Outcome, steps: int) -> str:
    import torch

    last = torch.load(o.root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert last["rl_step"] == steps, f"last.ckpt holds RL step {last['rl_step']}, not {steps}"
    return f"a checkpoint every step beside checkpoints/last.ckpt, which holds the final step {steps}"


def check_early_stopping(o: Outcome, steps: int) -> str:
    cb = callback(o, "EarlyStopping")
    assert o.module.rl_step < steps, f"ran all {steps} steps"
    assert o.steps_with("val/reward")[-1] == o.module.rl_step
    return f"stopped after RL step {o.module.rl_step} of {steps} (patience 1, wait {cb.wait_count})"


def check_lr_monitor(o: Outcome, steps: int) -> str:
    columns = [k for k in o.rows()[0] if k.startswith("lr-")]
    assert columns and o.steps_with(columns[0]), "no lr-* column"
    return f"{columns[0]} logged at {len(o.steps_with(columns[0]))} steps"


def check_rich_bar(o: Outcome, steps: int) -> str:
    bar = o.trainer.progress_bar_callback
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert type(bar).__name__ == "RLRichProgressBar", type(bar)
    assert (task.description, task.total, task.completed) == ("RL step", steps, steps), (
        task.description,
        task.total,
        task.completed,
    )
    return f"the bar read 'RL step {int(task.completed)}/{int(task.total)}'"


def check_on_exception(o: Outcome, steps: int) -> str:
    assert o.error is not None and "nothing to learn" in str(o.error), o.error
    path = o.root / "crash" / "on_exception.ckpt"
    assert path.is_file(), f"no {path}"
    return "the run's error raised, and crash/on_exception.ckpt written"


def check_clip(o: Outcome, steps: int) -> str:
    assert o.module.learner.cfg.max_grad_norm == 0.5 and o.trainer.gradient_clip_val is None
    return "mapped to model.update.max_grad_norm = 0.5 (clipped by the learner after each minibatch's backward)"


def check_limit_train(o: Outcome, steps: int) -> str:
    assert o.module.rl_step == 2 and o.steps_with("val/reward")[-1] == 2, (o.module.rl_step, o.steps_with("val/reward"))
    return "an epoch of 2 RL steps, then the final validation"


def check_limit_val(o: Outcome, steps: int) -> str:
    assert o.trainer.num_val_batches == [1], o.trainer.num_val_batches
    return f"1 batch of {o.cli.datamodule.val_batch_size} held-out prompts per validation"


def check_interval(o: Outcome, steps: int) -> str:
    want = sorted({0, *range(3, steps + 1, 3), steps})
    assert o.steps_with("val/reward") == want, o.steps_with("val/reward")
    return f"val/reward at steps {want}"


def check_fast_dev_run(o: Outcome, steps: int) -> str:
    left = sorted(str(p.relative_to(o.root)) for p in o.root.rglob("*")) if o.root.exists() else []
    assert not left, f"wrote {left}"
    return "1 RL step and 1 validation batch; nothing written"


def check_log_every(o: Outcome, steps: int) -> str:
    assert o.steps_with("train/reward") == list(range(0, steps, 2)), o.steps_with("train/reward")
    return "a train/* row every 2 RL steps"


def check_no_checkpoints(o: Outcome, steps: int) -> str:
    assert not (o.root / "checkpoints").exists() and (o.root / "hf_model").is_dir()
    return "no checkpoints/, hf_model/ written"


def check_ran(what: str) -> Callable[[Outcome, int], str]:
    def check(o: Outcome, steps: int) -> str:
        assert o.module.rl_step == steps and o.steps_with("val/reward")[-1] == steps, (
            o.module.rl_step,
            o.steps_with("val/reward"),
        )
        return what

    return check


def check_max_time(o: Outcome, steps: int) -> str:
    done = o.module.rl_step
    assert done < o.trainer.max_steps and o.steps_with("val/reward")[-1] == done, (done, o.steps_with("val/reward"))
    return f"stopped by the clock after RL step {done}, then validated"


def check_top_level_scheduler(o: Outcome, steps: int) -> str:
    lrs = [float(r["train/lr"]) for r in o.rows() if r.get("train/lr")]
    want = [o.cli.config["fit"]["model"]["optimizer"]["init_args"]["lr"] * 0.5 ** (k + 1) for k in range(len(lrs))]
    assert lrs and all(abs(a - b) <= 1e-6 * b for a, b in zip(lrs, want)), (lrs, want)
    saved = (o.root / "run_config.yaml").read_text()
    assert "torch.optim.lr_scheduler.StepLR" in saved and "\nlr_scheduler: null" in saved
    return "read as model.lr_scheduler: train/lr halves every RL step; run_config.yaml records it there"


def refused(o: Outcome, steps: int) -> str:
    assert o.error is not None and not o.rows(), "it ran"
    return str(o.error).splitlines()[0]


HABITS = [
    Habit(
        "ModelCheckpoint(monitor=val/reward, save_top_k=2)",
        [
            "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.monitor",
            "val/reward",
            "--trainer.callbacks.mode",
            "max",
            "--trainer.callbacks.save_top_k",
            "2",
        ],
        check_model_checkpoint,
    ),
    Habit(
        "ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)",
        [
            "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps",
            "1",
            "--trainer.callbacks.save_top_k",
            "-1",
            "--checkpoint_every_n_steps",
            "4",
        ],
        check_last_is_final,
    ),
    Habit(
        "EarlyStopping(monitor=val/reward)",
        [
            "--trainer.callbacks+=EarlyStopping",
            "--trainer.callbacks.monitor",
            "val/reward",
            "--trainer.callbacks.mode",
            "max",
            "--trainer.callbacks.patience",
            "1",
            "--trainer.callbacks.min_delta",
            "1.0",
        ],
        check_early_stopping,
    ),
    Habit("LearningRateMonitor", ["--trainer.callbacks+=LearningRateMonitor"], check_lr_monitor),
    Habit(
        "RichProgressBar",
        ["--trainer.callbacks+=RichProgressBar", "--trainer.enable_progress_bar", "true"],
        check_rich_bar,
    ),
    Habit(
        "OnExceptionCheckpoint (a run that fails)",
        [
            "--trainer.callbacks+=OnExceptionCheckpoint",
            "--trainer.callbacks.dirpath",
            "{root}/crash",
            "--model.rewards",
            "[{class_path: lit_gspo.rl.rewards.ExactMatch}]",
            "--model.generation.max_skipped_steps",
            "1",
            "--model.generation.dynamic_sampling",
            "true",
            "--model.generation.max_sampling_rounds",
            "1",
        ],
        check_on_exception,
    ),
    Habit("gradient_clip_val 0.5", ["--trainer.gradient_clip_val", "0.5"], check_clip),
    Habit(
        "gradient_clip_algorithm value",
        ["--trainer.gradient_clip_val", "0.5", "--trainer.gradient_clip_algorithm", "value"],
        refused,
        refused=True,
    ),
    Habit("accumulate_grad_batches 4", ["--trainer.accumulate_grad_batches", "4"], refused, refused=True),
    Habit(
        "limit_train_batches 2, max_epochs 1",
        ["--trainer.limit_train_batches", "2", "--trainer.max_epochs", "1", "--trainer.max_steps", "-1"],
        check_limit_train,
    ),
    Habit("limit_val_batches 1", ["--trainer.limit_val_batches", "1"], check_limit_val),
    Habit(
        "val_check_interval 3",
        ["--model.validation.every_n_steps", "null", "--trainer.val_check_interval", "3"],
        check_interval,
    ),
    Habit(
        "val_check_interval 3 with validation.every_n_steps 5",
        ["--trainer.val_check_interval", "3"],
        refused,
        refused=True,
    ),
    Habit(
        "num_sanity_val_steps 1",
        ["--trainer.num_sanity_val_steps", "1"],
        check_ran("sanity check ran; the run as usual"),
    ),
    Habit("fast_dev_run", ["--trainer.fast_dev_run", "true"], check_fast_dev_run),
    Habit("max_time 2 s", ["--trainer.max_time", "00:00:00:02", "--trainer.max_steps", "100000"], check_max_time),
    Habit(
        "precision bf16-mixed",
        ["--trainer.precision", "bf16-mixed"],
        check_ran("trained and validated under bf16 autocast"),
    ),
    Habit(
        "deterministic true", ["--trainer.deterministic", "true"], check_ran("trained with deterministic algorithms")
    ),
    Habit("log_every_n_steps 2", ["--trainer.log_every_n_steps", "2"], check_log_every),
    Habit("enable_checkpointing false", ["--trainer.enable_checkpointing", "false"], check_no_checkpoints),
    Habit(
        "lr_scheduler at the top level",
        ["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1", "--lr_scheduler.gamma", "0.5"],
        check_top_level_scheduler,
    ),
    Habit(
        "lr_scheduler: block at the top of a YAML",
        [
            "--config",
            "lr_scheduler: {class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 1, gamma: 0.5}}",
        ],
        check_top_level_scheduler,
    ),
    Habit(
        "optimizer at the top level (the config has model.optimizer)",
        ["--optimizer", "torch.optim.SGD"],
        refused,
        refused=True,
    ),
    Habit("overfit_batches 1", ["--trainer.overfit_batches", "1"], refused, refused=True),
]


def run_habit(habit: Habit, root: Path, base: list[str], steps: int) -> Outcome:
    """``lit-gspo fit`` with ``base`` + the habit's arguments, in this process (as ``cli_main`` runs it)."""
    from lit_gspo.lightning.cli import cli_main

    args = [
        "fit",
        *base,
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        *[a.replace("{root}", str(root)) for a in habit.args],
    ]
    outcome = Outcome(root)
    try:
        outcome.cli = cli_main(args)
    except (Exception, SystemExit) as err:  # noqa: BLE001 — the outcome is what is reported
        outcome.error = err
    return outcome


def verdict(habit: Habit, outcome: Outcome, steps: int) -> tuple[bool, str]:
    if outcome.error is not None and not habit.refused and habit.check is not check_on_exception:
        return False, f"failed: {type(outcome.error).__name__}: {str(outcome.error).splitlines()[0][:200]}"
    try:
        what = habit.check(outcome, steps)
    except AssertionError as err:
        return False, f"unexpected: {err}"
    return True, (f"refused at start: {what}" if habit.refused else f"works: {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run (default 20)")
    parser.add_argument("--only", nargs="*", default=None, help="habit names containing these words")
    args = parser.parse_args(argv)
    habits = [h for h in HABITS if not args.only or any(w in h.name for w in args.only)]
    cpu = cpu_model()
    lines = ["| habit (`lit-gspo fit --config configs/quickstart.yaml ...`) | outcome | s |", "|---|---|---|"]
    ok = 0
    for habit in habits:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            outcome = run_habit(habit, Path(tmp) / "run", QUICKSTART, args.steps)
            good, text = verdict(habit, outcome, args.steps)
        ok += good
        lines.append(
            f"| `{' '.join(habit.args).replace('|', '/')}` | {'' if good else '✗ '}{text} | "
            f"{time.perf_counter() - start:.0f} |"
        )
        print(lines[-1], flush=True)
    print(
        f"\n{ok}/{len(habits)} as expected; {args.steps} RL steps each, the quickstart with validation.every_n_steps 5, "
        f"on {cpu} ({os.cpu_count()} cores).\n"
        f"Reproduce: python benchmarks/lightning_habits.py --steps {args.steps}\n"
    )
    print("\n".join(lines))
    return 0 if ok == len(habits) else 1


if __name__ == "__main__":
    sys.exit(main())
