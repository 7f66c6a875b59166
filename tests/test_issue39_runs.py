"""Issue 39: one run, one directory, one metrics file (``lit_gspo/lightning/run_dir.py``, ``run_lock.py``), and
``lit-gspo eval`` of a model without saved run settings scores only with what the command line names."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_gspo.lightning import run_dir
from lit_gspo.tools.main import main

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model.policy.warm_start.steps",
    "0",
    "--model.validation.every_n_steps",
    "0",
    "--data.num_train",
    "32",
    "--data.num_val",
    "4",
    "--data.prompts_per_step",
    "4",
    "--model.generation.num_generations",
    "4",
    "--model.generation.max_new_tokens",
    "4",
    "--trainer.enable_progress_bar",
    "false",
]


def run(command: str, root: Path, *extra: str) -> None:
    main(
        [
            command,
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.default_root_dir",
            str(root),
            *TINY,
            *extra,
        ]
    )


def refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


def files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


# ------------------------------------------------------------------------------------------- which metrics folder
def test_a_resume_continues_the_folder_its_checkpoint_names_not_the_newest(tmp_path):
    """Before: the newest ``version_N`` (one a ``validate`` or a refused fit had created since)."""
    logs = tmp_path / "lightning_logs"
    for name, header in (("version_0", "epoch,step,train/reward,val/reward\n"), ("version_1", "step,val/reward\n")):
        (logs / name).mkdir(parents=True)
        (logs / name / "metrics.csv").write_text(header)
    (tmp_path / "checkpoints").mkdir()
    torch.save({run_dir.LOG_VERSION_KEY: "version_0"}, tmp_path / "checkpoints" / "last.ckpt")
    assert run_dir.resumed_log_version(tmp_path, "last") == "version_0"
    torch.save({}, tmp_path / "checkpoints" / "last.ckpt")  # a checkpoint of an earlier version: the fit's folder
    assert run_dir.resumed_log_version(tmp_path, "last") == "version_0"
    assert run_dir.resumed_log_version(tmp_path, None) is None  # a fresh fit: a new folder
    assert run_dir.default_logger(
        "validate", str(tmp_path), str(tmp_path / "checkpoints" / "last.ckpt")
    ).log_dir == str(logs / "validate")


@pytest.mark.slow
def test_fit_validate_test_then_resume_keeps_one_metrics_file_with_each_step_once(tmp_path):
    root = tmp_path / "q"
    run("fit", root, "--trainer.max_steps", "2")
    ckpt = root / "checkpoints" / "last.ckpt"
    run("validate", root, "--ckpt_path", str(ckpt))
    run("test", root, "--ckpt_path", str(root / "hf_model"))
    run("fit", root, "--trainer.max_steps", "3", "--ckpt_path", "last")
    logs = root / "lightning_logs"
    assert sorted(p.name for p in logs.iterdir()) == ["test", "validate", "version_0"]  # no version_N but the fit's
    with open(logs / "version_0" / "metrics.csv", newline="") as f:
        train_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")]
    assert train_steps == [0, 1, 2]  # each RL step once, in the run's one file
    for name, key in (("validate", "val/reward"), ("test", "test/reward")):
        with open(logs / name / "metrics.csv", newline="") as f:
            assert [r[key] for r in csv.DictReader(f) if r.get(key)], name
    assert torch.load(ckpt, map_location="cpu", weights_only=True)[run_dir.LOG_VERSION_KEY] == "version_0"


# ------------------------------------------------------------------------------------------- the run lock
@pytest.fixture
def locked(tmp_path):
    """``tmp_path / "busy"`` locked by another live process (a fit that has no checkpoint yet)."""
    root = tmp_path / "busy"
    ready = tmp_path / "ready"
    root.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (  # flock as RunLock takes it, without importing torch
                "import fcntl, json, os, socket, time; "
                f"fd = os.open({str(root / '.lit_gspo.lock')!r}, os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
                "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'argv': ['lit-gspo', 'fit']}).encode()); "
                f"open({str(ready)!r}, 'w').close(); time.sleep(120)"
            ),
        ]
    )
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.1)
        assert ready.exists()
        yield root
    finally:
        holder.kill()
        holder.wait()


def test_a_resume_into_a_directory_another_fit_holds_is_refused_at_once_leaving_nothing(locked, capsys):
    before = files(locked)
    err = refused(
        capsys,
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(locked),
        *TINY,
        "--trainer.max_steps",
        "1",
        "--ckpt_path",
        "last",
    )
    assert f"{locked} is in use by another run (PID" in err
    assert files(locked) == before == [".lit_gspo.lock"]


@pytest.mark.slow
def test_a_second_fresh_fit_into_a_locked_directory_goes_to_its_own_leaving_nothing_in_the_first(locked, capsys):
    """Before: the lock came at ``trainer.fit``, after the warm start and the step-0 validation, which left a
    ``version_1`` in the first run's directory (captured later by its resume)."""
    run("fit", locked, "--trainer.max_steps", "1")
    out = capsys.readouterr().out
    other = locked.parent / "busy-2"
    assert f"fit: {locked} is in use by another fit (PID" in out and f"this run writes to {other}" in out
    assert files(locked) == [".lit_gspo.lock"]
    assert (other / "checkpoints" / "last.ckpt").is_file() and not (other / ".lit_gspo.lock").exists()


