"""Safe ends of a run: one run per directory, no stale temporaries, metrics before checkpoints, signals saved.

:class:`SafeEnds` is a Lightning callback that ``RLModule.configure_callbacks`` adds to every fit (CLI or
Python API). At the start of a fit it

* locks ``<default_root_dir>/.lit_gspo.lock`` (:class:`RunLock`: the PID, host, start time and command of the
  run, held with ``flock`` so that the kernel releases it when the process dies): a second run in the same
  directory is refused with :class:`RunLockedError` naming the first, rather than both overwriting each other's
  checkpoints, metrics and ``hf_model``; a lock left by a dead process is taken over;
* removes the temporaries of killed writers (``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` of checkpoint and
  export writes) whose process is gone (:func:`clean_stale_temporaries`);
* makes checkpoint writes atomic and hashed when the trainer uses Lightning's plain ``TorchCheckpointIO``
  (``lit_gspo.checkpointing.AtomicCheckpointIO``; the CLI sets it already);
* hands each RL step's metrics row to the loggers (and flushes it) *before* a checkpoint of that step is
  written: Lightning logs the row only after ``on_train_batch_end``, where ``ModelCheckpoint`` saves, so a kill
  in between used to lose the row for good (the resume starts after it).

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

import atexit
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


def _log_each_row_once(trainer) -> None:
    """Let ``update_train_step_metrics`` run early (before checkpoints) without Lightning's own call logging it twice."""
    connector = trainer._logger_connector
    if getattr(connector, "_lit_gspo_once", False):
        return
    original = connector.update_train_step_metrics
    logged = {"batch": None}

    def update_train_step_metrics() -> None:
        batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        if batch != logged["batch"]:
            logged["batch"] = batch
            original()

    connector.update_train_step_metrics = update_train_step_metrics
    connector._lit_gspo_once = True


def _kill_launched_ranks(trainer) -> None:
    """SIGKILL the other ranks this process launched (Lightning's subprocess launcher), which would outlive it."""
    launcher = trainer.strategy.launcher
    for proc in getattr(launcher, "procs", None) or []:
        try:
            proc.send_signal(signal.SIGKILL)
        except OSError:
            pass


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

    def __init__(self, before_exit=None, grace_s: float = 3.0) -> None:
        self.before_exit, self.grace_s = before_exit, grace_s
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
                        try:
                            if self.before_exit is not None:
                                self.before_exit()
                        finally:
                            os._exit(128 + signum)
        finally:
            os.close(self._read_fd)

    def stop(self) -> None:
        self._done.set()
        replaced = signal.set_wakeup_fd(self._previous)
        if replaced != self._write_fd:  # someone replaced ours meanwhile: keep theirs
            signal.set_wakeup_fd(replaced)
        os.close(self._write_fd)  # the thread reads EOF and ends


class SafeEnds(Callback):
    """The run lock, stale-temporary cleanup, atomic hashed checkpoints, rows before checkpoints and signal handling."""

    def __init__(self) -> None:
        self._lock: RunLock | None = None
        self._received = 0  # the first stop signal received while training (0: none)
        self._previous: dict[int, Any] = {}
        self._trainer = None
        self._watchdog: _SecondSignalWatchdog | None = None

    # -------------------------------------------------------------- start
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
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
        _log_each_row_once(trainer)
        self._received = 0

    def on_train_start(self, trainer, pl_module) -> None:
        # after Lightning's _SignalConnector registered its handlers, which this replaces while training runs
        self._trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        self._watchdog = _SecondSignalWatchdog(before_exit=lambda: _kill_launched_ranks(trainer))

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._received:
            raise RunInterrupted(128 + signum, f"{name} received a second time: stopped without saving; the last "
                                               "checkpoint written is intact")
        self._received = signum
        if self._trainer is None or self._trainer.is_global_zero:
            print(f"\n{name} received: finishing this RL step, then saving a checkpoint and exiting with code "
                  f"{128 + signum} (send it again to stop at once, without saving)", file=sys.stderr, flush=True)

    # -------------------------------------------------------------- each step
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # this step's row reaches the loggers (and disk) before any checkpoint of this step: callbacks run before
        # ModelCheckpoint, which Lightning orders last
        trainer._logger_connector.update_train_step_metrics()
        self._stop_if_asked(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_if_asked(trainer, pl_module)  # before the final validation and export: a resume writes them

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

    # -------------------------------------------------------------- the metrics file a resume continues
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Cut the rows logged after this checkpoint from the continued metrics file: the resume logs them again."""
        from lit_gspo.metrics_file import logged_before

        writer = _continued_writer(trainer)
        if writer is not None and checkpoint.get("rl_step") is not None:
            dropped = writer.truncate(logged_before(int(checkpoint["rl_step"])))
            if dropped:
                rank_zero_info(f"{writer.metrics_file_path}: dropped {dropped} row(s) logged after the checkpoint; "
                               "this run logs those steps again")

    # -------------------------------------------------------------- end
    def on_fit_end(self, trainer, pl_module) -> None:
        signum = _agree(trainer, self._received)
        if signum:  # received after the last step: the final validation and export were finished first
            message = (f"{signal.Signals(signum).name} received after the last step: the run is complete "
                       f"(its export is in {trainer.default_root_dir}); exiting with code {128 + signum}.")
            if trainer.is_global_zero:
                print(message, file=sys.stderr, flush=True)
            raise RunInterrupted(128 + signum, message)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._end()
        if trainer.world_size > 1 and not isinstance(exception, RunInterrupted):
            if "timed out" in str(exception).lower() or "timeout" in type(exception).__name__.lower():
                print(f"\n[rank {trainer.global_rank}] a collective timed out: another rank is stuck or died (in its "
                      "reward, its data, ...). The limit is the strategy's timeout (Lightning's default 30 min), e.g. "
                      "--trainer.strategy lightning.pytorch.strategies.DDPStrategy --trainer.strategy.timeout 0:05:00",
                      file=sys.stderr, flush=True)
            # the ranks this process launched would outlive it when they are stuck (not in a collective): end them
            # once this process has reported its error
            atexit.register(_kill_launched_ranks, trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._end()

    def _end(self) -> None:
        for signum, handler in self._previous.items():  # unless Lightning's teardown already restored its own
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


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
