"""Every setting a user can type for ``lit-gspo fit`` is honoured, mapped to lit_gspo's own, or refused at start in one
line: enumerated from ``lightning.pytorch.Trainer.__init__`` and from the CLI's own ``fit`` parser, checked against
the one table the CLI uses (``lit_gspo/lightning/trainer_flags.py``). A Trainer argument a new Lightning release adds
fails ``test_every_trainer_parameter_is_classified`` until it is classified there."""

from __future__ import annotations

import csv
import glob
import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lit_gspo.lightning.cli import RLCLI, cli_main
from lit_gspo.lightning.datamodule import PromptDataModule
from lit_gspo.lightning.module import RLModule
from lit_gspo.lightning.trainer_flags import HONOURED, MAPPED, REFUSED, TOP_LEVEL, TRAINER_FLAGS
from lit_gspo.runtime.user_errors import SettingsError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["--config", str(ROOT / "configs/quickstart.yaml"), "--model.policy.warm_start.steps", "0"]
TINY = [
    *QUICKSTART,
    "--data.num_train",
    "32",
    "--data.num_val",
    "8",
    "--data.prompts_per_step",
    "4",
    "--model.generation.num_generations",
    "4",
    "--model.generation.max_new_tokens",
    "4",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_checkpointing",
    "false",
]


class ParseOnlyCLI(RLCLI):
    """Parses and runs the start checks (``before_instantiate_classes``), builds nothing."""

    def instantiate_classes(self) -> None:
        pass


def parse(*extra: str):
    return ParseOnlyCLI(RLModule, PromptDataModule, args=[*QUICKSTART, *extra], run=False).config


def fit_parser():
    cli = ParseOnlyCLI(RLModule, PromptDataModule, args=QUICKSTART, run=False)
    cli.setup_parser(True, {}, {})  # the parser `lit-gspo fit|validate|test` uses
    return cli.parser.subcommands_action.choices["fit"]


# ------------------------------------------------------------------ enumeration


def test_every_trainer_parameter_is_classified():
    params = [p for p in inspect.signature(pl.Trainer.__init__).parameters if p != "self"]
    missing = [p for p in params if p not in TRAINER_FLAGS]
    assert not missing, f"Trainer arguments not classified in lit_gspo/lightning/trainer_flags.py: {missing}"
    assert not set(TRAINER_FLAGS) - set(params), "classified, but not a Trainer argument (any more)"
    assert {f.kind for f in TRAINER_FLAGS.values()} <= {HONOURED, MAPPED, REFUSED}
    for name, flag in TRAINER_FLAGS.items():
        assert flag.note, name
        if flag.kind == REFUSED:  # the default is a no-op that is accepted; the example is refused
            default = inspect.signature(pl.Trainer.__init__).parameters[name].default
            assert flag.accepts(default) and not flag.accepts(flag.example), name


def test_every_top_level_fit_key_is_classified():
    parser = fit_parser()
    keys = {k.split(".")[0] for k in parser.get_defaults().keys()}
    keys |= set(re.findall(r"^\s+(?:-\w, )?--(\w+)\b", parser.format_help(), re.M)) - {"help"}
    assert keys == set(TOP_LEVEL), (
        f"unclassified: {sorted(keys - set(TOP_LEVEL))}, classified but gone: {sorted(set(TOP_LEVEL) - keys)}"
    )
    trainer_keys = {k.split(".")[1] for k in parser.get_defaults().keys() if k.startswith("trainer.")}
    assert trainer_keys == set(TRAINER_FLAGS)


# ------------------------------------------------------------------ refused: at start, in one line


@pytest.mark.parametrize("name", [n for n, f in TRAINER_FLAGS.items() if f.kind == REFUSED])
def test_a_refused_flag_stops_the_start_in_one_line(name):
    example = TRAINER_FLAGS[name].example
    value = str(example).lower() if isinstance(example, bool) else str(example)
    with pytest.raises(SettingsError) as err:
        parse(f"--trainer.{name}", value)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--trainer.{name} {value}:"), message
    assert "--" in message.split(":", 1)[1] or "leave it" in message, f"says nothing to use instead: {message}"


