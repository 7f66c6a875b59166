"""SIGINT and SIGTERM during training: the first one lets the current RL step finish, then a checkpoint of it is
written (to ``ModelCheckpoint``'s ``last.ckpt``, or ``<default_root_dir>/checkpoints/last.ckpt`` when
checkpointing is off) and the process exits with 128 + the signal (130, 143), saying where the checkpoint is.
Under several processes the ranks agree on stopping after the same step. A second signal stops at once
without saving (the last checkpoint written stays intact: writes are atomic), even when the process is
blocked inside a collective waiting for a hung rank (a watchdog thread on the signal wakeup fd exits it).
Lightning's own SIGTERM handler, which exits 0 and under DDP broadcasts from inside the handler (a hang when
another rank is stuck), is replaced while training runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(SystemExit):
    """Raised to end a run stopped by a signal; the process exits with ``code`` (128 + signal number)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def last_checkpoint_path(trainer) -> str:
    """Where ``--ckpt_path last`` looks: ``ModelCheckpoint``'s ``last.ckpt``, else ``<default_root_dir>/checkpoints``."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return os.path.join(str(callback.dirpath), callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return os.path.join(str(trainer.default_root_dir), "checkpoints", "last.ckpt")


def _agree(trainer, value: int) -> int:
    """The largest ``value`` over all ranks (every rank must call)."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


class _SecondSignalWatchdog:
    """Ends the process on a second stop signal even while the main thread is blocked in C++ (e.g. in a collective
    waiting for a hung rank), where no Python signal handler can run.

    Python's C-level handler writes each signal number to the wakeup fd at once; this daemon thread reads it. On the
    second SIGINT/SIGTERM it gives the main thread ``grace_s`` to end the run itself (``RunInterrupted``), then
    ``os._exit(128 + signal)``: the last checkpoint written is intact (writes are atomic), the run lock is dropped
    with the process, and temporaries are cleaned by the next start.
    """

    def __init__(self, grace_s: float = 3.0) -> None:
        self.grace_s = grace_s
        self._done = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, daemon=True, name="lit_gspo-second-signal").start()

    def _watch(self) -> None:
        count = 0
        try:
            while not self._done.is_set():
                data = os.read(self._read_fd, 64)
                if not data:
                    return
                for signum in data:
                    count += signum in STOP_SIGNALS
                    if count >= 2 and not self._done.wait(self.grace_s):
                        os.write(
                            2,
                            f"\n{signal.Signals(signum).name} received twice and the run is blocked: exiting "
                            f"now with code {128 + signum}, without saving\n".encode(),
                        )
                        os._exit(128 + signum)  # the ranks this process launched end with it (end_with_parent)
        finally:
            os.close(self._read_fd)

    def stop(self) -> None:
        self._done.set()
        replaced = signal.set_wakeup_fd(self._previous)
        if replaced != self._write_fd:  # someone replaced ours meanwhile: keep theirs
            signal.set_wakeup_fd(replaced)
        os.close(self._write_fd)  # the thread reads EOF and ends


class SaveOnSignal(Callback):
    """SIGINT/SIGTERM while training: finish the RL step, save a checkpoint of it, exit with 128 + the signal (every
    rank after the same step); a second signal exits at once without saving (see the module docstring). While
    validating or testing outside a fit's training (``lit-gspo validate``/``test``, and the validation ``fit`` runs
    before its first update) there is nothing to save: the signal stops at once, not after the batch (minutes on a
    real model)."""

    def __init__(self) -> None:
        self._received = 0  # the first stop signal received while training (0: none)
        self._previous: dict[int, Any] = {}
        self._run_trainer = None
        self._watchdog: _SecondSignalWatchdog | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._received = 0

    def on_train_start(self, trainer, pl_module) -> None:
        # after Lightning's _SignalConnector registered its handlers, which this replaces while training runs
        self._run_trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous.setdefault(signum, signal.getsignal(signum))  # kept from the step-0 validation's, if any
            signal.signal(signum, self._on_signal)
        self._watchdog = _SecondSignalWatchdog()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._received:
            raise RunInterrupted(
                128 + signum,
                f"{name} received a second time: stopped without saving; the last checkpoint written is intact",
            )
        self._received = signum
        if self._run_trainer is None or self._run_trainer.is_global_zero:
            print(
                f"\n{name} received: finishing this RL step, then saving a checkpoint and exiting with code "
                f"{128 + signum} (send it again to stop at once, without saving)",
                file=sys.stderr,
                flush=True,
            )

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:  # validate/test, or a fit's step-0 validation
            self._stop_at_once(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._stop_at_once(trainer)

    def _stop_at_once(self, trainer) -> None:
        self._run_trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._on_signal_evaluating)

    def _on_signal_evaluating(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        message = (
            f"{name} received while validating: stopped (nothing was trained, nothing to save); exit code "
            f"{128 + signum}"
        )
        if self._run_trainer is None or self._run_trainer.is_global_zero:
            print(f"\n{message}", file=sys.stderr, flush=True)
        raise RunInterrupted(128 + signum, message)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Every rank agrees on the step. With validation on, Lightning's own stop: its loop validates this step (a
        # resume would skip that validation), and the checkpoint is saved at the validation's end, where a resume
        # continues with the next step of the same data epoch.
        if not _agree(trainer, self._received):
            return
        if trainer.enable_validation:
            trainer.should_stop = True
        else:
            self._stop_if_asked(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stop_if_asked(trainer, pl_module)
        elif trainer.state.fn != "fit":
            self._end()

    def on_test_end(self, trainer, pl_module) -> None:
        self._end()

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_if_asked(trainer, pl_module)  # received after the last step's validation: before the export

    def _stop_if_asked(self, trainer, pl_module) -> None:
        signum = _agree(trainer, self._received)
        if not signum:
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        step = getattr(pl_module, "rl_step", trainer.global_step)
        message = (
            f"{signal.Signals(signum).name}: saved a checkpoint after RL step {step} to {path}; "
            f"resume with --ckpt_path {path}. Exiting with code {128 + signum}."
        )
        if trainer.is_global_zero:
            print(message, file=sys.stderr, flush=True)
        raise RunInterrupted(128 + signum, message)

    def on_fit_end(self, trainer, pl_module) -> None:
        signum = _agree(trainer, self._received)
        if signum:  # received after the last step: the final validation and export were finished first
            message = (
                f"{signal.Signals(signum).name} received after the last step: the run is complete "
                f"(its export is in {trainer.default_root_dir}); exiting with code {128 + signum}."
            )
            if trainer.is_global_zero:
                print(message, file=sys.stderr, flush=True)
            raise RunInterrupted(128 + signum, message)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._end()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._end()

    def _end(self) -> None:
        for signum, handler in self._previous.items():  # unless Lightning's teardown already restored its own
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) in (
                self._on_signal,
                self._on_signal_evaluating,
            ):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
