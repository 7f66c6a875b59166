"""One progress bar over RL steps: ``RL step 37/500 |███▏      | [01:02<13:00, 1.69s/it, reward=0.41, clip=0.002]``.

Lightning's bar counts batches of the current data epoch ("Epoch 11 27/27"), from 0 again after a resume. This one
counts RL steps (rollout batches)
from ``RLModule.rl_step``, so it starts where a resumed run left off, and its total is the run's:
``trainer.max_steps`` (RL steps: one Lightning step per RL step), or the batches per epoch × ``max_epochs``
(whichever ends the run first). ``RLCLI`` uses it unless ``--trainer.enable_progress_bar false``; with a
plain ``lightning.Trainer`` pass ``callbacks=[RLProgressBar()]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

from lit_gspo.rl.rewards import TrainerState


def total_rl_steps(trainer, pl_module) -> int | None:
    """RL steps the run will reach (None: unbounded or unknown)."""
    totals = []
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        totals.append(trainer.max_steps)  # one Lightning step per RL step (lit_gspo/lightning/rl_step_optimizer.py)
    per_epoch, max_epochs = trainer.num_training_batches, trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and per_epoch is not None and math.isfinite(per_epoch):
        totals.append(int(per_epoch) * max_epochs)
    return min(totals) if totals else None


class RLProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting RL steps across data epochs and resumes (validation/test bars unchanged)."""

    RL_BAR_FORMAT = "RL step {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def init_train_tqdm(self) -> Tqdm:
        bar = super().init_train_tqdm()
        bar.bar_format = self.RL_BAR_FORMAT  # the train bar only (tqdm would print a description as "RL step: ")
        return bar

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.total = convert_inf(total_rl_steps(trainer, pl_module))
        # a resumed run starts at its RL step; the rate and ETA count only this session's steps
        bar.initial = bar.n = getattr(pl_module, "rl_step", 0)
        bar.refresh()

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        """One bar for the whole run: a new data epoch does not reset it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        n = getattr(pl_module, "rl_step", batch_idx + 1)
        if bar is not None and not bar.disable and self._should_update(n, bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


class RLRichProgressBar(RichProgressBar):
    """Lightning's Rich bar, counting RL steps of the run ("RL step 37/500") instead of "Epoch 0/-2" and the batches
    of a data epoch. ``lit-gspo fit --trainer.callbacks+=RichProgressBar`` gets this one (same arguments)."""

    DESCRIPTION = "RL step"

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_rl_steps(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_rl_steps(trainer, pl_module)

    def _show_rl_steps(self, trainer, pl_module) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        self.progress.update(
            self.train_progress_bar_id,
            description=self.DESCRIPTION,
            total=total_rl_steps(trainer, pl_module),
            completed=getattr(pl_module, "rl_step", 0),
        )
        self.refresh()


def is_last_rl_step(trainer, pl_module) -> bool:
    """Whether the run ends after the RL step just done (``max_steps`` RL steps, or the last batch of the last
    epoch): the module then stops the fit itself, so that Lightning's loop validates after this step."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
    return last_epoch and trainer.is_last_batch


class SkippedSteps:
    """A skipped step makes no optimiser step, so ``max_steps`` alone would never end a run that keeps skipping:
    ``limit`` skipped RL steps in a row stop it. ``updated`` is the same on every rank, so all ranks stop at the same
    step, each with the first rank's reward error."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def count(self, updated: bool, stats: dict, reward_errors: Callable[[], list[str]]) -> None:
        """``reward_errors()``: the last reward error of every rank (a collective: called on every rank alike)."""
        self.in_a_row = 0 if updated else self.in_a_row + 1
        if self.in_a_row >= self.limit:
            reward_errors = [e for e in reward_errors() if e]
            raise RuntimeError(
                f"{self.in_a_row} RL steps in a row had nothing to learn from (frac_zero_std_groups="
                f"{stats.get('frac_zero_std_groups', float('nan')):.2f}, reward_failed={stats.get('reward_failed', 0):.0f}): "
                "every group's rewards were equal or every reward failed. Check the reward functions, or raise "
                f"--model.generation.max_skipped_steps {self.limit}"
                + (f". The last reward error: {reward_errors[0]}" if reward_errors else "")
            )


def reward_trainer_state(trainer, pl_module) -> TrainerState:
    """What TRL passes its reward functions as ``trainer_state``: the RL step, the run's length, the epoch."""
    return TrainerState(
        global_step=pl_module.rl_step,
        max_steps=total_rl_steps(trainer, pl_module) or 0,
        epoch=float(trainer.current_epoch),
        num_train_epochs=max(trainer.max_epochs or 0, 0),
    )
