"""Resuming a run: every rank from the same step, and the run's logs continued with each step once."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.runtime.collectives import check_ranks_resume_alike


class ResumeAlike(Callback):
    """Every rank resumes from the same step, or all fail at start naming each rank's checkpoint (a node with its own
    ``default_root_dir`` finds no ``last`` and would start from step 0 while the others continue: a hang)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.world_size > 1:
            check_ranks_resume_alike(trainer.ckpt_path, trainer.global_step, trainer.default_root_dir)


class ContinueLogsOnResume(Callback):
    """A resume continues the run's ``metrics.csv`` and ``completions.csv``: the rows logged after the checkpoint it
    starts from (a killed run's last steps) are cut, since the resume logs those steps again: each step appears once."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        from lit_gspo.lightning.completions_log import FILE_NAME, truncate_after
        from lit_gspo.lightning.metrics_file import logged_before

        writer = _continued_writer(trainer)
        if writer is None or checkpoint.get("rl_step") is None:
            return
        rl_step = int(checkpoint["rl_step"])
        dropped = writer.truncate(logged_before(rl_step))
        dropped_completions = truncate_after(Path(writer.log_dir) / FILE_NAME, rl_step)
        if dropped or dropped_completions:
            rank_zero_info(
                f"{writer.log_dir}: dropped {dropped} metrics row(s) and {dropped_completions} completion "
                "row(s) logged after the checkpoint; this run logs those steps again"
            )


def _continued_writer(trainer):
    """The ``ContinuedWriter`` of the run's ``RunCSVLogger`` (rank 0), its pending rows flushed; None without one."""
    from lit_gspo.lightning.metrics_file import RunCSVLogger

    for logger in trainer.loggers:
        if isinstance(logger, RunCSVLogger) and trainer.is_global_zero:
            logger.save()
            return logger.experiment
    return None
