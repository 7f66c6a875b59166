"""``<root>/checkpoints/last.ckpt`` every n RL steps and after the final step, and the CLI's checkpoint
defaults (FSDP1 refused, atomic writes)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lit_gspo.lightning.checkpoint_io import AtomicCheckpointIO


class LastCheckpoint(ModelCheckpoint):
    """``<root>/checkpoints/last.ckpt`` every n RL steps, and after the final step too: a 60-step run with
    n = 50 ends with step 60's ``last.ckpt``, not step 50's (Lightning's ``ModelCheckpoint`` saves on its interval only).
    Nothing under ``fast_dev_run``."""

    def __init__(self, dirpath, every_n_train_steps: int | None) -> None:
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps)
        self.every = every_n_train_steps

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run or (self.every and trainer.global_step % self.every == 0):  # saved on the interval
            return
        trainer.save_checkpoint(os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION))


def configure_checkpointing(config: dict, callbacks: list, every_n_steps: int | None) -> None:
    """Trainer defaults of the CLI: FSDP1 refused, atomic writes, and ``<root>/checkpoints/last.ckpt`` every n steps.

    With ``trainer.enable_checkpointing`` (Lightning's default), a :class:`LastCheckpoint` writes ``last.ckpt``
    every ``every_n_steps`` RL steps (0/None: at the end of each epoch) and after the final step, into
    ``<default_root_dir>/checkpoints``, so that ``--ckpt_path last`` finds it whatever logger version directory a
    run gets; unless a ``ModelCheckpoint`` the user gives keeps a last checkpoint itself (``save_last``). A user's
    ``ModelCheckpoint(monitor="val/reward", save_top_k=k)`` keeps its k best beside it.
    """
    from lightning.fabric.plugins import CheckpointIO

    from lit_gspo.lightning.strategy import check_strategy, strategy_from_path

    strategy = config.get("strategy")
    check_strategy(strategy)
    if strategy is not None:
        config["strategy"] = strategy_from_path(strategy)
    plugins = config.get("plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        config["plugins"] = plugins + [AtomicCheckpointIO()]
    if config.get("enable_checkpointing") is False:
        return
    if any(isinstance(c, ModelCheckpoint) and c.save_last for c in callbacks):
        return
    root = Path(config.get("default_root_dir") or os.getcwd())
    callbacks.append(LastCheckpoint(root / "checkpoints", every_n_train_steps=every_n_steps or None))
