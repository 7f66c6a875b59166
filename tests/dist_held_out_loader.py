"""A held-out stage (``validate`` or ``predict``) on ``DEVICES`` CPU processes (DDP; Lightning re-runs this script for
rank 1) over ``ROWS`` prompts given as a ``DataLoader`` (which Lightning splits over the ranks) or as ``RowBatches``
(which every rank reads whole), 4 a batch: each rank saves what it returned, or the error it raised, to
``OUT_DIR/rank<r>.pt``.

    python tests/dist_held_out_loader.py OUT_DIR DEVICES STAGE LOADER ROWS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from dist_predict import ROWS, ddp_trainer, module
from torch.utils.data import DataLoader

from lit_gspo import RowBatches
from lit_gspo.runtime.collectives import end_process_group


def main(out: Path, devices: int, stage: str, loader: str, rows: int) -> None:
    model = module()
    given = ROWS[:rows]
    batches = (
        DataLoader(given, batch_size=4, collate_fn=lambda batch: batch)
        if loader == "dataloader"
        else RowBatches(given, batch_size=4)
    )
    trainer = ddp_trainer(out, devices)
    try:
        result = getattr(trainer, stage)(model, dataloaders=batches)
    except Exception as exc:  # noqa: BLE001 - saved for the test to read, per rank
        result = exc
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")
    end_process_group()  # every rank done: without it a process can abort at exit (exit -6, gloo's threads)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
