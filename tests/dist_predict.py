"""``trainer.predict`` on ``DEVICES`` CPU processes (DDP; Lightning re-runs this script for rank 1), greedy, of a
policy built from seed 0, or restored from ``CKPT`` (written by any number of processes): each rank saves what it
returned to ``OUT_DIR/rank<r>.pt``.

    python tests/dist_predict.py OUT_DIR DEVICES [CKPT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lit_gspo import GSPO, CharAccuracy, Generation, Policy, PromptDataModule, RLModule
from lit_gspo.runtime.collectives import end_process_group

ROWS = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(0, 100, 7)]


def module() -> RLModule:
    """The policy built from seed 0."""
    L.seed_everything(0)
    return RLModule(
        policy=Policy("tiny-llama", config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}),
        objective=GSPO(),
        rewards=[CharAccuracy()],
        generation=Generation(num_generations=2, max_new_tokens=6),
    )


def ddp_trainer(out: Path, devices: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )


def main(out: Path, devices: int, ckpt_path: str | None) -> None:
    model = module()
    data = PromptDataModule.from_datasets(ROWS, eval_dataset=ROWS[:5], prompts_per_step=2, val_batch_size=4)
    trainer = ddp_trainer(out, devices)
    predictions = trainer.predict(model, datamodule=data, ckpt_path=ckpt_path)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(predictions, out / f"rank{trainer.global_rank}.pt")
    end_process_group()  # every rank done: without it a process can abort at exit (exit -6, gloo's threads)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
