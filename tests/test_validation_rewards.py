"""Validation logs each reward function's mean (``val/rewards/<function>/mean``, TRL's eval ``rewards/<f>/mean``) over the
held-out replies that function scored, beside ``val/reward`` (the weighted sum's mean)."""

from __future__ import annotations

import csv
import glob

import pytest
from test_monitors import fit


class EvenRowsOnly:
    """Scores 1 the replies at even positions of each batch, and no other (None: not scored by this function)."""

    def __call__(self, prompts, completions, **columns):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def test_each_functions_validation_mean_is_over_the_replies_it_scored(tmp_path):
    """char_accuracy scores every reply: its mean is val/reward when the other function's weight is 0. EvenRowsOnly
    scores half of them, each 1: its mean is 1 (counting the unscored as 0 would say 0.5; as NaN, NaN)."""
    fit(
        tmp_path,
        *("--model.validation.every_n_steps", "1", "--data.num_val", "7", "--data.val_batch_size", "4"),
        *("--model.rewards+=test_validation_rewards.EvenRowsOnly", "--model.reward_weights", "[1.0, 0.0]"),
    )
    (path,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/reward")]
    assert len(rows) >= 2  # step 0 and after the steps
    for row in rows:
        assert float(row["val/rewards/even_rows_only/mean"]) == 1.0
        assert float(row["val/rewards/char_accuracy/mean"]) == pytest.approx(float(row["val/reward"]), abs=1e-6)