@pytest.mark.parametrize(
    "args, names",
    [
        (
            ["--trainer.gradient_clip_algorithm", "value"],
            ["--trainer.gradient_clip_algorithm", "--model.update.max_grad_norm"],
        ),
        (
            ["--trainer.check_val_every_n_epoch", "2"],
            ["--trainer.check_val_every_n_epoch", "--model.validation.every_n_steps"],
        ),
        (["--trainer.val_check_interval", "3"], ["--trainer.val_check_interval", "--model.validation.every_n_steps"]),
        (
            ["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1"],
            ["--optimizer torch.optim.SGD", "--model.optimizer"],
        ),
        (
            ["--model.lr_scheduler", "StepLR", "--model.lr_scheduler.step_size", "1", "--lr_scheduler", "ConstantLR"],
            ["--lr_scheduler torch.optim.lr_scheduler.ConstantLR", "--model.lr_scheduler"],
        ),
        (
            ["--model.update.num_minibatches", "129"],
            ["--model.update.num_minibatches 129", "--data.prompts_per_step 16", "at most 128"],
        ),
        (  # 128 rows in minibatches of ⌈128/48⌉ = 3 rows would make 43 optimiser steps, not 48
            ["--model.update.num_minibatches", "48"],
            ["--model.update.num_minibatches 48", "only 43 optimiser steps", "divides 128"],
        ),
        (  # neither val/* nor train/*; a misspelt val/* name is refused once the module is built (test_monitors.py)
            ["--lr_scheduler", "ReduceLROnPlateau", "--lr_scheduler.monitor", "reward"],
            ["--model.lr_scheduler.monitor reward: never logged", "val/reward"],
        ),
        (
            ["--model.lr_scheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau"],
            ["lightning.pytorch.cli.ReduceLROnPlateau", "--model.lr_scheduler.monitor"],
        ),
    ],
)
def test_an_unworkable_value_stops_the_start_in_one_line(args, names):
    """Mapped settings whose value cannot be mapped, and settings the data cannot satisfy."""
    with pytest.raises(ValueError) as err:
        parse(*args)
    assert "\n" not in str(err.value) and all(n in str(err.value) for n in names), str(err.value)


def test_overfit_batches_is_one_line_on_the_command_line(capsys, tmp_path):
    from lit_gspo.tools.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", *QUICKSTART, "--trainer.default_root_dir", str(tmp_path), "--trainer.overfit_batches", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        exit_.value.code == 2
        and err[-1].startswith("error: --trainer.overfit_batches 1:")
        and "--data.num_train" in err[-1]
    )
    assert not any("Traceback" in line for line in err)


# ------------------------------------------------------------------ mapped


