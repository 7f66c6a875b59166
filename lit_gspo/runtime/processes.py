"""Processes of this machine: is a PID alive (and the same process), and ranks that end with their launcher."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def process_start(pid: int) -> str | None:
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
        now = process_start(pid)
        return now is None or now == start
    return True


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
