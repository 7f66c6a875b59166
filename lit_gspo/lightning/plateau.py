"""A ``ReduceLROnPlateau`` schedule in an RL run: the metric it follows, checked at start, and its step each time that
metric is logged (the other schedules are stepped by the learner after each optimiser step)."""

from __future__ import annotations

import torch

from lit_gspo.lightning.validation import VALIDATION_NAMES
from lit_gspo.runtime.user_errors import SettingsError


def plateau_monitor(scheduler, val_metrics: list[str] | None) -> str | None:
    """The metric a ReduceLROnPlateau follows (Lightning's ``lightning.pytorch.cli.ReduceLROnPlateau`` carries it as
    ``monitor``), None for another schedule; :func:`check_plateau_monitor` refuses what cannot work."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    return check_plateau_monitor(getattr(scheduler, "monitor", None), val_metrics)


def check_plateau_monitor(monitor: str | None, val_metrics: list[str] | None) -> str:
    """Refused in one line: no monitor (torch's ReduceLROnPlateau), a monitor that is neither ``train/*`` nor one of
    ``val_metrics`` (None: any ``val/*``)."""
    if monitor is None:
        raise SettingsError(
            "--model.lr_scheduler torch.optim.lr_scheduler.ReduceLROnPlateau has no monitor: use "
            "lightning.pytorch.cli.ReduceLROnPlateau with --model.lr_scheduler.monitor val/reward "
            "--model.lr_scheduler.mode max"
        )
    if not (monitor.startswith("train/") or (monitor in val_metrics if val_metrics else monitor.startswith("val/"))):
        names = (
            f"one of {', '.join(val_metrics)} (after each validation)"
            if val_metrics
            else f"a val/* metric (after each validation: {', '.join(VALIDATION_NAMES)}, ...)"
        )
        raise SettingsError(
            f"--model.lr_scheduler.monitor {monitor}: never logged; monitor {names} or a train/* metric (each RL step)"
        )
    return monitor


def step_plateau(module, values: dict, split: str) -> None:
    """Step ``module``'s ReduceLROnPlateau with its monitored metric when ``split``'s metrics (``train``/``val``) are
    logged during fit; a ``train/*`` monitor the step did not log is refused in one line."""
    monitor = module.plateau_metric
    if not monitor or not monitor.startswith(f"{split}/") or module.trainer.state.fn != "fit":
        return
    if monitor not in values:
        raise SettingsError(
            f"--model.lr_scheduler.monitor {monitor}: not logged; the {split}/* metrics are "
            + ", ".join(sorted(k for k in values if k.startswith(f"{split}/")))
        )
    value = float(values[monitor])
    if value == value:  # NaN (a step that logged nothing for it): not a measurement
        module.lr_scheduler_step(module.lr_schedulers(), value)  # Lightning's hook: a subclass may step it
