"""The quickstart (reverse 3-digit strings, GSPO, partial credit per character) from Python, with a plain
``lightning.Trainer``: ``python examples/python_api.py [max_steps]`` (metrics in runs/python_api/)."""

import sys

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_gspo import GSPO, CharAccuracy, Generation, PromptDataModule, RLModule, RLProgressBar, WarmStart


def main(max_steps=200, root="runs/python_api", prompts=16, completions=8, warm_start_steps=30, num_val=128):
    model = RLModule(model="tiny-llama", model_config={"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128},
                     objective=GSPO(), rewards=[CharAccuracy()], val_every_n_steps=25,
                     optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0),
                     generation=Generation(num_generations=completions, max_new_tokens=6),
                     warm_start=WarmStart(steps=warm_start_steps, lr=3e-3, batch_size=32))
    data = PromptDataModule(train_source="reversal", task_kwargs={"min_length": 3, "max_length": 3},
                            num_train=700, num_val=num_val, prompts_per_step=prompts)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, default_root_dir=root, logger=CSVLogger(root),
                        callbacks=[RLProgressBar()], enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    return model.run_validation()  # the policy's val/reward (already measured at the end of fit: not re-run)


if __name__ == "__main__":
    print(main(*map(int, sys.argv[1:2])))
