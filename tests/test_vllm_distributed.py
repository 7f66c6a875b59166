"""VLLMEngine under DDP and FSDP2 (issue 31): two CPU processes, each with its own vLLM on the trainer's process group
(vLLM's ``external_launcher``), sampling its own prompts from the weights the trainer holds (FSDP2's shards gathered
before every push). Needs vLLM (``pytest -m vllm``, .ci/run's second environment)."""

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: pip install 'lit-gspo[vllm]' (its own environment, see .ci/run)")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
FSDP2 = ("--config", str(ROOT / "configs/scale/fsdp2_cpu.yaml"))
DDP = ("--config", str(ROOT / "configs/scale/ddp_cpu.yaml"))


def run_two_processes(root: Path, subcommand: str, *extra: str, steps: int = 4) -> list[dict]:
    """``lit-gspo <subcommand>`` of the quickstart with the vLLM overlay on 2 processes (4 prompts × 4 each; lr 0.05,
    so that every update moves the weights visibly); it must end cleanly, with no traceback even at exit. Returns
    the rows of metrics.csv."""
    with socket.socket() as s:  # a fresh rendezvous port per run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--config",
        str(ROOT / "configs/engines/vllm.yaml"),
        *extra,
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        "--model.optimizer.lr",
        "0.05",
        "--model.update.mismatch",
        "{}",
        "--model.validation.every_n_steps",
        "2",
    ]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": str(ROOT / "tests"),
    }  # tests/rank_turns.py
    proc = subprocess.run(
        [sys.executable, "-m", "lit_gspo", subcommand, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (
        f"{subcommand} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    (path,) = root.glob("**/metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def fit_two_processes(root: Path, *extra: str, steps: int = 4) -> list[dict]:
    """The training rows of :func:`run_two_processes`'s ``fit``."""
    return [r for r in run_two_processes(root, "fit", *extra, steps=steps) if r.get("train/reward")]


@pytest.mark.parametrize("strategy", [DDP, FSDP2], ids=["ddp", "fsdp2"])
def test_two_processes_each_sample_with_vllm_from_the_weights_the_trainer_holds(tmp_path, strategy):
    """Every rollout's vLLM log-probs are the trainer's fp32 forward's (k3 ≈ 0, as in one process) although every
    update moves the weights: each rank's engine got the full, current weights. A stale, partial or shard-only push
    gives k3 ≥ 1e-6 here. Pushes follow updates; the step after validation pushed the same weights pushes nothing."""
    rows = fit_two_processes(tmp_path, *strategy)
    assert len(rows) == 4
    k3 = [float(r["train/mismatch/k3"]) for r in rows]
    assert max(k3) < 1e-9, k3
    sync = [float(r.get("time/weight_sync_s") or "nan") for r in rows]
    assert sync[1] > 0 and sync[3] > 0 and sync[2] != sync[2], sync  # NaN at step 2: validation pushed its weights
    grad_norm = [float(r["train/grad_norm"]) for r in rows]
    assert all(g > 0 for g in grad_norm), grad_norm


def test_lora_under_fsdp2_pushes_the_merged_gathered_weights(tmp_path):
    """LoRA under FSDP2: each adapted layer's W + ΔW from gathered shards, and the run exports its merged model."""
    rows = fit_two_processes(tmp_path, *FSDP2, "--model.policy.lora", "{r: 4, alpha: 8}")
    k3 = [float(r["train/mismatch/k3"]) for r in rows]
    assert len(k3) == 4 and max(k3) < 1e-9, k3
    assert (tmp_path / "hf_model" / "model.safetensors").exists() and (tmp_path / "hf_adapter").is_dir()


def test_ranks_whose_episodes_take_different_numbers_of_turns_do_not_wait_on_each_other(tmp_path):
    """Multi-turn: one engine call per turn, rank 0's episodes end after 1 reply and rank 1's after 2. Pushes happen
    only where the trainer calls for them, on every rank at once, never inside a turn: a collective there would leave
    rank 1's second turn waiting for a rank 0 that has moved on (the fit hung)."""
    env = "{class_path: rank_turns.TurnsByRank, init_args: {max_turns: 3}}"
    rows = fit_two_processes(tmp_path, *DDP, "--model.environment", env, steps=2)
    assert len(rows) == 2 and float(rows[0]["train/turns"]) == 1.5  # the mean over both ranks' episodes: 1 and 2
    assert max(float(r["train/mismatch/k3"]) for r in rows) < 1e-9


def test_validate_on_two_processes_frees_vllm_before_the_process_group_ends(tmp_path):
    """``lit-gspo validate`` keeps its engine after Lightning's loop; freed only at the process's exit, vLLM tore its
    groups down after the trainer's group had ended (``ValueError: Invalid process group specified`` at exit)."""
    rows = run_two_processes(tmp_path, "validate", *DDP)
    assert [r["val/reward"] for r in rows if r.get("val/reward")] != []
