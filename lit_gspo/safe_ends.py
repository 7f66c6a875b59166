"""Safe ends of a run: one run per directory, no stale temporaries, logs continued on resume, signals saved.

:func:`safe_ends` gives the callbacks ``RLModule.configure_callbacks`` adds to every fit (CLI or Python API), one job each:

* :class:`OneRunPerDirectory` locks ``<default_root_dir>/.lit_gspo.lock`` (:class:`RunLock`: the PID, host, start time
  and command of the run, held with ``flock`` so that the kernel releases it when the process dies): a second run in
  the same directory is refused with :class:`RunLockedError` naming the first; a lock left by a dead process is taken
  over. It removes the temporaries of killed writers (``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>``) whose process is
  gone (:func:`clean_stale_temporaries`), makes checkpoint writes atomic and hashed when the trainer has Lightning's
  plain ``TorchCheckpointIO`` (``lit_gspo.checkpointing.AtomicCheckpointIO``; the CLI sets it already), and makes the
  ranks Lightning launched end with the process that launched them (:func:`end_with_parent`).
* :class:`ContinueLogsOnResume` cuts from the continued ``metrics.csv`` and ``completions.csv`` the rows logged after
  the checkpoint a resume starts from. Each RL step's metrics row reaches the loggers from inside the step
  (``RLModule.log_step``), before ``ModelCheckpoint`` saves it, so no row is lost between a checkpoint and a kill.
* :class:`SaveOnSignal`, below.

SIGINT and SIGTERM during training: the first one lets the current RL step finish, then a checkpoint of it is
written (to ``ModelCheckpoint``'s ``last.ckpt``, or ``<default_root_dir>/checkpoints/last.ckpt`` when
checkpointing is off) and the process exits with 128 + the signal (130, 143), saying where the checkpoint is.
Under several processes the ranks agree on stopping after the same step. A second signal stops at once
without saving (the last checkpoint written stays intact: writes are atomic), even when the process is
blocked inside a collective waiting for a hung rank (a watchdog thread on the signal wakeup fd exits it).
Lightning's own SIGTERM handler, which exits 0 and under DDP broadcasts from inside the handler (a hang when
another rank is stuck), is replaced while training runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.checkpointing import AtomicCheckpointIO, _remove
from lit_gspo.distributed import check_ranks_resume_alike

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no run lock
    fcntl = None

LOCK_NAME = ".lit_gspo.lock"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunLockedError(RuntimeError):
    """Another live run holds the lock of this ``default_root_dir``."""


class RunInterrupted(SystemExit):
    """Raised to end a run stopped by a signal; the process exits with ``code`` (128 + signal number)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


# ---------------------------------------------------------------------- processes
def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to tell a reused PID from the original."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` (of this machine) still runs; with ``start``, whether it is the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    if start is not None:
        now = _process_start(pid)
        return now is None or now == start
    return True


# ---------------------------------------------------------------------- one run per directory
_HELD: dict[str, RunLock] = {}


class RunLock:
    """An exclusive lock on ``<root>/.lit_gspo.lock``, whose text says who holds it (JSON: pid, host, start, argv).

    ``flock`` on the open file is the lock (the kernel drops it when the holder dies, so a lock file left by a
    killed run is taken over); the text is for the error message. Where ``flock`` is not supported the holder's
    PID is checked instead (alive on this host: refused; dead: taken over).
    """

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        earlier = _HELD.pop(str(self.path.resolve()), None)
        if earlier is not None:  # a fit of this process that ended without releasing it
            earlier.release()
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = self._flock(fd)
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder may have released and unlinked the file between our open and flock: try again
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:
                os.close(fd)
                continue
            holder = _parse(os.pread(fd, 1 << 16, 0))
            if not locked and holder and holder.get("pid") != os.getpid() and _alive(holder):
                os.close(fd)
                raise RunLockedError(self._message(holder))
            if holder and holder.get("pid") not in (None, os.getpid()):
                rank_zero_info(f"took over the run lock {self.path} of PID {holder.get('pid')} on {holder.get('host')}, "
                               "a run that ended without releasing it")
            info = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            self._fd = fd
            _HELD[str(self.path.resolve())] = self
            return self
        raise RunLockedError(f"could not lock {self.path}: it keeps being replaced by other processes")

    def _flock(self, fd: int) -> bool:
        """True when locked with flock; False when flock is unsupported here (the PID check decides)."""
        if fcntl is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = _parse(os.pread(fd, 1 << 16, 0)) or {}
            raise RunLockedError(self._message(holder)) from None
        except OSError:  # e.g. a file system without flock
            return False

    def _message(self, holder: dict) -> str:
        who = (f"PID {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
               f"{' '.join(map(str, holder.get('argv') or [])) or '?'}") if holder else "details not written yet"
        return (f"{self.path.parent} is in use by another run ({who}). Two runs in one default_root_dir would overwrite "
                "each other's checkpoints, metrics and hf_model: wait for that run to end or stop it, or give this one "
                f"another --trainer.default_root_dir. (The lock is {self.path}; it is released when that process ends.)")

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.pop(str(self.path.resolve()), None)
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)  # drops the flock


