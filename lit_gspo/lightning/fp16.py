"""fp16 (``16-mixed``): the optimiser step under Lightning's ``MixedPrecision`` plugin and its GradScaler.

The plugin unscales the gradients inside ``optimizer.step()`` and then calls the module's ``on_before_optimizer_step``,
where they are clipped (:meth:`GradScalerStep.clip_unscaled`); an overflow step is skipped by the scaler, which lowers
its scale: expected in fp16, so the learner skips it without counting it in its guard's run of non-finite steps.
"""

from __future__ import annotations

import math

import torch


class GradScalerStep:
    """The learner's ``step(optimizer, clip, may_step)`` (``lit_gspo.rl.learn.optimizer_step``) with a GradScaler."""

    def __init__(self, scaler):
        self.scaler, self.clip, self.norm = scaler, None, float("nan")

    def __call__(self, optimizer, clip, may_step) -> float | None:
        if not may_step(0.0):  # the loss alone: the gradients are still scaled
            return None
        self.clip, self.norm = clip, float("nan")
        scale = self.scaler.get_scale()
        optimizer.step()  # unscale, on_before_optimizer_step (clip_unscaled), step unless overflowed, update the scale
        torch.clear_autocast_cache()
        overflowed = not math.isfinite(self.norm) or self.scaler.get_scale() < scale
        return None if overflowed else self.norm

    def clip_unscaled(self) -> None:
        """Between the scaler's unscale and its step: clip the unscaled gradients and keep their norm."""
        if self.clip is not None:
            self.norm = self.clip()
