"""Checkpoints: N steps + resume N steps is the 2N-step run exactly; a kill during a write leaves the previous one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]


def args(root: Path, steps: int, *extra: str) -> list[str]:
    """GSPO, 2 minibatches per RL step (2 optimiser steps, randperm from the global RNG, off-policy ratios),
    a StepLR schedule, validation every step, ``last.ckpt`` every RL step."""
    return [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_checkpointing",
        "true",
        "--checkpoint_every_n_steps",
        "1",
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
        "--model.lr_scheduler",
        "torch.optim.lr_scheduler.StepLR",
        "--model.lr_scheduler.step_size",
        "1",
        "--model.lr_scheduler.gamma",
        "0.9",
        "--model.rewards",
        '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: "[0-4].*"}}]',
        *extra,
    ]


def fit(root: Path, steps: int, *extra: str, ckpt_path: str | None = None):
    cli = cli_main(args(root, steps, *extra), run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli


def rows_by_step(files: list[Path]) -> dict[tuple[int, str], float]:
    import csv

    out = {}
    for f in files:
        with open(f) as fh:
            for row in csv.DictReader(fh):
                for key, value in row.items():
                    if key != "step" and value not in (None, "") and not key.startswith("time/"):
                        out[(int(row["step"]), key)] = value  # the CSV text: exact, and nan == nan
    return out


def _find(tree, key):
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            found = _find(value, key)
            if found is not None:
                return found
    return None


BF16_PARAMS = ("--trainer.precision", "bf16-mixed", "--model.update.param_dtype", "bf16")
#: the adaptive entropy bonus' coefficient moves every optimiser step (H* above any entropy here: it grows)
ADAPTIVE_ENTROPY = ("--model.update.entropy_coef", "0.01", "--model.update.entropy_target", "100")


@pytest.mark.parametrize(
    "optimizer, extra",
    [
        ("torch.optim.AdamW", ()),
        ("bitsandbytes.optim.AdamW8bit", ()),
        ("torch.optim.AdamW", BF16_PARAMS),
        ("torch.optim.AdamW", ADAPTIVE_ENTROPY),
        ("torch.optim.AdamW", ("--model.validation.num_generations", "2")),
    ],
    ids=["AdamW", "AdamW8bit", "AdamW-bf16-params", "AdamW-adaptive-entropy-bonus", "AdamW-sampled-validation"],
)
def test_n_steps_then_resume_n_steps_is_exactly_the_2n_step_run(tmp_path, optimizer, extra):
    """24 rows, 4 per step: the resume lands mid-epoch, so data position, RNG, optimiser and schedule all matter. With
    the update on bf16 casts (``update.param_dtype``) the checkpoint holds the fp32 master weights; with an adaptive
    entropy bonus it holds the coefficient and the last entropy measured. A sampled validation draws alike after the
    resume (its own stream)."""
    opt = ["--model.optimizer", optimizer, *extra]
    straight = fit(tmp_path / "straight", 3, *opt)  # 3 RL steps = 6 optimiser steps
    fit(tmp_path / "split", 2, *opt)  # 2 RL steps, last.ckpt after the second
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)  # loadable without unpickling arbitrary objects
    assert checkpoint["global_step"] == 2  # RL steps: one Lightning step each, whatever their optimiser steps
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "rng_states"} <= set(checkpoint)
    assert {"torch", "numpy", "python", "refill"} <= set(checkpoint["rng_states"][0])
    assert _find(checkpoint["loops"], "position") == 8  # 2 steps × 4 prompts handed out this epoch
    assert {v.dtype for v in checkpoint["state_dict"].values() if v.is_floating_point()} == {torch.float32}
    if "8bit" in optimizer:
        state = checkpoint["optimizer_states"][0]["state"]
        assert any(v.dtype == torch.uint8 for s in state.values() for v in _find_tensors(s))
    resumed = fit(tmp_path / "split", 3, *opt, ckpt_path="last")

    for name, value in straight.model.policy.state_dict().items():
        assert torch.equal(value, resumed.model.policy.state_dict()[name]), name
    a = rows_by_step(sorted((tmp_path / "straight").glob("**/metrics.csv")))
    b = rows_by_step(sorted((tmp_path / "split").glob("**/metrics.csv")))
    assert any(key[1] == "train/loss" and key[0] >= 2 for key in b), "the resumed run logged nothing"
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _find_tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _find_tensors(value)


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path):
    """The 2nd checkpoint write stalls half-way (tests/dist_run.py --crash_at_save 2) and the process is SIGKILLed."""
    root = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "tests/dist_run.py"),
        "--crash_at_save",
        "2",
        str(tmp_path / "out"),
        "--",
        *args(root, 4),
    ]
    (tmp_path / "out").mkdir()
    marker = tmp_path / "out" / "crashing"
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},  # as the test process (conftest)
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, f"the run ended before the stalled save: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the second checkpoint write never started"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    checkpoints = root / "checkpoints"
    partial = [p for p in checkpoints.iterdir() if ".tmp-" in p.name]
    assert partial, "the killed write should have left its temporary file"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["last.ckpt"]
    checkpoint = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 1  # the first save; the second (RL step 2) never completed
    resumed = fit(root, 3, ckpt_path="last")
    assert resumed.trainer.global_step == 3
    newest = max(root.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    resumed_steps = sorted({k[0] for k in rows_by_step([newest]) if k[1] == "train/loss"})
    assert resumed_steps == [1, 2]  # RL steps after the checkpoint (RL step 0 was before it)