def lock_held(root: Path) -> bool:
    """Whether a live holder has the run lock of ``root`` (a flock of another open file fails)."""
    import fcntl
    import os

    from lit_gspo.lightning.callbacks.run_lock import LOCK_NAME

    if not (root / LOCK_NAME).exists():
        return False
    fd = os.open(root / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def python_api(root: Path, *extra: str):
    """A Trainer, an RLModule and its data as a Python user has them (built by the CLI, nothing run)."""
    from lit_gspo.lightning.cli import cli_main

    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.default_root_dir", str(root), *TINY]
    return cli_main([*args, "--trainer.max_steps", "1", *extra], run=False)


def test_python_validate_before_fit_takes_the_run_lock_and_keeps_it_for_the_fit(tmp_path):
    """``trainer.validate(module)`` writes the run's ``lightning_logs/version_0``: it takes the lock (before: only the
    fit did, so another run could start in the directory between the two) and the fit keeps it until it ends."""
    cli = python_api(tmp_path)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert lock_held(tmp_path)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not lock_held(tmp_path) and (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_python_validate_into_a_directory_another_run_holds_is_refused_writing_nothing(locked, capsys):
    """A validate that would write a ``version_N`` into a locked run's directory is refused; the CLI's ``validate``
    (its own ``lightning_logs/validate/``, beside the run) takes no lock."""
    from lit_gspo.lightning.callbacks.run_lock import RunLockedError

    cli = python_api(locked)
    with pytest.raises(RunLockedError, match="is in use by another run"):
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert files(locked) == [".lit_gspo.lock"]
    run("validate", locked)
    assert "lightning_logs/validate/metrics.csv" in files(locked)
    assert all(f.startswith("lightning_logs/validate/") for f in files(locked) if f != ".lit_gspo.lock")


# ------------------------------------------------------------------------------------------- eval without a run
@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """An ``hf_model/`` saved from Python: no ``lit_gspo_config.yaml`` beside it, no run around it."""
    from lit_gspo.models.loading import load_policy

    path = tmp_path_factory.mktemp("bare") / "hf_model"
    policy, tokenizer = load_policy(
        "tiny-llama", config_overrides={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}
    )
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_eval_of_a_model_without_run_settings_is_refused_unless_the_task_and_rewards_are_named(
    bare_model, capsys, tmp_path
):
    """Before: scored on the default task (arithmetic) with ExactMatch, silently."""
    err = refused(capsys, "eval", "--ckpt", str(bare_model), "--samples", "0")
    assert err.startswith(f"error: --ckpt {bare_model} has no saved run settings")
    assert "--config" in err and "--data.train_source" in err and "--model.rewards" in err
    err = refused(capsys, "eval", "--ckpt", str(bare_model), "--data.train_source", "reversal")
    assert "the rewards" in err and "--model.rewards" in err and "--data.train_source TASK" not in err
    output = tmp_path / "e.json"
    main(
        [
            "eval",
            "--ckpt",
            str(bare_model),
            "--data.train_source",
            "reversal",
            "--data.num_val",
            "4",
            "--data.num_train",
            "8",
            "--data.task_kwargs",
            "{min_length: 3, max_length: 3}",
            "--model.rewards",
            "[lit_gspo.rl.rewards.CharAccuracy]",
            "--samples",
            "0",
            "--output",
            str(output),
        ]
    )
    result = json.loads(output.read_text())
    assert result["data"] == "reversal" and result["rewards"] == ["char_accuracy"] and len(result["per_prompt"]) == 4
