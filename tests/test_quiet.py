"""Warnings a user cannot act on are silenced at their source; others still show."""

import logging
import sys
import warnings
from pathlib import Path

from lit_gspo.tools.ablate import run_one

ROOT = Path(__file__).resolve().parents[1]
SILENCED = (
    "in eval mode at the start of training",
    "Using ModelCheckpoint with manual optimization",
    "LightningCLI's args parameter is intended",
    "litlogger",
    "litmodels",
    "`isinstance(treespec, LeafSpec)` is deprecated",
)


def test_a_fit_run_by_ablate_shows_none_of_lightnings_unactionable_warnings(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(
        sys, "argv", ["lit-gspo", "ablate", "--config", "configs/ablate/x.yaml"]
    )  # as `lit-gspo ablate`
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "2",
        "--model.policy.warm_start.steps",
        "0",
        "--data.num_train",
        "16",
        "--data.num_val",
        "4",
        "--data.prompts_per_step",
        "2",
        "--model.generation.num_generations",
        "2",
        "--model.generation.max_new_tokens",
        "3",
        "--trainer.enable_checkpointing",
        "true",
        "--checkpoint_every_n_steps",
        "1",
    ]
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        run_one(args)
        warnings.warn("an informative warning still shows", UserWarning, stacklevel=1)
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert not [m for m in messages if any(s in m for s in SILENCED)], messages
    assert "an informative warning still shows" in messages
