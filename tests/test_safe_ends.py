"""Safe ends (issue 20): SIGINT/SIGTERM save and exit non-zero, rows before checkpoints, the export swapped in whole
and written by a resume that finds it missing, stale temporaries cleaned, one run per directory.

In-process fits of a few RL steps; the same cases as real subprocesses (external signals, SIGKILLs) are in
tests/test_faults.py behind ``-m faults --faults``.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_gspo.lightning.callbacks.run_lock import LOCK_NAME, RunLock, RunLockedError
from lit_gspo.lightning.callbacks.signals import RunInterrupted
from lit_gspo.lightning.callbacks.temporaries import clean_stale_temporaries
from lit_gspo.lightning.checkpoint_io import AtomicCheckpointIO
from lit_gspo.runtime.files import written_aside
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]


def args(root: Path, steps: int, *extra: str) -> list[str]:
    """The quickstart (checkpointing off), 2 minibatches per RL step, validation every step: 3 RL steps in seconds."""
    return [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "1",
        "--data.num_train",
        "24",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        "--model.update.num_minibatches",
        "2",
        "--model.optimizer.lr",
        "0.01",
        "--model.rewards",
        '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: "[0-4].*"}}]',
        *extra,
    ]


class SendSignal(Callback):
    """Sends ``signum`` to this process ``times`` times at the start of RL step ``at`` (mid-run, before its update)."""

    def __init__(self, at: int, signum: int, times: int = 1):
        self.at, self.signum, self.times = at, signum, times

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.rl_step == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def fit(root: Path, steps: int, *extra: str, ckpt_path=None, callbacks=()):
    cli = cli_main(args(root, steps, *extra), run=False)
    cli.trainer.callbacks.extend(callbacks)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli


def rows(root: Path) -> dict[tuple[int, str], str]:
    out = {}
    for f in sorted(root.glob("**/metrics.csv")):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                for key, value in row.items():
                    if key != "step" and value not in (None, "") and not key.startswith("time/"):
                        out[(int(row["step"]), key)] = value
    return out


def test_sigterm_saves_a_checkpoint_exits_143_and_the_resume_is_exactly_the_uninterrupted_run(tmp_path, capsys):
    """Saved into ModelCheckpoint's ``last.ckpt`` (checkpoints every 100 steps: none of its own here), where
    ``--ckpt_path last`` finds it."""
    ckpt = ("--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "100")
    straight = fit(tmp_path / "straight", 3)  # 3 RL steps × 2 optimiser steps
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path / "split", 3, *ckpt, callbacks=[SendSignal(1, signal.SIGTERM)])
    assert exit_info.value.code == 143
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    assert f"resume with --ckpt_path {last}" in capsys.readouterr().err
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 2 and checkpoint["rl_step"] == 2  # RL step 1 finished, then saved
    assert not (tmp_path / "split" / LOCK_NAME).exists()  # released on the way out
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)  # handlers restored

    resumed = fit(tmp_path / "split", 3, *ckpt, ckpt_path="last")
    for name, value in straight.model.policy.state_dict().items():
        assert torch.equal(value, resumed.model.policy.state_dict()[name]), name
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "split")
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert (tmp_path / "split" / "hf_model" / "config.json").exists()


def test_sigint_saves_a_checkpoint_even_with_checkpointing_off_and_exits_130(tmp_path, capsys):
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN when pytest runs in the background
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, 3, callbacks=[SendSignal(0, signal.SIGINT)])  # the quickstart: enable_checkpointing false
    assert exit_info.value.code == 130
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 1
    err = capsys.readouterr().err
    assert "SIGINT received: finishing this RL step" in err and f"resume with --ckpt_path {last}" in err
    assert signal.getsignal(signal.SIGINT) is before  # the handler the run found is put back


def test_a_second_signal_stops_at_once_without_saving(tmp_path):
    with pytest.raises(RunInterrupted) as exit_info:
        fit(tmp_path, 3, callbacks=[SendSignal(0, signal.SIGINT, times=2)])
    assert exit_info.value.code == 130 and "second time" in str(exit_info.value)
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_each_steps_metrics_row_is_on_disk_before_its_checkpoint(tmp_path, monkeypatch):
    """Lightning logs a step's row after ``on_train_batch_end``, where ModelCheckpoint saves: a kill in between lost it."""
    seen = []
    write = AtomicCheckpointIO._write

    def _write(self, checkpoint, f):
        steps = {k[0] for k in rows(tmp_path) if k[1] == "train/reward"}
        seen.append((checkpoint["rl_step"] - 1, steps))
        return write(self, checkpoint, f)

    monkeypatch.setattr(AtomicCheckpointIO, "_write", _write)
    fit(tmp_path, 2, "--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "1")
    assert [step for step, _ in seen] == [0, 1]
    for step, on_disk in seen:
        assert step in on_disk, f"the checkpoint of RL step {step} was written before its metrics row"
    files = sorted(tmp_path.glob("**/metrics.csv"))
    with open(files[-1]) as fh:
        logged = [row["step"] for row in csv.DictReader(fh) if row.get("train/reward")]
    assert logged == ["0", "1"]  # each row once


def test_a_resume_continues_the_runs_metrics_file_with_every_step_once(tmp_path, monkeypatch):
    """Before: a resumed run wrote a new lightning_logs/version_N, its metrics split over two files (issue 19). A run
    "killed" after RL step 2 was logged but before its checkpoint (resumed from step 1's checkpoint) logs step 2 again:
    the file is cut back to the checkpoint's rows first, so every step is there once, with the same values. Resuming
    the finished run changes nothing (its final validation row, logged after its last checkpoint, is kept)."""
    copies = {}
    save = AtomicCheckpointIO.save_checkpoint

    def save_and_keep(self, checkpoint, path, storage_options=None):
        save(self, checkpoint, path, storage_options)
        copies[checkpoint["rl_step"]] = Path(path).with_name(f"rl_step_{checkpoint['rl_step']}.ckpt")
        copies[checkpoint["rl_step"]].write_bytes(Path(path).read_bytes())

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", save_and_keep)
    ckpt = ("--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "1")
    fit(tmp_path, 3, *ckpt)  # 3 RL steps, a checkpoint after each

    def lines() -> list[str]:
        files = sorted(tmp_path.glob("**/metrics.csv"))
        assert len(files) == 1, files
        return files[0].read_text().splitlines()

    def completions() -> list[str]:  # issue 28 finding 8: completions.csv is cut back with metrics.csv
        (path,) = tmp_path.glob("**/completions.csv")
        return path.read_text().splitlines()

    whole, values, shown = lines(), rows(tmp_path), completions()
    assert sorted({int(line.split(",")[0]) for line in shown[1:]}) == [0, 1, 2, 3]
    cli_main(
        ["fit", *args(tmp_path, 3, *ckpt), "--ckpt_path", str(copies[2])]
    )  # as if killed before step 2's checkpoint
    after = lines()
    assert completions() == shown  # the validation of step 3 logged once, as the first time
    with open(next(tmp_path.glob("**/metrics.csv"))) as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh) if r.get("train/reward")]
    assert steps == [0, 1, 2] and len(after) == len(whole)  # each row once, in one file
    assert rows(tmp_path) == values  # the steps logged again have the values of the first time
    cli_main(["fit", *args(tmp_path, 3, *ckpt), "--ckpt_path", str(copies[3])])  # the finished run
    assert len(lines()) == len(whole) and rows(tmp_path) == values


