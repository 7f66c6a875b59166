"""One Lightning step per RL step: ``trainer.global_step`` counts RL steps that updated the policy.

An RL step makes K epochs × M minibatches of optimiser steps. Lightning counts every ``LightningOptimizer.step()`` in
``global_step``, which ``max_steps``, ``ModelCheckpoint(every_n_train_steps)`` and the checkpoints' ``step=`` count; the
progress bar and the logs count RL steps. So the learner steps this optimiser: its first step in an RL step goes
through Lightning's optimiser (counted), the others through the strategy's ``optimizer_step``, the very call
``LightningOptimizer.step`` makes (the same precision plugin, GradScaler and ``on_before_optimizer_step`` hook), but
uncounted. An RL step whose every optimiser step was skipped (nothing to learn, a non-finite loss) counts none.
"""

from __future__ import annotations


def _no_closure() -> None:
    return None


class RLStepOptimizer:
    """``on_step()`` after each optimiser step taken (the module's count of them, in its checkpoints)."""

    def __init__(self, lightning_optimizer, strategy, on_step):
        self.lightning_optimizer, self.strategy, self.on_step = lightning_optimizer, strategy, on_step
        self.counted = False

    @property
    def param_groups(self):
        return self.lightning_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.lightning_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        if not self.counted:
            self.counted = True
            out = self.lightning_optimizer.step()
        else:
            out = self.strategy.optimizer_step(self.lightning_optimizer.optimizer, _no_closure)
        self.on_step()
        return out
