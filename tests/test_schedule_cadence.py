"""Issue 39: Lightning's ``interval`` and ``frequency`` of a learning-rate schedule, honoured by RLModule's hand-stepped
schedule (``--model.update.scheduler_interval step|rl_step|epoch``, ``--model.update.scheduler_frequency N``:
``lit_gspo/lightning/schedule.py``) and observed in ``train/lr``, or refused at start in one line."""

from __future__ import annotations

import csv
import glob
from pathlib import Path

import pytest

from lit_gspo.lightning.cli import RLCLI
from lit_gspo.lightning.datamodule import PromptDataModule
from lit_gspo.lightning.module import RLModule
from lit_gspo.runtime.user_errors import SettingsError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["--config", str(ROOT / "configs/quickstart.yaml"), "--model.policy.warm_start.steps", "0"]
TINY = [
    *QUICKSTART,
    *("--data.num_train", "32", "--data.num_val", "8", "--data.prompts_per_step", "4"),
    *("--model.generation.num_generations", "4", "--model.generation.max_new_tokens", "4"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"),
]
HALVING = ["--model.lr_scheduler", "StepLR", "--model.lr_scheduler.step_size", "1", "--model.lr_scheduler.gamma", "0.5"]
TWO_OPTIMISER_STEPS = ["--model.update.num_minibatches", "2"]  # per RL step
EPOCHS_OF_TWO = ["--trainer.max_steps", "-1", "--trainer.limit_train_batches", "2"]  # RL steps per epoch


def lrs(root: Path) -> list[float]:
    (path,) = glob.glob(str(root / "**/metrics.csv"), recursive=True)
    with open(path) as f:
        return [float(r["train/lr"]) for r in csv.DictReader(f) if r.get("train/lr")]


def fit(root: Path, *extra: str) -> None:
    from lit_gspo.tools.main import main

    main(["fit", *TINY, "--trainer.default_root_dir", str(root), *HALVING, *extra])


def halvings(*counts: int) -> list[float]:
    """``train/lr`` of each RL step after that many halvings of 1e-3."""
    return [1e-3 * 0.5**n for n in counts]


@pytest.mark.parametrize(
    "cadence, run, expected",
    [
        ([], ["--trainer.max_steps", "3"], halvings(2, 4, 6)),  # the default: each optimiser step
        (["--model.update.scheduler_frequency", "2"], ["--trainer.max_steps", "3"], halvings(1, 2, 3)),
        (["--model.update.scheduler_interval", "rl_step"], ["--trainer.max_steps", "3"], halvings(1, 2, 3)),
        (
            ["--model.update.scheduler_interval", "rl_step", "--model.update.scheduler_frequency", "2"],
            ["--trainer.max_steps", "4"],
            halvings(0, 1, 1, 2),
        ),
        # an epoch schedule changes train/lr from the next epoch's first step
        (
            ["--model.update.scheduler_interval", "epoch"],
            [*EPOCHS_OF_TWO, "--trainer.max_epochs", "2"],
            halvings(0, 0, 1, 1),
        ),
    ],
    ids=["step", "step every 2nd", "rl_step", "rl_step every 2nd", "epoch"],
)
def test_the_schedule_steps_at_its_interval_and_frequency(cadence, run, expected, tmp_path):
    """Two optimiser steps per RL step (M = 2), a StepLR halving at each of its steps; ``train/lr`` is the rate after
    each RL step's updates."""
    fit(tmp_path, *TWO_OPTIMISER_STEPS, *cadence, *run)
    assert lrs(tmp_path) == pytest.approx(expected, rel=1e-6)


def test_a_resume_keeps_the_cadence(tmp_path):
    """Every 2nd optimiser step (one per RL step): counted by the optimiser steps a checkpoint restores, so the resumed
    4th step halves as the uninterrupted run's does."""
    every_second = ["--model.update.scheduler_frequency", "2", "--trainer.enable_checkpointing", "true"]
    every_second += ["--checkpoint_every_n_steps", "1"]
    fit(tmp_path, *every_second, "--trainer.max_steps", "3")
    fit(tmp_path, *every_second, "--trainer.max_steps", "4", "--ckpt_path", "last")
    assert lrs(tmp_path) == pytest.approx(halvings(0, 1, 1, 2), rel=1e-6)


class ParseOnlyCLI(RLCLI):
    """Parses and runs the start checks, builds nothing."""

    def instantiate_classes(self) -> None:
        pass


@pytest.mark.parametrize(
    "args, start",
    [
        (
            ["--model.update.scheduler_frequency", "0", *HALVING],
            "--model.update.scheduler_frequency 0: must be an int >= 1",
        ),
        (
            ["--model.update.scheduler_interval", "epoch"],
            "--model.update.scheduler_interval epoch --model.update.scheduler_frequency 1: no --model.lr_scheduler to step",
        ),
        (
            [
                *("--model.lr_scheduler", "lightning.pytorch.cli.ReduceLROnPlateau"),
                *("--model.lr_scheduler.monitor", "val/reward"),
                *("--model.update.scheduler_frequency", "2"),
            ],
            "--model.update.scheduler_interval step --model.update.scheduler_frequency 2 with a ReduceLROnPlateau",
        ),
    ],
    ids=["frequency 0", "no schedule", "plateau"],
)
def test_a_cadence_that_cannot_work_is_refused_at_start_in_one_line(args, start):
    with pytest.raises(SettingsError) as err:
        ParseOnlyCLI(RLModule, PromptDataModule, args=[*QUICKSTART, *args], run=False)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


def test_an_interval_lightning_does_not_have_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        ParseOnlyCLI(
            RLModule, PromptDataModule, args=[*QUICKSTART, "--model.update.scheduler_interval", "batch"], run=False
        )
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: --model.update.scheduler_interval batch: expected one of 'step', 'rl_step', 'epoch'"
    ), err


def test_the_python_api_refuses_a_cadence_without_a_schedule():
    from lit_gspo.lightning.schedule import ScheduleCadence

    with pytest.raises(SettingsError, match="no --model.lr_scheduler to step"):
        ScheduleCadence("rl_step", 1).check(None)
    assert ScheduleCadence().check(None).lightning_config() == {"interval": "step", "frequency": 1}
    assert ScheduleCadence("rl_step", 3).lightning_config() == {"interval": "step", "frequency": 3}
