"""Issue 39: a monitor (a ReduceLROnPlateau's, ModelCheckpoint's, EarlyStopping's) naming a metric the run never logs
is refused before the fit starts, in one line naming the option; a name a step logs is never refused
(``lit_gspo/lightning/monitors.py``: checked here by running steps of the built-in components)."""

from __future__ import annotations

import copy
import csv
import glob
import shlex
from pathlib import Path

import pytest

from lit_gspo.lightning.cli import check_plateau, cli_main
from lit_gspo.lightning.monitors import check_monitors, logged_names

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["--config", str(ROOT / "configs/quickstart.yaml"), "--model.policy.warm_start.steps", "0"]
TINY = [
    *QUICKSTART,
    *("--data.num_train", "32", "--data.num_val", "8", "--data.prompts_per_step", "4"),
    *("--model.generation.num_generations", "4", "--model.generation.max_new_tokens", "4"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"),
]
PLATEAU = ["--lr_scheduler", "lightning.pytorch.cli.ReduceLROnPlateau"]


def columns(root: Path) -> list[str]:
    (path,) = glob.glob(str(root / "**/metrics.csv"), recursive=True)
    with open(path) as f:
        return next(csv.reader(f))


def fit(root: Path, *extra: str):
    return cli_main(["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2", *extra])


#: built-in components and settings that log train/* names of their own
SETTINGS = [
    *(f"--model.objective {name}" for name in ("GRPO", "DAPO", "CISPO", "ClipCov", "KLCov", "GMPO", "SAPO", "VESPO")),
    *(f"--model.objective {name}" for name in ("DPPO", "PPO", "LUSPO", "DrGRPO", "GSPOToken")),
    "--model.objective GRPO --model.objective.beta 0.1",
    "--model.update.mismatch.corrections+=lit_gspo.rl.learn.mismatch.TIS --model.update.mismatch.corrections+=lit_gspo.rl.learn.mismatch.OPSM",
    "--model.update.mismatch.corrections+=lit_gspo.rl.learn.mismatch.SequenceMIS --model.update.mismatch.corrections+=lit_gspo.rl.learn.mismatch.MIS",
    "--model.update.mismatch.old_logprobs sampler",
    "--model.generation.max_staleness 1",
    "--model.generation.dynamic_sampling true",
    "--model.update.epochs 2 --model.update.num_minibatches 2",
    "--model.update.entropy_coef 0.01 --model.update.entropy_target 5 --model.update.top_entropy_quantile 0.5",
    "--model.policy.name tiny-qwen3-moe --model.policy.config null",
    "--model.policy.name tiny-qwen3-moe --model.policy.config null --model.update.router_aux_loss_coef 0.01",
    "--model.environment lit_gspo.rl.envs.RetryWithFeedback",
    "--model.environment lit_gspo.rl.envs.ToolUse --model.environment.call_format plain --data.train_source arithmetic "
    "--data.task_kwargs null --model.generation.max_prompt_length 1024 --model.policy.config "
    "'{hidden_size: 64, num_hidden_layers: 2, intermediate_size: 128, max_position_embeddings: 1024}'",
    "--model.rewards+=lit_gspo.rl.rewards.OverlongPenalty --model.rewards.max_len 4 --model.rewards.cache_len 2",
    "--model.validation.num_generations 2",
]


def check_logged_names_are_accepted(root: Path, *extra: str) -> None:
    cli = fit(root, "--model.validation.every_n_steps", "1", *extra)
    names = logged_names(cli.model)
    assert names.open_by is None  # built-in components only: every train/* name is judged
    logged = [c for c in columns(root) if c.startswith(("train/", "val/"))]
    assert any(c.startswith("train/") for c in logged) and any(c.startswith("val/") for c in logged)
    assert [c for c in logged if not names.may_log(c)] == []


def test_every_name_the_quickstart_logs_is_accepted(tmp_path):
    check_logged_names_are_accepted(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
def test_every_name_a_built_in_component_logs_is_accepted(setting, tmp_path):
    check_logged_names_are_accepted(tmp_path, *shlex.split(setting))


def test_every_val_name_a_run_logs_passes_the_start_check_of_a_plateau_monitor(tmp_path):
    """The check of a ReduceLROnPlateau's monitor made on the parsed config, before the module is built, let only
    val/reward, val/response_length and val/clipped_ratio through: a monitor on a reward function's mean, which every
    validation logs, stopped the run at start."""
    extra = ["--model.validation.num_generations", "2", *PLATEAU, "--lr_scheduler.monitor", "val/reward"]
    cli = cli_main([*TINY, "--trainer.default_root_dir", str(tmp_path), *extra], run=False)
    names = logged_names(cli.model)
    assert {"val/rewards/char_accuracy/mean", "val/pass@1", "val/pass@2"} <= set(names.val)
    for name in names.val:
        config = copy.deepcopy(cli.config.model)
        config.lr_scheduler.init_args.monitor = name
        check_plateau(config)
        check_monitors(names, [(f"--model.lr_scheduler.monitor {name}", name)])


def refused(root: Path, capsys, *extra: str) -> str:
    from lit_gspo.tools.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", *TINY, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2", *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err)
    assert not glob.glob(str(root / "**/metrics.csv"), recursive=True)  # refused before the first validation
    return err[-1]


@pytest.mark.parametrize(
    "extra, start",
    [
        (
            [*PLATEAU, "--lr_scheduler.monitor", "train/rewrd"],
            "error: --model.lr_scheduler.monitor train/rewrd: never logged by this run (did you mean train/reward?)",
        ),
        (
            [*PLATEAU, "--lr_scheduler.monitor", "val/rewrd"],
            "error: --model.lr_scheduler.monitor val/rewrd: never logged by this run (did you mean val/reward?)",
        ),
        (
            ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor", "train/los"],
            "error: --trainer.callbacks.monitor train/los (trainer.callbacks[0], EarlyStopping): never logged by this "
            "run (did you mean train/loss?)",
        ),
        (
            [
                *("--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint"),
                *("--trainer.callbacks.monitor", "val/rewards", "--trainer.callbacks.mode", "max"),
            ],
            "error: --trainer.callbacks.monitor val/rewards (trainer.callbacks[0], ModelCheckpoint): never logged by "
            "this run (did you mean val/reward?); each validation logs val/reward, val/response_length, val/clipped_ratio, "
            "val/rewards/char_accuracy/mean;",
        ),
        (  # a family whose names depend on the data: its prefix must be right
            [*PLATEAU, "--lr_scheduler.monitor", "train/ratios/seq_logratio_std"],
            "error: --model.lr_scheduler.monitor train/ratios/seq_logratio_std: never logged by this run",
        ),
    ],
    ids=["plateau train/*", "plateau val/*", "EarlyStopping train/*", "ModelCheckpoint val/*", "a family"],
)
def test_a_monitor_never_logged_is_refused_before_the_fit_in_one_line(extra, start, tmp_path, capsys):
    line = refused(tmp_path, capsys, *extra)
    assert line.startswith(start), line


REWARD = """
def tally(prompts, completions, answer, log_metric=None, **kwargs):
    log_metric("my_count", float(len(completions)))
    return [float(c == a) for c, a in zip(completions, answer)]
"""


def test_a_name_a_users_reward_function_may_log_is_left_to_the_first_step(tmp_path, monkeypatch):
    """A reward function given ``log_metric`` may log any name: ``train/my_count`` is followed, not refused."""
    (tmp_path / "my_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = fit(
        tmp_path / "run", "--model.rewards", "[my_rewards.tally]", *PLATEAU, "--lr_scheduler.monitor", "train/my_count"
    )
    assert logged_names(cli.model).open_by == "reward function tally"
    assert "train/my_count" in columns(tmp_path / "run")


def test_the_python_api_refuses_it_when_the_fit_starts(tmp_path):
    """``trainer.fit(module)`` with ``EarlyStopping(monitor="val/rewrd")``: refused at the fit's start, before any step."""
    from lit_gspo.runtime.user_errors import SettingsError

    callback = ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor", "val/rewrd"]
    cli = cli_main(
        [*TINY, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "2", *callback], run=False
    )
    with pytest.raises(SettingsError, match=r"^EarlyStopping\(monitor='val/rewrd'\): never logged by this run"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.model.rl_step == 0
