"""The progress bar counts RL steps: ``RL step n/N`` with N = max_steps / (epochs × minibatches), across resumes."""

from pathlib import Path

from lit_gspo.lightning.progress import RLProgressBar
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]


def fit(root: Path, max_steps: int, *extra: str, ckpt_path: str | None = None):
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(max_steps),
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "0",
        "--data.num_train",
        "64",
        "--data.num_val",
        "4",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        "--model.update.num_minibatches",
        "2",
        *extra,
    ]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli


def train_bar(cli):
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, RLProgressBar)
    return bar.train_progress_bar


def test_the_bar_counts_rl_steps_not_optimiser_steps_or_data_epochs_and_resumes_where_the_run_left_off(tmp_path):
    # 64 rows / 4 prompts per step = 16 RL steps per data epoch; 2 minibatches: 2 optimiser steps per RL step, which
    # max_steps and the checkpoint interval do not count: they count RL steps
    cli = fit(tmp_path, 3, "--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "1")
    bar = train_bar(cli)
    assert str(bar).startswith("RL step 3/3 "), str(bar)
    assert (bar.n, bar.total, bar.initial) == (3, 3, 0)
    assert "reward=" in str(bar) and "clip=" in str(bar)

    resumed = fit(
        tmp_path, 5, "--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "1", ckpt_path="last"
    )
    bar = train_bar(resumed)
    assert str(bar).startswith("RL step 5/5 "), str(bar)
    assert (bar.n, bar.total, bar.initial) == (5, 5, 3)  # started at the resumed RL step


def test_without_max_steps_the_total_is_batches_per_epoch_times_epochs_and_spans_data_epochs(tmp_path):
    cli = fit(tmp_path, -1, "--trainer.max_epochs", "2", "--data.num_train", "12")  # 3 RL steps per data epoch
    assert str(train_bar(cli)).startswith("RL step 6/6 "), str(train_bar(cli))


def test_the_cli_bar_can_be_turned_off(tmp_path):
    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        run=False,
    )
    assert cli.trainer.progress_bar_callback is None
