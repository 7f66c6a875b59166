"""Fault injection against real CLI runs in subprocesses (issue 20): external SIGTERM/SIGINT, SIGKILLs with
resumes compared to an uninterrupted run, a DDP rank hung inside its reward.

Minutes, so behind a marker: ``pytest -m faults --faults`` (the fast in-process versions are in test_safe_ends.py).
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "PYTHONWARNINGS": "ignore"}


def cli(root: Path, *extra: str, steps: int = 12) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lit_gspo.tools.main",
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "4",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "8",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "6",
        *extra,
    ]


def train_steps(root: Path) -> list[int]:
    """Every RL step with a train row, over all metrics files (a step logged twice appears twice)."""
    steps = []
    for f in sorted(root.glob("**/metrics.csv")):
        with open(f) as fh:
            steps += [int(r["step"]) for r in csv.DictReader(fh) if r.get("train/reward")]
    return steps


def launch(cmd: list[str], env: dict = ENV, new_session: bool = False) -> subprocess.Popen:
    """A CLI run in the background: its stderr kept for the assertions, ``new_session`` its own process group."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def wait_for(condition, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_cli_run_saves_exits_non_zero_and_resumes_without_losing_a_step(tmp_path, signum, code):
    proc = launch(cli(tmp_path))
    try:
        wait_for(lambda: len(train_steps(tmp_path)) >= 2, proc)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert proc.returncode == code, err[-3000:]
    assert f"resume with --ckpt_path {last}" in err
    assert not (tmp_path / "hf_model").exists()
    done = subprocess.run(
        cli(tmp_path, "--ckpt_path", str(last)), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(train_steps(tmp_path)) == list(range(12))  # every step once: none lost, none repeated
    assert (tmp_path / "hf_model" / "model.safetensors").exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_k1_run_signalled_as_a_process_group_saves_leaves_no_worker_and_resumes(tmp_path, signum, code):
    """Asynchronous rollouts (issue 38), the signal sent to the whole process group as a terminal's Ctrl-C or a
    scheduler's SIGTERM is: the trainer finishes the step, saves, exits; the forked worker ignores SIGINT and ends
    after its rollout on SIGTERM, so no process of the group outlives the trainer; the resume loses no step."""
    extra = ("--model.generation.max_staleness", "1", "--model.generation.async_worker", "process")
    proc = launch(cli(tmp_path, *extra), new_session=True)
    try:
        wait_for(lambda: len(train_steps(tmp_path)) >= 2, proc)
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, err[-3000:]
    assert _group_ends(proc.pid, within=10), "the rollout worker outlived the trainer"
    last = tmp_path / "checkpoints" / "last.ckpt"
    done = subprocess.run(
        cli(tmp_path, *extra, "--ckpt_path", str(last)), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(train_steps(tmp_path)) == list(range(12))  # every step once: none lost, none repeated


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_ends(pgid: int, within: float) -> bool:
    """Whether every process of group ``pgid`` is gone within ``within`` seconds."""
    deadline = time.monotonic() + within
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _group_alive(pgid)


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry.name))
    return alive


def test_ddp_with_a_rank_hung_in_its_reward_ends_on_a_second_sigterm(tmp_path):
    """Rank 1 never returns from its reward; rank 0 waits in a collective, where Python signal handlers cannot run.
    Before: SIGTERM did not end it (Lightning's handler blocked in a broadcast), 638 s until SIGKILL."""
    cmd = cli(
        tmp_path,
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--data.prompts_per_step",
        "4",
        "--model.rewards",
        "[{class_path: fault_helpers.StuckOnRank1}]",
    )
    marker = tmp_path / "rank1_hung"
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "FAULT_MARKER": str(marker)}
    proc = launch(cmd, env, new_session=True)
    try:
        wait_for(marker.exists, proc)  # after the first validation, rank 1 hangs in the first training step's reward
        time.sleep(5)  # and rank 0 waits for it in a collective
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)
        assert proc.poll() is None  # blocked: the first signal waits for the step to end
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "received twice and the run is blocked" in err
    assert _group_ends(proc.pid, within=10), "rank 1 outlived rank 0"


def test_faults_benchmark_reports_exact_resumes(tmp_path):
    """benchmarks/faults.py: random SIGKILLs (and kills inside a checkpoint and an export write), each resumed."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/faults.py"),
            "--kills",
            "2",
            "--steps",
            "6",
            "--root",
            str(tmp_path),
            "--seed",
            "1",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "4 kills, 4 exact resumes, 0 lost" in out.stdout


def test_ddp_with_a_rank_hung_in_its_reward_fails_after_the_process_group_timeout(tmp_path):
    """With ``--trainer.strategy.timeout`` short, rank 0's collective times out: the run fails with a hint, and the
    hung rank it launched does not outlive it."""
    marker = tmp_path / "rank1_hung"
    cmd = cli(
        tmp_path,
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "lightning.pytorch.strategies.DDPStrategy",
        "--trainer.strategy.timeout",
        "0:00:15",
        "--data.prompts_per_step",
        "4",
        "--model.rewards",
        "[{class_path: fault_helpers.StuckOnRank1}]",
    )
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "FAULT_MARKER": str(marker)}
    proc = launch(cmd, env, new_session=True)
    try:
        wait_for(marker.exists, proc)
        start = time.monotonic()
        _, err = proc.communicate(timeout=120)
        assert time.monotonic() - start < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "a collective timed out: another rank is stuck or died" in err, err[-3000:]
    assert _group_ends(proc.pid, within=10), "rank 1 outlived rank 0"


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_validating_stops_at_once_not_after_the_batch(tmp_path, signum, code):
    """``lit-gspo validate``/``test`` and the validation a fit runs before its first update have nothing to save: a
    stop signal ends them at once with 128 + the signal. Before, SIGTERM waited for the validation batch to end (minutes
    on SmolLM2). Here the reward of the first scoring sleeps for 120 s."""
    marker = tmp_path / "scoring"
    (tmp_path / "slow_reward.py").write_text(
        "import time\nfrom pathlib import Path\n\n\n"
        f"def slow(completions, **kwargs):\n    Path({str(marker)!r}).touch()\n    time.sleep(120)\n"
        "    return [0.0] * len(completions)\n"
    )
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    proc = launch(cli(tmp_path / "run", "--model.rewards", "[slow_reward.slow]"), env)
    try:
        wait_for(marker.exists, proc)
        start = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert time.monotonic() - start < 30
    assert f"{signal.Signals(signum).name} received while validating: stopped" in err
    assert not (tmp_path / "run" / "hf_model").exists()