def _export_bytes(path: Path) -> bytes:
    return (path / "model.safetensors").read_bytes()


def test_the_export_is_swapped_in_whole_a_failed_export_leaves_the_previous_one(tmp_path):
    from lit_gspo.lightning.export import save_hf_model
    from lit_gspo.lightning.module import RLModule
    from lit_gspo.rl.config import Policy

    module = RLModule(
        policy=Policy(config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}, kl_to_ref=False)
    )
    export = tmp_path / "hf_model"
    save_hf_model(module, export)
    before = _export_bytes(export)
    with torch.no_grad():
        next(module.policy.parameters()).add_(1.0)

    def broken(*a, **k):
        raise OSError("disk full")

    module.tokenizer.save_pretrained = broken  # fails after the weights are written
    with pytest.raises(OSError, match="disk full"):
        save_hf_model(module, export)
    assert _export_bytes(export) == before, "a failed export overwrote the previous one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]


def _in_a_child(body) -> int:
    """Run ``body()`` in a forked child (no interpreter start-up); its exit status as ``subprocess`` reports it."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            body()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_a_kill_inside_the_export_leaves_no_partial_export(tmp_path):
    """A process SIGKILLed inside ``written_aside``: the old directory stays whole; its leftovers are cleaned later."""
    target = tmp_path / "hf_model"
    target.mkdir()
    (target / "config.json").write_text("old")

    def body():
        with written_aside(target) as tmp:
            (tmp / "config.json").write_text("new")
            os.kill(os.getpid(), signal.SIGKILL)

    assert _in_a_child(body) == -signal.SIGKILL
    assert (target / "config.json").read_text() == "old"
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".hf_model.tmp-")]
    assert len(leftovers) == 1
    assert clean_stale_temporaries([tmp_path]) == leftovers and not leftovers[0].exists()
    with written_aside(target) as tmp:
        (tmp / "config.json").write_text("new")
    assert (target / "config.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]


def test_a_resume_of_a_finished_run_writes_a_missing_or_empty_export(tmp_path):
    """Killed after the final checkpoint, before (or during) the export: the resume finds max_steps reached."""
    ckpt = ("--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "2")
    fit(tmp_path, 2, *ckpt)
    export = tmp_path / "hf_model"
    weights = _export_bytes(export)
    for damage in ("missing", "empty"):
        for f in export.iterdir():
            f.unlink()
        if damage == "missing":
            export.rmdir()
        fit(tmp_path, 2, *ckpt, ckpt_path="last")
        assert _export_bytes(export) == weights, damage


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_writers_are_removed_at_start_live_ones_kept(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(parents=True)
    dead, alive = _dead_pid(), os.getppid()
    stale = [
        checkpoints / f".last.ckpt.tmp-{dead}",
        tmp_path / f".hf_model.tmp-{dead}",
        tmp_path / f".hf_model.old-{dead}",
    ]
    stale[0].write_bytes(b"half a checkpoint")
    stale[1].mkdir()
    stale[2].mkdir()
    live = checkpoints / f".last.ckpt.tmp-{alive}"
    live.write_bytes(b"being written")
    with pytest.raises(SystemExit):  # only the start matters
        fit(tmp_path, 6, callbacks=[SendSignal(0, signal.SIGINT, times=2)])
    assert not any(p.exists() for p in stale)
    assert live.exists()


def test_a_second_run_in_the_same_directory_is_refused_naming_the_first(tmp_path):
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child holds the lock until killed
        try:
            RunLock(tmp_path).acquire()
            os.write(ready_w, b"x")
            time.sleep(120)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(RunLockedError, match=rf"in use by another run \(PID {pid} on .*default_root_dir"):
            fit(tmp_path, 2)
        assert not (tmp_path / "hf_model").exists()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # the holder died without releasing: its lock is taken over
    RunLock(tmp_path).acquire().release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_file_of_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(f'{{"pid": {_dead_pid()}, "host": "{os.uname().nodename}", "argv": ["old"]}}')
    lock = RunLock(tmp_path).acquire()
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    lock.release()


def test_the_lock_is_released_when_a_fit_fails(tmp_path, monkeypatch):
    from lit_gspo.lightning.module import RLModule

    def boom(self, *a, **k):
        raise RuntimeError("reward server down")

    monkeypatch.setattr(RLModule, "training_step", boom)
    with pytest.raises(RuntimeError, match="reward server down"):
        fit(tmp_path, 2)
    assert not (tmp_path / LOCK_NAME).exists()
    start = time.perf_counter()
    RunLock(tmp_path).acquire().release()
    assert time.perf_counter() - start < 1


def test_run_csv_logger_resumes_into_the_newest_version_keeping_its_rows(tmp_path):
    """The Python API's way to the same: ``RunCSVLogger(root, resume=True)``; a fresh run still gets a new version."""
    from lit_gspo.lightning.metrics_file import RunCSVLogger, logged_before

    first = RunCSVLogger(tmp_path)
    first.log_metrics({"train/reward": 0.5}, step=0)
    first.log_metrics({"train/reward": 0.6}, step=1)
    first.save()
    resumed = RunCSVLogger(tmp_path, resume=True)
    assert resumed.version == 0
    assert resumed.experiment.truncate(logged_before(1)) == 1  # step 1's row came after the checkpoint of 1 step
    resumed.log_metrics({"train/reward": 0.7, "val/reward": 0.1}, step=1)  # a new column: the header grows
    resumed.save()
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as fh:
        assert [(r["step"], r["train/reward"], r["val/reward"]) for r in csv.DictReader(fh)] == [
            ("0", "0.5", ""),
            ("1", "0.7", "0.1"),
        ]
    assert RunCSVLogger(tmp_path).version == 1
