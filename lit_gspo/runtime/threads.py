"""Threads that run on the device of the thread that started them.

An accelerator's current device is a per-thread setting: it is what ``"cuda"`` means in ``.to("cuda")``, where
``torch.cuda.graph`` captures and ``torch.cuda.current_device()`` points, and a new thread starts on device 0.
Under DDP with one GPU a rank, Lightning sets the trainer thread's device to the rank's; a thread lit_gspo starts
(the rollout worker, a reward function's timeout) would otherwise sample, capture and score on GPU 0 on every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def current_device_index() -> int | None:
    """This thread's current accelerator device, or None without an accelerator."""
    return torch.accelerator.current_device_index() if torch.accelerator.is_available() else None


def on_this_device(target: Callable[[], object]) -> Callable[[], object]:
    """``target`` made to run, in whichever thread calls it, on the current device of the thread calling this."""
    index = current_device_index()

    def run():
        if index is not None:
            torch.accelerator.set_device_index(index)
        return target()

    return run


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread, started, that runs ``target`` on the caller's current accelerator device."""
    thread = threading.Thread(target=on_this_device(target), daemon=True, name=name)
    thread.start()
    return thread