def _parse(raw: bytes) -> dict | None:
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _alive(holder: dict) -> bool:
    """Whether the process a lock file names may still run (a process on another host cannot be checked: assume so)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    return isinstance(pid, int) and pid_alive(pid, holder.get("start"))


# ---------------------------------------------------------------------- temporaries of killed writers
_TEMPORARY = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")


def clean_stale_temporaries(directories: list[Path]) -> list[Path]:
    """Remove ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` files and directories whose writer ``<pid>`` is dead."""
    removed = []
    for directory in dict.fromkeys(Path(d) for d in directories):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            match = _TEMPORARY.match(path.name)
            if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
                _remove(path)
                removed.append(path)
    if removed:
        rank_zero_info(f"removed {len(removed)} temporary file(s) left by killed writes: {', '.join(map(str, removed))}")
    return removed


def last_checkpoint_path(trainer) -> str:
    """Where ``--ckpt_path last`` looks: ``ModelCheckpoint``'s ``last.ckpt``, else ``<default_root_dir>/checkpoints``."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return os.path.join(str(callback.dirpath), callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return os.path.join(str(trainer.default_root_dir), "checkpoints", "last.ckpt")


def end_with_parent() -> None:
    """This process gets SIGKILL when its parent ends (Linux ``prctl(PR_SET_PDEATHSIG)``): a rank that Lightning's
    launcher (or torchrun) started never outlives a rank 0 that failed and exited, even when it is stuck outside any
    collective (in a reward, in data loading) where no timeout reaches it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        return
    if os.getppid() == 1:  # the parent ended before the call: no signal will come
        os._exit(1)


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
                        os.write(2, f"\n{signal.Signals(signum).name} received twice and the run is blocked: exiting "
                                    f"now with code {128 + signum}, without saving\n".encode())
                        os._exit(128 + signum)  # the ranks this process launched end with it (end_with_parent)
        finally:
            os.close(self._read_fd)

    def stop(self) -> None:
        self._done.set()
        replaced = signal.set_wakeup_fd(self._previous)
        if replaced != self._write_fd:  # someone replaced ours meanwhile: keep theirs
            signal.set_wakeup_fd(replaced)
        os.close(self._write_fd)  # the thread reads EOF and ends


class OneRunPerDirectory(Callback):
    """At the start of a fit: the run lock of ``default_root_dir`` (:class:`RunLock`, refused on every rank when another
    live run holds it), the temporaries of killed writes removed, and atomic, hashed checkpoint writes
    (``AtomicCheckpointIO``) when the strategy has Lightning's plain ``TorchCheckpointIO``. Ranks other than 0 end with
    the process that launched them (:func:`end_with_parent`)."""

    def __init__(self) -> None:
        self._lock: RunLock | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.local_rank > 0:
            end_with_parent()
        if type(trainer.strategy.checkpoint_io) is _plain_io():
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        root = Path(trainer.default_root_dir)
        error = None
        if trainer.is_global_zero:
            try:
                self._lock = RunLock(root).acquire()
            except RunLockedError as err:
                error = str(err)
            else:
                dirs = [root, root / "checkpoints"] + [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks
                                                       if isinstance(cb, ModelCheckpoint) and cb.dirpath
                                                       and "://" not in str(cb.dirpath)]
                clean_stale_temporaries(dirs)
        error = trainer.strategy.broadcast(error)
        if error:
            raise RunLockedError(error)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._release()
        if trainer.world_size > 1 and not isinstance(exception, RunInterrupted) and (
                "timed out" in str(exception).lower() or "timeout" in type(exception).__name__.lower()):
            print(f"\n[rank {trainer.global_rank}] a collective timed out: another rank is stuck or died (in its "
                  "reward, its data, ...). The limit is the strategy's timeout (Lightning's default 30 min), e.g. "
                  "--trainer.strategy lightning.pytorch.strategies.DDPStrategy --trainer.strategy.timeout 0:05:00",
                  file=sys.stderr, flush=True)

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class ResumeAlike(Callback):
    """Every rank resumes from the same step, or all fail at start naming each rank's checkpoint (a node with its own
    ``default_root_dir`` finds no ``last`` and would start from step 0 while the others continue: a hang)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.world_size > 1:
            check_ranks_resume_alike(trainer.ckpt_path, trainer.global_step, trainer.default_root_dir)


class SaveOnSignal(Callback):
    """SIGINT/SIGTERM while training: finish the RL step, save a checkpoint of it, exit with 128 + the signal (every
    rank after the same step); a second signal exits at once without saving (see the module docstring)."""

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
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        self._watchdog = _SecondSignalWatchdog()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._received:
            raise RunInterrupted(128 + signum, f"{name} received a second time: stopped without saving; the last "
                                               "checkpoint written is intact")
        self._received = signum
        if self._run_trainer is None or self._run_trainer.is_global_zero:
            print(f"\n{name} received: finishing this RL step, then saving a checkpoint and exiting with code "
                  f"{128 + signum} (send it again to stop at once, without saving)", file=sys.stderr, flush=True)

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

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_if_asked(trainer, pl_module)  # received after the last step's validation: before the export

    def _stop_if_asked(self, trainer, pl_module) -> None:
        signum = _agree(trainer, self._received)
        if not signum:
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        step = getattr(pl_module, "rl_step", None)
        message = (f"{signal.Signals(signum).name}: saved a checkpoint after "
                   f"{'' if step is None else f'RL step {step}, '}optimiser step {trainer.global_step} to {path}; "
                   f"resume with --ckpt_path {path}. Exiting with code {128 + signum}.")
        if trainer.is_global_zero:
            print(message, file=sys.stderr, flush=True)
        raise RunInterrupted(128 + signum, message)

    def on_fit_end(self, trainer, pl_module) -> None:
        signum = _agree(trainer, self._received)
        if signum:  # received after the last step: the final validation and export were finished first
            message = (f"{signal.Signals(signum).name} received after the last step: the run is complete "
                       f"(its export is in {trainer.default_root_dir}); exiting with code {128 + signum}.")
            if trainer.is_global_zero:
                print(message, file=sys.stderr, flush=True)
            raise RunInterrupted(128 + signum, message)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._end()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._end()

    def _end(self) -> None:
        for signum, handler in self._previous.items():  # unless Lightning's teardown already restored its own
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None


class ContinueLogsOnResume(Callback):
    """A resume continues the run's ``metrics.csv`` and ``completions.csv``: the rows logged after the checkpoint it
    starts from (a killed run's last steps) are cut, since the resume logs those steps again: each step appears once."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        from lit_gspo.completions_log import FILE_NAME, truncate_after
        from lit_gspo.metrics_file import logged_before

        writer = _continued_writer(trainer)
        if writer is None or checkpoint.get("rl_step") is None:
            return
        rl_step = int(checkpoint["rl_step"])
        dropped = writer.truncate(logged_before(rl_step))
        dropped_completions = truncate_after(Path(writer.log_dir) / FILE_NAME, rl_step)
        if dropped or dropped_completions:
            rank_zero_info(f"{writer.log_dir}: dropped {dropped} metrics row(s) and {dropped_completions} completion "
                           "row(s) logged after the checkpoint; this run logs those steps again")


def safe_ends() -> list[Callback]:
    """The callbacks every fit gets (``RLModule.configure_callbacks``), one job each."""
    return [OneRunPerDirectory(), ResumeAlike(), SaveOnSignal(), ContinueLogsOnResume()]


def _continued_writer(trainer):
    """The ``ContinuedWriter`` of the run's ``RunCSVLogger`` (rank 0), its pending rows flushed; None without one."""
    from lit_gspo.metrics_file import RunCSVLogger

    for logger in trainer.loggers:
        if isinstance(logger, RunCSVLogger) and trainer.is_global_zero:
            logger.save()
            return logger.experiment
    return None


def _plain_io() -> type:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    return TorchCheckpointIO
