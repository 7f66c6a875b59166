"""The callbacks every fit gets (``RLModule.configure_callbacks``), one job each, in this order:

    EndWithLauncher           ranks other than 0 end with the process that launched them        ranks.py
    AtomicCheckpoints         checkpoint writes atomic and hashed (a fit built without the CLI)  atomic_checkpoints.py
    OneRunPerDirectory        the run lock of default_root_dir: a second live run is refused      run_lock.py
    CleanKilledWrites         temporaries of killed writes removed                                temporaries.py
    ResumeAlike               every rank resumes from the same step                               resume.py
    SaveOnSignal              SIGINT/SIGTERM: finish the step, save it, exit 128 + signal         signals.py
    ContinueLogsOnResume      a resume cuts the rows logged after its checkpoint                  resume.py
    ExplainCollectiveTimeout  a timed-out collective names the stuck rank's setting               ranks.py
    CloseEngine               the rollout engine (a vLLM) freed when the fit ends or fails        engine.py

``LastCheckpoint`` (last_checkpoint.py) is added by the CLI, as Lightning users add a ``ModelCheckpoint``.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from lit_gspo.lightning.callbacks.atomic_checkpoints import AtomicCheckpoints
from lit_gspo.lightning.callbacks.engine import CloseEngine
from lit_gspo.lightning.callbacks.last_checkpoint import LastCheckpoint
from lit_gspo.lightning.callbacks.ranks import EndWithLauncher, ExplainCollectiveTimeout
from lit_gspo.lightning.callbacks.resume import ContinueLogsOnResume, ResumeAlike
from lit_gspo.lightning.callbacks.run_lock import OneRunPerDirectory, RunLock, RunLockedError
from lit_gspo.lightning.callbacks.signals import RunInterrupted, SaveOnSignal
from lit_gspo.lightning.callbacks.temporaries import CleanKilledWrites

__all__ = [
    "AtomicCheckpoints",
    "CleanKilledWrites",
    "CloseEngine",
    "ContinueLogsOnResume",
    "EndWithLauncher",
    "ExplainCollectiveTimeout",
    "LastCheckpoint",
    "OneRunPerDirectory",
    "ResumeAlike",
    "RunInterrupted",
    "RunLock",
    "RunLockedError",
    "SaveOnSignal",
    "run_callbacks",
]


def run_callbacks() -> list[Callback]:
    """The callbacks every fit gets, one job each (the order above matters: the lock before the cleanup)."""
    return [
        EndWithLauncher(),
        AtomicCheckpoints(),
        OneRunPerDirectory(),
        CleanKilledWrites(),
        ResumeAlike(),
        SaveOnSignal(),
        ContinueLogsOnResume(),
        ExplainCollectiveTimeout(),
        CloseEngine(),
    ]
