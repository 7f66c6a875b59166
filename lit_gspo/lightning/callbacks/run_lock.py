"""One run per directory: ``<default_root_dir>/.lit_gspo.lock`` (:class:`RunLock`: the PID, host, start time and
command of the run, held with ``flock`` so that the kernel releases it when the process dies). A second run in the
same directory is refused with :class:`RunLockedError` naming the first; a lock left by a dead process is taken over.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.lightning.run_dir import SCORING
from lit_gspo.runtime.processes import pid_alive, process_start
from lit_gspo.runtime.user_errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no run lock
    fcntl = None

LOCK_NAME = ".lit_gspo.lock"


class RunLockedError(UserError, RuntimeError):
    """Another live run holds the lock of this ``default_root_dir``."""


_HELD: dict[str, RunLock] = {}


def held_lock(root: str | Path) -> RunLock | None:
    """The lock of ``root`` this process holds (taken by ``lit-gspo fit`` before it builds anything), or None."""
    lock = _HELD.get(str((Path(root) / LOCK_NAME).resolve()))
    return lock if lock is not None and lock._fd is not None else None


@atexit.register
def _release_all() -> None:
    """At exit, the locks still held (a fit that failed before its Trainer ran) are released and their files removed."""
    for lock in list(_HELD.values()):
        lock.release()


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
                rank_zero_info(
                    f"took over the run lock {self.path} of PID {holder.get('pid')} on {holder.get('host')}, "
                    "a run that ended without releasing it"
                )
            info = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "start": process_start(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "argv": sys.argv,
            }
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
        who = (
            (
                f"PID {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
                f"{' '.join(map(str, holder.get('argv') or [])) or '?'}"
            )
            if holder
            else "details not written yet"
        )
        return (
            f"{self.path.parent} is in use by another run ({who}). Two runs in one default_root_dir would overwrite "
            "each other's checkpoints, metrics and hf_model: wait for that run to end or stop it, or give this one "
            f"another --trainer.default_root_dir. (The lock is {self.path}; it is released when that process ends.)"
        )

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


def writes_run_files(trainer, stage: str) -> bool:
    """Whether ``stage`` writes the run's own files in ``default_root_dir``: a fit always (checkpoints, the export, its
    logs); a validate or test when a logger writes a log folder there (Lightning's ``lightning_logs/version_N``, which a
    fit's logs share). The CLI's ``validate``/``test``/``predict`` log to ``lightning_logs/<subcommand>``, beside any run."""
    if stage == "fit":
        return True
    root = Path(trainer.default_root_dir).resolve()
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir is None:
            continue
        path = Path(log_dir).resolve()
        if path.is_relative_to(root) and path.name not in SCORING:
            return True
    return False


class OneRunPerDirectory(Callback):
    """At the start of the first stage that writes the run's files (:func:`writes_run_files`: a fit, or a validate or
    test whose logger writes a ``version_N`` there), the run lock of ``default_root_dir`` (:class:`RunLock`), refused on
    every rank when another live run holds it. Released when a fit ends, when any stage fails, or when the process
    exits: a ``trainer.validate`` before ``trainer.fit`` keeps it for the fit, so no
    other run can start in between.

    ``lit-gspo fit`` takes the lock before anything is built (``lit_gspo.lightning.run_dir.place_fit``); this callback
    then adopts it, from the first stage that runs."""

    def __init__(self) -> None:
        self._lock: RunLock | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._lock is None and trainer.is_global_zero:
            self._lock = held_lock(trainer.default_root_dir)  # taken by the CLI before the Trainer was built
        if not writes_run_files(trainer, stage) or self._lock is not None and trainer.world_size == 1:
            return
        error = None
        if trainer.is_global_zero and self._lock is None:
            try:
                self._lock = RunLock(trainer.default_root_dir).acquire()
            except RunLockedError as err:
                error = str(err)
        error = trainer.strategy.broadcast(error)
        if error:
            raise RunLockedError(error)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
