"""One ``metrics.csv`` per run: a resumed run continues the file of the run it resumes.

Lightning's ``CSVLogger`` gives every fit a new ``lightning_logs/version_N``, so a run stopped and resumed had its
metrics split over two files (and, reusing a version, it deletes the old file). :class:`RunCSVLogger` (the CLI's
default logger) resumes into the newest version directory and :class:`ContinuedWriter` keeps the file and its header.

Rows logged after the checkpoint a resume starts from (a killed run's last steps) are run and logged again by the
resume: :class:`lit_gspo.safe_ends.SafeEnds` cuts them from the file when the checkpoint is loaded (:func:`logged_before`
its ``rl_step``; each step's row is flushed before its checkpoint), so every step appears once.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ContinuedWriter(ExperimentWriter):
    """Lightning's CSV writer, but an existing ``metrics.csv`` is continued (its header kept), never deleted."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))

    def truncate(self, keep: Callable[[dict], bool]) -> int:
        """Keep the rows ``keep`` accepts (written aside, then swapped in); returns how many were dropped."""
        if not self._fs.isfile(self.metrics_file_path):
            return 0
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            fields = reader.fieldnames or self.metrics_keys
        kept = [row for row in rows if keep(row)]
        if len(kept) < len(rows):
            tmp = os.path.join(self.log_dir, f".{self.NAME_METRICS_FILE}.tmp-{os.getpid()}")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, self.metrics_file_path)
        return len(rows) - len(kept)


def logged_before(rl_step: int) -> Callable[[dict], bool]:
    """Whether a row was logged before a checkpoint taken after ``rl_step`` RL steps: a step's ``train/*`` row has the
    step's index (0 … rl_step − 1 come before), a validation's row the number of steps done (… rl_step: the validation
    after the last step, or the final one of a finished run, comes before)."""

    def keep(row: dict) -> bool:
        try:
            step = int(float(row.get("step") or 0))
        except ValueError:
            return True
        train = any(key.startswith("train/") and value not in (None, "") for key, value in row.items())
        return step < rl_step or (step == rl_step and not train)

    return keep


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``resume=True`` run writes into the newest existing version directory, continuing its
    ``metrics.csv`` (a fresh run still gets a new version)."""

    def __init__(self, save_dir, resume: bool = False, **kwargs) -> None:
        super().__init__(save_dir, **kwargs)
        if resume and kwargs.get("version") is None:
            newest = self._get_next_version() - 1
            if newest >= 0:
                self._version = newest

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedWriter(log_dir=self.log_dir)
        return self._experiment
