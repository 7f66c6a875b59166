"""``lit-gspo predict``'s output: each prediction written as one JSON line.

    <log_dir>/predictions.jsonl   (the CLI: <default_root_dir>/lightning_logs/predict/predictions.jsonl)
    {"row": {...}, "completions": [...], "rewards": [...], "scores": {function: [...]}}   one line per prompt row

(``prediction.py`` says what a prediction holds.) Every rank holds the whole batch (``predict_rows``), so rank 0
writes it, in the rows' order, as each batch ends: a stopped run keeps what it predicted.

A callback, not a ``BasePredictionWriter``: the held-out batches are row lists (``RowBatches``), not a DataLoader's
sampled indices, so Lightning has no ``batch_indices`` to give a writer (it warns so); each prediction holds its row.
The CLI adds it to ``predict`` unless a ``BasePredictionWriter`` is configured.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

PREDICTIONS = "predictions.jsonl"


class PredictionsFile(Callback):
    """Each batch's predictions appended to ``path`` (None: ``<trainer.log_dir>/predictions.jsonl``), which each
    ``trainer.predict`` starts afresh."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.given = None if path is None else Path(path)
        self.path, self._file, self._written = self.given, None, 0

    def on_predict_start(self, trainer, pl_module) -> None:
        # on every rank: Lightning's log_dir is a collective (rank 0's, broadcast); read by rank 0 alone, it hung
        self.path = self.given or Path(trainer.log_dir or trainer.default_root_dir) / PREDICTIONS
        if not trainer.is_global_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file, self._written = open(self.path, "w"), 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._file is None:
            return
        self._file.writelines(json.dumps(prediction, default=str) + "\n" for prediction in outputs)
        self._file.flush()
        self._written += len(outputs)

    def on_predict_end(self, trainer, pl_module) -> None:
        if self._file is not None:
            self._close()
            rank_zero_info(f"wrote {self._written} predictions to {self.path}")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
