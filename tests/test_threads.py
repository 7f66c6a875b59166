"""Threads lit_gspo starts run on the accelerator device of the thread that started them.

An accelerator's current device is per thread and a new thread starts on device 0, so under DDP (one GPU a rank) a
thread started without care samples, captures graphs and scores on GPU 0 on every rank. These tests stand in a
per-thread fake for ``torch.accelerator`` (no GPU here) and read the device inside each kind of thread lit_gspo
starts: the rollout worker, a reward function's timeout, the async rewards' event loop.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lit_gspo.rl.collect.async_rollouts import ThreadRolloutWorker
from lit_gspo.rl.rewards import reward_set
from lit_gspo.rl.rewards.reward_set import call_with_timeout, run_coroutine

RANK_DEVICE = 3


class PerThreadAccelerator:
    """``torch.accelerator``'s device setting as CUDA keeps it: per thread, 0 in a thread that set none."""

    def __init__(self):
        self.local = threading.local()

    def current_device_index(self) -> int:
        return getattr(self.local, "index", 0)

    def set_device_index(self, index: int) -> None:
        self.local.index = index


@pytest.fixture
def accelerator(monkeypatch):
    fake = PerThreadAccelerator()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_device_index", fake.current_device_index)
    monkeypatch.setattr(torch.accelerator, "set_device_index", fake.set_device_index)
    fake.set_device_index(RANK_DEVICE)  # what Lightning does in the trainer's thread of rank 3
    return fake


def in_a_plain_thread(fn):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(fn()))
    thread.start()
    thread.join()
    return seen[0]


def test_the_fake_is_per_thread(accelerator):
    """What the tests below guard against: a thread started plainly is on device 0."""
    assert torch.accelerator.current_device_index() == RANK_DEVICE
    assert in_a_plain_thread(torch.accelerator.current_device_index) == 0


def test_the_rollout_worker_samples_on_the_trainers_device(accelerator):
    def sample(policy, rows, state):
        return torch.accelerator.current_device_index(), {}

    worker = ThreadRolloutWorker(sample, nn.Linear(2, 2), poll_s=0.01)
    worker.start()
    try:
        worker.submit([0])
        assert worker.get().rollout == RANK_DEVICE
    finally:
        worker.stop()


def test_a_reward_with_a_timeout_scores_on_the_callers_device(accelerator):
    assert call_with_timeout(torch.accelerator.current_device_index, timeout_s=30) == RANK_DEVICE


def test_async_rewards_run_on_the_device_of_the_first_caller(accelerator, monkeypatch):
    monkeypatch.setattr(reward_set, "_loop", None)  # this test's loop, started from this thread

    async def device():
        return torch.accelerator.current_device_index()

    assert run_coroutine(device()) == RANK_DEVICE
    reward_set._loop.call_soon_threadsafe(reward_set._loop.stop)
