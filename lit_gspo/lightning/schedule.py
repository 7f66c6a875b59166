"""When RLModule steps its learning-rate schedule: Lightning's ``interval`` and ``frequency``, in RL terms.

RLModule optimises by hand (K epochs × M minibatches of optimiser steps per RL step), so Lightning steps no schedule;
Lightning's ``lr_scheduler_config`` keys are honoured here instead (``--model.update.scheduler_interval``,
``--model.update.scheduler_frequency``):

* ``step`` (the default): after every optimiser step taken (``RLModule.optimizer_steps`` counts them);
* ``rl_step``: after every RL step that updated the policy (one Lightning batch: one rollout, K × M optimiser steps);
* ``epoch``: after every data epoch (Lightning's ``current_epoch``; ``max_epochs``).

The schedule steps every ``frequency``-th of those, counted by what a checkpoint restores (optimiser steps, RL steps,
epochs: all in the checkpoint), so a resume keeps the cadence. ``train/lr`` (metrics.csv) is the rate after the RL step's updates and schedule
steps; an ``epoch`` schedule changes it from the next epoch's first step. A ``ReduceLROnPlateau`` is stepped when its
monitor is logged (``lit_gspo.lightning.plateau.step_plateau``): ``interval``/``frequency`` other than the defaults are refused with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from lit_gspo.runtime.user_errors import SettingsError, option

Interval = Literal["step", "rl_step", "epoch"]
INTERVALS = ("step", "rl_step", "epoch")


@dataclass(frozen=True)
class ScheduleCadence:
    """``interval`` and ``frequency`` of RLModule's learning-rate schedule (module docstring)."""

    interval: str = "step"
    frequency: int = 1

    def __post_init__(self):
        if self.interval not in INTERVALS:
            raise SettingsError(
                f"{option('model.update.scheduler_interval', self.interval)}: use one of {', '.join(INTERVALS)} (each "
                "optimiser step, each RL step, each data epoch)"
            )
        if isinstance(self.frequency, bool) or not isinstance(self.frequency, int) or self.frequency < 1:
            raise SettingsError(
                f"{option('model.update.scheduler_frequency', self.frequency)}: must be an int >= 1 (the schedule steps "
                f"every n-th {self.interval})"
            )

    @property
    def is_default(self) -> bool:
        return (self.interval, self.frequency) == ("step", 1)

    def check(self, scheduler) -> ScheduleCadence:
        """``self`` for ``scheduler`` (a schedule, its class, its factory, or None); a cadence other than the default
        without a schedule to step is refused, as is one with a ReduceLROnPlateau (it steps each time its monitor is
        logged)."""
        if self.is_default:
            return self
        given = (
            f"{option('model.update.scheduler_interval', self.interval)} "
            f"{option('model.update.scheduler_frequency', self.frequency)}"
        )
        if scheduler is None:
            raise SettingsError(f"{given}: no --model.lr_scheduler to step; give one, or leave both unset")
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        if isinstance(scheduler, plateau) or (isinstance(scheduler, type) and issubclass(scheduler, plateau)):
            raise SettingsError(
                f"{given} with a ReduceLROnPlateau: it steps each time its monitor is logged (val/* after each "
                "validation, train/* after each RL step); leave both unset"
            )
        return self

    def lightning_config(self) -> dict:
        """The keys of Lightning's ``lr_scheduler_config`` (read by ``LearningRateMonitor``: an ``rl_step`` schedule
        changes with the batches, Lightning's ``step``)."""
        return {"interval": "epoch" if self.interval == "epoch" else "step", "frequency": self.frequency}

    def per_optimizer_step(self, scheduler, optimizer_steps: Callable[[], int]):
        """What the learner steps after each optimiser step: the schedule (``step``, every one), a :class:`EveryNth` of
        it, or None (another interval, or no schedule)."""
        if scheduler is None or self.interval != "step":
            return None
        return scheduler if self.frequency == 1 else EveryNth(scheduler, self.frequency, optimizer_steps)

    def after(self, interval: str, scheduler, count: int) -> bool:
        """Step ``scheduler`` when ``interval`` is this cadence's and ``count`` (RL steps or epochs done) is a multiple
        of the frequency; whether it stepped."""
        if scheduler is None or interval != self.interval or count % self.frequency:
            return False
        scheduler.step()
        return True


class EveryNth:
    """A schedule stepped only when ``count()`` (optimiser steps done) is a multiple of ``n``."""

    def __init__(self, scheduler, n: int, count: Callable[[], int]):
        self.scheduler, self.n, self.count = scheduler, n, count

    def step(self) -> None:
        if self.count() % self.n == 0:
            self.scheduler.step()


class HookStepped:
    """``module``'s schedule, stepped through Lightning's ``lr_scheduler_step`` hook (its default: ``scheduler.step()``;
    a subclass's override steps a schedule that the default cannot, e.g. one that takes the epoch)."""

    def __init__(self, module, scheduler):
        self.module, self.scheduler = module, scheduler

    def step(self) -> None:
        self.module.lr_scheduler_step(self.scheduler, None)


def stepped_schedule(module) -> HookStepped | None:
    """``module``'s schedule stepped at its cadence (None: none, or a ReduceLROnPlateau, stepped on its metric)."""
    scheduler = None if module.plateau_metric else module.lr_schedulers()
    return None if scheduler is None else HookStepped(module, scheduler)


def learner_schedule(module):
    """What the learner steps after each optimiser step of ``module`` (an RLModule)."""
    return module.schedule_cadence.per_optimizer_step(stepped_schedule(module), lambda: module.optimizer_steps)


def after_rl_step(module, stats: dict) -> None:
    """An ``rl_step`` schedule steps after the RL step's updates; ``train/lr`` is then the rate after it."""
    if module.schedule_cadence.after("rl_step", stepped_schedule(module), module.rl_step + 1):
        stats["lr"] = module.optimizers().param_groups[0]["lr"]


def after_epoch(module) -> None:
    module.schedule_cadence.after("epoch", stepped_schedule(module), module.current_epoch + 1)
