"""The optimiser step of one minibatch, as the update calls it: ``step(optimizer, clip, may_step)``.

    clip()           clips the gradient norm to ``update.max_grad_norm``; returns the norm before clipping
    may_step(norm)   whether the step may be taken (the update's hooks: the finite guard)
    returns          the gradient norm of a step taken, or None for a step skipped

:func:`clip_then_step` is the plain one; a trainer whose optimiser step does more (fp16's GradScaler, which unscales
inside it and may skip an overflow) hands in its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def clip_then_step(optimizer, clip: Callable[[], float], may_step: Callable[[float], bool]) -> float | None:
    norm = clip()
    if not may_step(norm):
        return None
    optimizer.step()
    torch.clear_autocast_cache()  # an autocast with its cast cache on (not Lightning's) would keep the old weights
    return norm
