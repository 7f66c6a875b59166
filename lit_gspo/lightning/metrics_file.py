"""One ``metrics.csv`` per run: a resumed run continues the file of the run it resumes.

Lightning's ``CSVLogger`` gives every fit a new ``lightning_logs/version_N``, so a run stopped and resumed had its
metrics split over two files (and, reusing a version, it deletes the old file). :class:`RunCSVLogger` (the CLI's
default logger) resumes into the newest version directory and :class:`ContinuedWriter` keeps the file and its header.

Rows logged after the checkpoint a resume starts from (a killed run's last steps) are run and logged again by the
resume: :class:`lit_gspo.lightning.callbacks.resume.ContinueLogsOnResume` cuts them from the file when the checkpoint is loaded (:func:`logged_before`
its ``rl_step``; each step's row is flushed before its checkpoint), so every step appears once.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Callable
from typing import Any

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ContinuedWriter:
    """Writes ``<log_dir>/metrics.csv`` (one row per ``log_metrics`` call, columns the union of the keys, sorted, as
    Lightning's CSV writer does) and ``hparams.yaml``; an existing ``metrics.csv`` is continued, its header kept,
    never deleted. Local files only."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        self.log_dir = str(log_dir)
        self.metrics_file_path = os.path.join(self.log_dir, self.NAME_METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []
        self.hparams: dict[str, Any] = {}
        os.makedirs(self.log_dir, exist_ok=True)
        self.metrics_keys = self._header()

    def _header(self) -> list[str]:
        if not os.path.isfile(self.metrics_file_path):
            return []
        with open(self.metrics_file_path, newline="") as f:
            return list(next(csv.reader(f), []))

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        row["step"] = len(self.metrics) if step is None else step
        self.metrics.append(row)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def save(self) -> None:
        if not self.metrics:
            return
        new = set().union(*self.metrics) - set(self.metrics_keys)
        exists = os.path.isfile(self.metrics_file_path)
        if new:
            self.metrics_keys = sorted(set(self.metrics_keys) | new)
            if exists:  # a wider header: the earlier rows are rewritten under it
                self._rewrite(lambda row: True)
        with open(self.metrics_file_path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []

    def truncate(self, keep: Callable[[dict], bool]) -> int:
        """Keep the rows ``keep`` accepts (written aside, then swapped in); returns how many were dropped."""
        if not os.path.isfile(self.metrics_file_path):
            return 0
        return self._rewrite(keep)

    def _rewrite(self, keep: Callable[[dict], bool]) -> int:
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.DictReader(f))
        kept = [row for row in rows if keep(row)]
        tmp = os.path.join(self.log_dir, f".{self.NAME_METRICS_FILE}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
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


def newest_version(root: str) -> int | None:
    """The largest N of ``<root>/version_N`` (None: none yet)."""
    found = [
        int(m.group(1))
        for name in (os.listdir(root) if os.path.isdir(root) else [])
        if (m := re.fullmatch(r"version_(\d+)", name)) and os.path.isdir(os.path.join(root, name))
    ]
    return max(found) if found else None


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``resume=True`` run writes into the newest existing version directory, continuing its
    ``metrics.csv`` (a fresh run still gets a new version)."""

    def __init__(self, save_dir, resume: bool = False, name: str = "lightning_logs", version=None, **kwargs) -> None:
        if resume and version is None:
            version = newest_version(os.path.join(str(save_dir), name))
        super().__init__(save_dir, name=name, version=version, **kwargs)
        self._writer: ContinuedWriter | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedWriter:
        if self._writer is None:
            self._writer = ContinuedWriter(self.log_dir)
        return self._writer
