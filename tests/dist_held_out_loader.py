"""A held-out stage (``validate`` or ``predict``) on ``DEVICES`` CPU processes (DDP; Lightning re-runs this script for
rank 1) over ``ROWS`` prompts given as a ``DataLoader`` (which Lightning splits over the ranks) or as ``RowBatches``
(which every rank reads whole), 4 a batch: each rank saves what it returned, or the error it raised, to
``OUT_DIR/rank<r>.pt``.

    python tests/dist_held_out_loader.py OUT_DIR DEVICES STAGE LOADER ROWS
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_gspo import GSPO, CharAccuracy, Generation, Policy, RLModule, RowBatches

ROWS = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(0, 1000, 7)]


def main(out: Path, devices: int, stage: str, loader: str, rows: int) -> None:
    L.seed_everything(0)
    model = RLModule(
        policy=Policy("tiny-llama", config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}),
        objective=GSPO(),
        rewards=[CharAccuracy()],
        generation=Generation(num_generations=2, max_new_tokens=4),
    )
    given = ROWS[:rows]
    batches = (
        DataLoader(given, batch_size=4, collate_fn=lambda batch: batch)
        if loader == "dataloader"
        else RowBatches(given, batch_size=4)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    try:
        result = getattr(trainer, stage)(model, dataloaders=batches)
    except Exception as exc:  # noqa: BLE001 - saved for the test to read, per rank
        result = exc
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