def test_mapped_flags_land_on_lit_gspos_settings():
    cfg = parse("--trainer.gradient_clip_val", "0.5")
    assert (
        cfg.model["update"].max_grad_norm == 0.5
    )  # ["update"]: Namespace.update is a method and cfg.trainer.gradient_clip_val is None
    cfg = parse("--model.validation.every_n_steps", "null", "--trainer.val_check_interval", "3")
    assert cfg.model.validation.every_n_steps == 3 and cfg.trainer.check_val_every_n_epoch is None
    # a config without model.optimizer (the quickstart has one: with it, --optimizer is refused above)
    cfg = ParseOnlyCLI(
        RLModule, PromptDataModule, args=["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1"], run=False
    ).config
    assert cfg.model.optimizer.class_path == "torch.optim.SGD" and cfg.model.optimizer.init_args.lr == 0.1
    assert cfg.optimizer is None
    cfg = parse("--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "2")
    assert cfg.model.lr_scheduler.class_path == "torch.optim.lr_scheduler.StepLR" and cfg.lr_scheduler is None


# ------------------------------------------------------------------ honoured: the Trainer the CLI builds carries them


def _timer(trainer) -> bool:
    from lightning.pytorch.callbacks import Timer

    return any(isinstance(c, Timer) for c in trainer.callbacks)


OBSERVED = {  # flag → what the built Trainer shows (public API only)
    "accelerator": lambda t: type(t.accelerator).__name__ == "CPUAccelerator",
    "strategy": lambda t: type(t.strategy).__name__ == "SingleDeviceStrategy",
    "devices": lambda t: t.num_devices == 1,
    "num_nodes": lambda t: t.num_nodes == 1,
    "precision": lambda t: t.precision == "bf16-mixed",
    "logger": lambda t: t.logger is None,
    "fast_dev_run": lambda t: t.fast_dev_run is True,
    "max_epochs": lambda t: t.max_epochs == 1,
    "min_epochs": lambda t: t.min_epochs == 1,
    "max_steps": lambda t: t.max_steps == 4,
    "min_steps": lambda t: t.min_steps == 2,
    "max_time": _timer,
    "limit_train_batches": lambda t: t.limit_train_batches == 2,
    "limit_val_batches": lambda t: t.limit_val_batches == 1,
    "limit_test_batches": lambda t: t.limit_test_batches == 1,
    "num_sanity_val_steps": lambda t: t.num_sanity_val_steps == 1,
    "log_every_n_steps": lambda t: t.log_every_n_steps == 2,
    "enable_checkpointing": lambda t: not t.checkpoint_callbacks,
    "enable_progress_bar": lambda t: t.progress_bar_callback is None,
    "enable_model_summary": lambda t: any(isinstance(c, pl.callbacks.ModelSummary) for c in t.callbacks),
    "deterministic": lambda t: torch.are_deterministic_algorithms_enabled(),
    "benchmark": lambda t: torch.backends.cudnn.benchmark is False,
    "profiler": lambda t: type(t.profiler).__name__ == "SimpleProfiler",
    "default_root_dir": lambda t: t.default_root_dir.endswith("x"),
}
#: honoured flags whose effect only a run shows, and where a run checks it
OBSERVED_BY_A_RUN = {
    "callbacks": "tests/test_lightning_habits.py (ModelCheckpoint, EarlyStopping, LearningRateMonitor, RichProgressBar)",
    "inference_mode": "test_honoured_run_flags (validation under no_grad)",
    "detect_anomaly": "test_honoured_run_flags",
    "sync_batchnorm": "test_honoured_run_flags (no BatchNorm in a causal LM: the run is unchanged)",
    "enable_autolog_hparams": "test_honoured_run_flags (hparams.yaml written or not)",
    "plugins": "tests/test_plugins.py",
}


def test_every_honoured_flag_is_observed_somewhere():
    honoured = {n for n, f in TRAINER_FLAGS.items() if f.kind == HONOURED}
    assert honoured == set(OBSERVED) | set(OBSERVED_BY_A_RUN), honoured ^ (set(OBSERVED) | set(OBSERVED_BY_A_RUN))


@pytest.mark.parametrize("name", sorted(OBSERVED))
def test_an_honoured_flag_reaches_the_trainer(name, tmp_path):
    example = TRAINER_FLAGS[name].example
    value = str(example).lower() if isinstance(example, bool) else str(example)
    if name == "default_root_dir":
        value = str(tmp_path / "x")
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        cli = cli_main(
            [*QUICKSTART, "--trainer.default_root_dir", str(tmp_path / "x"), f"--trainer.{name}", value], run=False
        )
        assert OBSERVED[name](cli.trainer), f"--trainer.{name} {value} did not reach the Trainer"
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)


# ------------------------------------------------------------------ runs: the learning rate follows the schedule


