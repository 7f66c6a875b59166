"""The quickstart (reverse 3-digit strings, GSPO, partial credit per character) from Python, with a plain
``lightning.Trainer``: ``python examples/python_api.py [max_steps]`` (metrics in runs/python_api/)."""

import sys

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_gspo import GSPO, CharAccuracy, Generation, Policy, PromptDataModule, RLModule, RLProgressBar, WarmStart


def main(max_steps=200, root="runs/python_api", prompts=16, completions=8, warm_start_steps=30, num_val=128):
    model = RLModule(
        policy=Policy(
            "tiny-llama",
            config={"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128},
            warm_start=WarmStart(steps=warm_start_steps, lr=3e-3, batch_size=32),
        ),
        objective=GSPO(),
        rewards=[CharAccuracy()],
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0),
        generation=Generation(num_generations=completions, max_new_tokens=6),
    )
    data = PromptDataModule(
        train_source="reversal",
        task_kwargs={"min_length": 3, "max_length": 3},
        num_train=700,
        num_val=num_val,
        prompts_per_step=prompts,
    )
    # one Lightning batch is one RL step: validate every 25 of them (and after the last), a metrics row for each
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        default_root_dir=root,
        logger=CSVLogger(root),
        val_check_interval=25,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,  # the sanity check over every held-out prompt: val/reward at step 0, after the warm start
        log_every_n_steps=1,
        callbacks=[RLProgressBar()],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}  # the last validation


if __name__ == "__main__":
    print(main(*map(int, sys.argv[1:2])))
