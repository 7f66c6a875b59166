"""Every logger a user names on the command line takes a fit: CSV (the default), TensorBoard, W&B offline, MLflow with
a file store and with sqlite. Each test runs ``lit-gspo fit`` as typed (``--trainer.logger <class path>``, 2 RL steps)
and reads ``train/reward``, ``val/reward`` and the completions back from what that logger wrote.

Metric names nest: no logged key may also be the folder of another (``train/reward`` beside ``train/reward/<fn>``
made MLflow's file store fail with "Is a directory"; TensorBoard and W&B group tags by the same folders).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from jsonargparse import ArgumentParser

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import column, read_metrics, tiny_args  # noqa: E402

from lit_gspo.lightning.completions_log import COLUMNS  # noqa: E402
from lit_gspo.lightning.run_dir import SaveRunConfig  # noqa: E402
from lit_gspo.tools.main import cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "tests/golden").glob("*/*.json"))  # one folder per CPU vendor


def folder_clashes(keys) -> list[tuple[str, str]]:
    """(value key, key under it) for each logged key that is also the folder of another: ``a`` and ``a/b``."""
    keys = set(keys)
    return sorted((key, other) for other in keys for key in keys if other.startswith(key + "/"))


def fit(tmp_path: Path, *extra: str, configs: tuple[str, ...] = ("quickstart.yaml",)):
    """``lit-gspo fit --config <configs> ...`` for 2 RL steps on tiny data (validation at steps 0 and 2) under
    ``tmp_path/run``, then ``extra``; the CLI object after it."""
    config_args = [arg for name in configs for arg in ("--config", str(ROOT / "configs" / name))]
    settings = tiny_args(tmp_path / "run", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false")[2:]
    return cli_main(["fit", *config_args, *settings, *extra])  # settings after the configs: theirs are overridden


def assert_logged(cli, train: list[tuple[int, float]], val: list[tuple[int, float]]) -> None:
    """The fit finished, and the logger holds one ``train/reward`` per RL step and ``val/reward`` at steps 0 and 2,
    the last of each equal to what the module logged (``trainer.callback_metrics``)."""
    assert Path(cli.trainer.default_root_dir, "hf_model", "config.json").is_file()
    assert len(train) == 2 and [step for step, _ in val] == [0, 2]
    metrics = cli.trainer.callback_metrics
    assert train[-1][1] == pytest.approx(float(metrics["train/reward"]), abs=1e-6)
    assert val[-1][1] == pytest.approx(float(metrics["val/reward"]), abs=1e-6)


def test_folder_clashes_finds_a_value_that_is_also_a_folder():
    assert folder_clashes(["train/reward", "train/reward/char_accuracy", "train/reward_std"]) == [
        ("train/reward", "train/reward/char_accuracy")
    ]
    assert (
        folder_clashes(
            [
                "train/reward",
                "train/rewards/f/mean",
                "train/rewards/f/std",
                "train/ratio_max",
                "train/ratio/seq_logratio_std",
            ]
        )
        == []
    )


def test_csv_logger_is_the_default_and_its_config_and_completions_sit_beside_metrics_csv(tmp_path):
    cli = fit(tmp_path)
    rows = read_metrics(tmp_path)
    train = [(int(r["step"]), float(r["train/reward"])) for r in rows if r.get("train/reward")]
    val = [(int(r["step"]), float(r["val/reward"])) for r in rows if r.get("val/reward")]
    assert_logged(cli, train, val)
    assert folder_clashes(rows[0]) == [], rows[0].keys()
    assert column(rows, "train/rewards/char_accuracy/mean") and column(rows, "train/rewards/char_accuracy/std")
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir == tmp_path / "run/lightning_logs/version_0"  # LightningCLI's config.yaml: where it always was
    assert (log_dir / "config.yaml").is_file() and not (tmp_path / "run/config.yaml").exists()
    with open(log_dir / "completions.csv") as f:
        assert {int(r["step"]) for r in csv.DictReader(f)} == {0, 2}


# Keys of the other code paths: multi-turn (turns, success_turn{k}, val/success...), and in one fit PPO's value
# loss, MoE routing replay (train/routing/*, routing_volatility), the mismatch corrections (train/mismatch/*) and the
# ratio diagnostics (train/ratio/*, with several minibatches).
PATHS = {
    "multiturn": (["multiturn/reversal_retry.yaml"], ["train/success_turn1", "val/success"]),
    "ppo_moe_mismatch": (
        ["quickstart.yaml", "objectives/ppo.yaml", "mismatch/tis_opsm.yaml"],
        ["train/value_loss", "train/routing/rerouted_tokens", "train/mismatch/k3", "train/ratio/seq_logratio_std"],
    ),
}
MOE = [
    "--model.policy.name",
    "tiny-qwen3-moe",
    "--model.policy.config",
    "{hidden_size: 64, num_hidden_layers: 2, moe_intermediate_size: 32}",
    "--model.policy.routing.replay",
    "true",
    "--model.update.num_minibatches",
    "2",
]


@pytest.mark.parametrize("name", PATHS)
def test_no_logged_key_is_also_a_folder(tmp_path, name):
    configs, expected = PATHS[name]
    fit(tmp_path, *(MOE if "moe" in name else []), configs=tuple(configs))
    keys = list(read_metrics(tmp_path)[0])
    assert set(expected) <= set(keys), keys
    assert folder_clashes(keys) == []


def _golden_keys() -> set[str]:
    return {key for path in GOLDEN for row in json.loads(path.read_text())["metrics"].values() for key in row}


@pytest.mark.xfail(
    any(k.startswith("train/reward/") for k in _golden_keys()),
    strict=True,
    reason="tests/golden/*.json hold the old train/reward/<fn> until they are re-recorded",
)
def test_no_key_of_the_golden_runs_is_also_a_folder():
    """The six golden configurations (LoRA, DAPO dynamic sampling, minibatches × epochs, ...) list every key they log."""
    keys = _golden_keys()
    assert "train/reward" in keys and folder_clashes(keys) == []


def test_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = fit(
        tmp_path,
        "--trainer.logger",
        "lightning.pytorch.loggers.TensorBoardLogger",
        "--trainer.logger.save_dir",
        str(tmp_path / "tb"),
    )
    log_dir = tmp_path / "tb/lightning_logs/version_0"
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert_logged(
        cli,
        [(e.step, e.value) for e in events.Scalars("train/reward")],
        [(e.step, e.value) for e in events.Scalars("val/reward")],
    )
    assert folder_clashes(events.Tags()["scalars"]) == []
    assert "train/rewards/char_accuracy/mean" in events.Tags()["scalars"]
    texts = events.Tensors("val/completions/text_summary")
    assert [e.step for e in texts] == [0, 2]
    assert b"| step | prompt | completion | reward | answer |" in texts[0].tensor_proto.string_val[0]
    assert (log_dir / "config.yaml").is_file()


def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": tmp_path / "wandb",
        "WANDB_CONFIG_DIR": tmp_path / "wandb",
        "WANDB_CACHE_DIR": tmp_path / "wandb",
        "WANDB_DATA_DIR": tmp_path / "wandb",
        "WANDB_SILENT": "true",
    }.items():
        monkeypatch.setenv(var, str(value))
    cli = fit(
        tmp_path,
        "--trainer.logger",
        "lightning.pytorch.loggers.WandbLogger",
        "--trainer.logger.offline",
        "true",
        "--trainer.logger.save_dir",
        str(tmp_path / "wb"),
        "--trainer.logger.project",
        "lit_gspo_test",
    )
    run = cli.trainer.logger.experiment
    try:
        summary = dict(run.summary)
        run_dir = Path(run.dir).parent  # <save_dir>/wandb/offline-run-*/files → its run folder
    finally:
        wandb.finish()
    assert run_dir.parent == tmp_path / "wb/wandb" and run_dir.name.startswith("offline-run-")
    assert list(run_dir.glob("run-*.wandb")), "no offline run file to sync"
    # an offline run keeps its history in the binary run-*.wandb; the summary holds each key's last value
    metrics = cli.trainer.callback_metrics
    assert summary["train/reward"] == pytest.approx(float(metrics["train/reward"]), abs=1e-6)
    assert summary["val/reward"] == pytest.approx(float(metrics["val/reward"]), abs=1e-6)
    assert folder_clashes(k for k in summary if not k.startswith("_")) == []
    tables = sorted((run_dir / "files/media/table/val").glob("completions_*.table.json"))
    assert len(tables) == 2 and json.loads(tables[0].read_text())["columns"] == COLUMNS
    assert (tmp_path / "wb/config.yaml").is_file()  # Lightning's place for a logger without log_dir: its save_dir


def _mlflow_run(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    return client, runs[0]


def _check_mlflow(cli, tracking_uri: str) -> None:
    client, run = _mlflow_run(tracking_uri)
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("train/reward", "val/reward")
    }
    assert run.info.status == "FINISHED"
    assert_logged(cli, history["train/reward"], history["val/reward"])
    assert "train/rewards/char_accuracy/mean" in run.data.metrics and folder_clashes(run.data.metrics) == []
    completions = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert completions == ["completions/step_000000.md", "completions/step_000002.md"]


def test_mlflow_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
    cli = fit(
        tmp_path,
        "--trainer.logger",
        "lightning.pytorch.loggers.MLFlowLogger",
        "--trainer.logger.tracking_uri",
        "file:./mlruns",
    )
    _check_mlflow(cli, f"file:{tmp_path / 'mlruns'}")
    assert (tmp_path / "mlruns/config.yaml").is_file()  # Lightning's place for a logger without log_dir: its save_dir


def test_mlflow_sqlite_saves_the_config_in_the_root_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact store is ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cli = fit(
        tmp_path, "--trainer.logger", "lightning.pytorch.loggers.MLFlowLogger", "--trainer.logger.tracking_uri", uri
    )
    assert cli.trainer.log_dir is None  # no local folder: Lightning's SaveConfigCallback asserted on this
    _check_mlflow(cli, uri)
    assert (tmp_path / "run/config.yaml").is_file()  # the run's default_root_dir


def test_save_run_config_without_a_log_dir_writes_to_the_root_dir_and_overwrites_only_when_told(tmp_path):
    parser = ArgumentParser()
    parser.add_argument("--x", type=int, default=1)
    broadcast = SimpleNamespace(broadcast=lambda value: value)
    trainer = SimpleNamespace(
        log_dir=None, default_root_dir=str(tmp_path / "root"), is_global_zero=True, strategy=broadcast
    )
    SaveRunConfig(parser, parser.parse_args(["--x", "2"])).setup(trainer, None, "fit")
    assert yaml.safe_load((tmp_path / "root/config.yaml").read_text()) == {"x": 2}
    with pytest.raises(RuntimeError, match="config.yaml exists"):
        SaveRunConfig(parser, parser.parse_args(["--x", "3"])).setup(trainer, None, "fit")
    SaveRunConfig(parser, parser.parse_args(["--x", "3"]), overwrite=True).setup(trainer, None, "fit")
    assert yaml.safe_load((tmp_path / "root/config.yaml").read_text()) == {"x": 3}
    trainer.log_dir = str(tmp_path / "logs")  # a logger with a folder: Lightning's own behaviour, nothing in the root
    SaveRunConfig(parser, parser.parse_args(["--x", "4"]), overwrite=True).setup(trainer, None, "fit")
    assert yaml.safe_load((tmp_path / "logs/config.yaml").read_text()) == {"x": 4}
    assert yaml.safe_load((tmp_path / "root/config.yaml").read_text()) == {"x": 3}
