"""Reward functions and engines for the tests' runs, faults included (importable by the subprocess runs: tests/ is on
their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


class StuckOnRank1:
    """Scores like ``FormatReward("[0-4].*")`` but hangs for good on rank 1 from its ``stuck_from``-th call (a reward
    server that stopped answering)."""

    def __init__(self, stuck_from: int = 2):
        self.stuck_from, self.calls = stuck_from, 0

    def __call__(self, prompts, completions, **columns):
        self.calls += 1
        if os.environ.get("LOCAL_RANK", "0") == "1" and self.calls >= self.stuck_from:
            if os.environ.get("FAULT_MARKER"):
                open(os.environ["FAULT_MARKER"], "w").close()
            while True:
                time.sleep(1)
        return [float(c[:1] in "01234" and len(c) > 0) for c in completions]


class RaisesAfterFirstCall:
    """A reward whose server goes down after the run's first scoring (the validation before the first update)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts, completions, **columns):
        self.calls += 1
        if self.calls > 1:
            raise ConnectionError(f"reward server down (rank {os.environ.get('LOCAL_RANK', '0')})")
        return [0.0] * len(completions)


class AlwaysRaises:
    """A reward whose server is down, on every rank: every call raises."""

    def __call__(self, prompts, completions, **columns):
        raise ConnectionError(f"reward server down (rank {os.environ.get('LOCAL_RANK', '0')})")


class RecordsSamples:
    """Scores 0 and appends what each call scored to ``<directory>/rank<r>.jsonl``: the prompts and completions, and a
    draw from torch's default random stream right after the sampling (one stream on two ranks draws alike)."""

    def __init__(self, directory: str):
        self.directory = Path(directory)

    def __call__(self, prompts, completions, **columns):
        record = {"prompts": [str(p) for p in prompts], "completions": [str(c) for c in completions]}
        record["draw"] = torch.rand(()).item()
        with open(self.directory / f"rank{os.environ.get('LOCAL_RANK', '0')}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return [0.0] * len(completions)


class Alternating:
    """1 for every other completion (rows are group-major): nothing to learn, but every group of an even G has a reward
    spread whatever was sampled, so every RL step updates."""

    def __call__(self, prompts, completions, **columns):
        return [float(i % 2) for i in range(len(completions))]


class ConstantOnRank0:
    """Rank 0 scores every completion 0 (no group has a spread: dynamic sampling keeps nothing there); the other ranks
    score 1 for every other completion (every group has one)."""

    def __call__(self, prompts, completions, **columns):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            return [0.0] * len(completions)
        return [float(i % 2) for i in range(len(completions))]


class FirstGroupConstantOnRank0:
    """1 for every other completion, except rank 0's first G = ``group_size`` completions, all 0: rank 0 has a group
    without signal (its rows skipped by the update), the other ranks none."""

    def __init__(self, group_size: int = 4):
        self.group_size = group_size

    def __call__(self, prompts, completions, **columns):
        rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
        return [0.0 if rank0 and i < self.group_size else float(i % 2) for i in range(len(completions))]


from lit_gspo.rl.engines import HFGenerate  # noqa: E402 - the engines after the light reward helpers


class FailsOnRank1(HFGenerate):
    """HFGenerate whose ``fail_at``-th sampling (greedy validation not counted) raises on rank 1 only: a rollout
    worker failing on one rank of a DDP run."""

    def __init__(self, fail_at: int = 2):
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def sample(self, policy, prompt_ids, **kwargs):
        if not kwargs.get("greedy") and os.environ.get("LOCAL_RANK", "0") == "1":
            self.calls += 1
            if self.calls >= self.fail_at:
                raise RuntimeError("sampler out of memory on rank 1")
        return super().sample(policy, prompt_ids, **kwargs)