def _rows(root: Path) -> list[dict]:
    (path,) = glob.glob(str(root / "**/metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


def _lrs(root: Path) -> list[float]:
    return [float(r["train/lr"]) for r in _rows(root) if r.get("train/lr")]


def _fit(root: Path, steps: int, *extra: str):
    from lit_gspo.tools.main import main

    main(["fit", *TINY, "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(root), *extra])


STEP_LR = "{class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 1, gamma: 0.5}}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [
        ["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1", "--lr_scheduler.gamma", "0.5"],
        ["--config", f"lr_scheduler: {STEP_LR}"],  # a top-level YAML block
        ["--model.lr_scheduler", "StepLR", "--model.lr_scheduler.step_size", "1", "--model.lr_scheduler.gamma", "0.5"],
    ],
    ids=["top-level flag", "top-level yaml", "model.lr_scheduler"],
)
def test_a_scheduler_given_any_way_sets_the_learning_rate(how, tmp_path):
    _fit(tmp_path, 3, *how)
    # train/lr is read after the step's optimiser step and its scheduler step: 1e-3 × 0.5^(k+1) at RL step k
    assert _lrs(tmp_path) == pytest.approx([1e-3 * 0.5 ** (k + 1) for k in range(3)], rel=1e-6)
    saved = yaml.safe_load((tmp_path / "run_config.yaml").read_text())
    assert saved["model"]["lr_scheduler"]["class_path"] == "torch.optim.lr_scheduler.StepLR"
    assert saved["lr_scheduler"] is None  # recorded where it was applied


@pytest.mark.slow
def test_reduce_on_plateau_follows_val_reward(tmp_path):
    """threshold 10 (rel., mode max): no validation after the first counts as an improvement, so with patience 0 each
    validation in the fit after the first halves the lr; validations come after every RL step."""
    _fit(
        tmp_path,
        4,
        "--lr_scheduler",
        "ReduceLROnPlateau",
        "--lr_scheduler.monitor",
        "val/reward",
        "--lr_scheduler.mode",
        "max",
        "--lr_scheduler.patience",
        "0",
        "--lr_scheduler.threshold",
        "10",
        "--lr_scheduler.factor",
        "0.5",
        "--model.validation.every_n_steps",
        "1",
    )
    assert _lrs(tmp_path) == pytest.approx([1e-3, 1e-3, 5e-4, 2.5e-4], rel=1e-6)


@pytest.mark.slow
def test_reduce_on_plateau_follows_a_train_metric(tmp_path):
    """train/nonfinite_steps is 0 every step: mode min never improves after the first, so each later step halves."""
    _fit(
        tmp_path,
        3,
        "--model.lr_scheduler",
        "lightning.pytorch.cli.ReduceLROnPlateau",
        "--model.lr_scheduler.monitor",
        "train/nonfinite_steps",
        "--model.lr_scheduler.patience",
        "0",
        "--model.lr_scheduler.factor",
        "0.5",
    )
    assert _lrs(tmp_path) == pytest.approx([1e-3, 1e-3, 5e-4], rel=1e-6)


@pytest.mark.slow
def test_a_train_monitor_never_logged_is_one_line(tmp_path, capsys):
    from lit_gspo.tools.main import main

    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                *TINY,
                "--trainer.max_steps",
                "2",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--lr_scheduler",
                "ReduceLROnPlateau",
                "--lr_scheduler.monitor",
                "train/rewrd",
            ]
        )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --model.lr_scheduler.monitor train/rewrd: never logged") and "train/reward" in last


@pytest.mark.slow
def test_honoured_run_flags(tmp_path):
    """inference_mode false, detect_anomaly, sync_batchnorm and enable_autolog_hparams false: the run completes with
    the same RL steps, and no hparams.yaml is written."""
    _fit(
        tmp_path,
        2,
        "--trainer.inference_mode",
        "false",
        "--trainer.detect_anomaly",
        "true",
        "--trainer.sync_batchnorm",
        "true",
        "--trainer.enable_autolog_hparams",
        "false",
    )
    assert [int(r["step"]) for r in _rows(tmp_path) if r.get("train/reward")] == [0, 1]
    assert not glob.glob(str(tmp_path / "**/hparams.yaml"), recursive=True)


@pytest.mark.parametrize(
    "args, start",
    [
        (["--model.generation.num_generations", "0"], "--model.generation: num_generations"),
        (["--model.update.epochs", "0"], "--model.update: epochs"),
        (["--trainer.limit_train_batches", "-1"], "You have passed invalid value -1 for limit_train_batches"),
        (["--data.prompts_per_step", "0"], "--data.prompts_per_step 0: must be >= 1"),
    ],
)
def test_an_invalid_value_is_one_line_not_a_traceback(args, start, tmp_path):
    """A settings group's own check, and a Trainer flag Lightning refuses, are one SettingsError at start."""
    with pytest.raises(SettingsError) as err:
        cli_main([*QUICKSTART, "--trainer.default_root_dir", str(tmp_path), *args], run=False)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)
