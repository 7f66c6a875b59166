"""The temporaries of killed writes (``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>``, written by
``lit_gspo.runtime.files`` and ``lit_gspo.runtime.checkpoint_files``) removed at the start of a fit when their writer
is gone."""

from __future__ import annotations

import os
import re
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.runtime.files import remove
from lit_gspo.runtime.processes import pid_alive

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
                remove(path)
                removed.append(path)
    if removed:
        rank_zero_info(
            f"removed {len(removed)} temporary file(s) left by killed writes: {', '.join(map(str, removed))}"
        )
    return removed


class CleanKilledWrites(Callback):
    """At the start of a fit (rank 0, after the run lock is taken): :func:`clean_stale_temporaries` in the run's
    directory, its ``checkpoints/`` and every local ``ModelCheckpoint`` directory."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        root = Path(trainer.default_root_dir)
        clean_stale_temporaries(
            [root, root / "checkpoints"]
            + [
                Path(cb.dirpath)
                for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath and "://" not in str(cb.dirpath)
            ]
        )
