"""The metrics of one RL step: ``train/*`` reduced over every rank, written to the loggers at once, given to callbacks
through ``self.log``, and the progress bar's reward and clip fraction."""

from __future__ import annotations

import torch

from lit_gspo.runtime.collectives import reduce_step_stats


class StepLog:
    """A step without some metric logs NaN for it, not its last value: the keys logged so far are kept."""

    def __init__(self):
        self.keys: set[str] = set()

    def values(self, stats: dict, rollout) -> dict[str, float]:
        """``train/<name>`` (``time/*`` as they are) over every rank, in fp32 as ``self.log`` stores them (the logged
        values are those of earlier runs bit for bit)."""
        stats = reduce_step_stats(
            stats,
            None if rollout is None else rollout.rewards,
            None if rollout is None else rollout.completion_mask.sum(1),
        )
        values = {
            f"train/{k}" if not k.startswith("time/") else k: float(torch.tensor(float(v), dtype=torch.float32))
            for k, v in stats.items()
        }
        values.update({k: float("nan") for k in self.keys - values.keys()})
        self.keys |= values.keys()
        return values

    def log(self, module, values: dict[str, float], batch_size: int) -> None:
        # The row goes to the loggers now, before ModelCheckpoint saves this step in on_train_batch_end (Lightning
        # would log it only after that, and a kill in between would lose it: the resume starts after this step).
        # module.log(logger=False) still gives callbacks (EarlyStopping/ModelCheckpoint on train/*) every value.
        trainer = module.trainer
        every = trainer.log_every_n_steps
        if every and module.rl_step % every == 0 and trainer.is_global_zero:
            for logger in module.loggers:
                logger.log_metrics({**values, "epoch": module.current_epoch}, step=module.rl_step)
                logger.save()
        module.log_dict(values, on_step=True, on_epoch=False, batch_size=batch_size, logger=False)
        # The RL steps done with this one. A logged `step` is what ModelCheckpoint names a checkpoint by (before
        # global_step): the one validation logs (its loggers' x-axis) would otherwise name every later checkpoint
        # until the next validation, and one name written twice overwrites a checkpoint.
        module.log("step", float(module.rl_step + 1), on_step=True, on_epoch=False, batch_size=batch_size, logger=False)
        bar = {"reward": values["train/reward"], "clip": values.get("train/clip_frac", 0.0)}
        module.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=batch_size)
