"""π_old: where one update's old log-probs come from, chosen once per Learner (:func:`old_policy_for`).

    OnPolicy                   one epoch, one minibatch: π_old = π_θ detached, every ratio exactly 1, no extra pass
    RecomputedBeforeFirstStep  the trainer's π_θ before the first optimiser step: until a step is taken each
                               micro-batch's own forward is π_old (and is kept for later epochs); the rows of
                               minibatches 2..M take one no-grad pass before the first epoch
    TrainerPassOverEveryRow    the same, except that ``snapshot`` computes π_old of every row before the update
                               (the mismatch corrections compare it with the sampler's)
    GivenOldLogprobs           the rollout's ``old_logprobs`` as they are: the engine's own (``mismatch.old_logprobs:
                               sampler``, set by the mismatch layer), or a caller's

Each answers, for one micro-batch, ``old_logprobs(update, minibatch, rows, micro, logprobs)`` → (π_old, whether it is
π_θ itself), where ``logprobs`` is π_θ of the micro-batch, detached.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.mismatch import Mismatch
from lit_gspo.rl.rollout import RolloutBatch, index_on


class OldPolicy:
    #: ``snapshot`` computes π_old of every row (an old-policy pass before the update)
    snapshot_computes_old: ClassVar[bool] = False
    #: π_old computed by ``snapshot`` (for a critic's values or MoE routes) is kept as the rollout's ``old_logprobs``
    snapshot_keeps_old: ClassVar[bool] = False
    #: some ratio π_θ/π_old of the update can differ from 1 (its diagnostics are worth logging)
    ratios_move: bool = True

    def before_epoch(self, update, order: Tensor) -> None:
        """Fill what the epoch will read (``update.rollout.old_logprobs``); ``order``: its rows, minibatch by minibatch."""

    def old_logprobs(
        self, update, minibatch, rows: Tensor, micro: RolloutBatch, logprobs: Tensor
    ) -> tuple[Tensor, bool]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class OnPolicy(OldPolicy):
    """One optimiser step: π_old is the update's own forward, detached (the ratio is exactly 1)."""

    ratios_move = False

    def old_logprobs(self, update, minibatch, rows, micro, logprobs):
        return logprobs, True


class RecomputedBeforeFirstStep(OldPolicy):
    """π_old = π_θ before the first optimiser step. Until a step is taken π_θ is π_old, so a micro-batch uses its own
    forward and keeps it for later epochs; the rows a step could precede (minibatches 2..M) get one no-grad pass."""

    snapshot_keeps_old = True

    def __init__(self, policy_logprobs):
        self.policy_logprobs = policy_logprobs  # (rollout, rows) -> (N, T) no-grad log-probs of ``rows``, 0 elsewhere

    def before_epoch(self, update, order):
        rollout = update.rollout
        if rollout.old_logprobs is None:  # the first epoch: the first minibatch's come from its own forward
            later = order[update.size :]
            rollout.old_logprobs = self.policy_logprobs(rollout, later[update.active[later]])

    def old_logprobs(self, update, minibatch, rows, micro, logprobs):
        if update.steps_done == 0:  # no step yet: π_θ is π_old
            old = update.rollout.old_logprobs
            old[index_on(rows, old), : logprobs.shape[1]] = logprobs  # what later epochs read
            return logprobs, True
        if minibatch.placeholder:  # a loss of 0 whose ratio feeds only the clip metrics
            return logprobs, True
        return micro.old_logprobs, False


class TrainerPassOverEveryRow(RecomputedBeforeFirstStep):
    """:class:`RecomputedBeforeFirstStep` whose old-policy pass runs in ``snapshot`` over every row, even on-policy:
    the mismatch corrections compare π_old with the sampler's log-probs before the update."""

    snapshot_computes_old = True

    def __init__(self, policy_logprobs, several_steps: bool):
        super().__init__(policy_logprobs)
        self.ratios_move = several_steps


class GivenOldLogprobs(OldPolicy):
    """π_old is the rollout's ``old_logprobs`` as handed to the update: the sampler's (``mismatch.old_logprobs:
    sampler``: the first minibatch's ratio is π_θ/π_sampler, verl's bypass mode), or a caller's."""

    def before_epoch(self, update, order):
        if update.rollout.old_logprobs is None:
            raise ValueError("GivenOldLogprobs reads the rollout's old_logprobs, and this rollout has none")

    def old_logprobs(self, update, minibatch, rows, micro, logprobs):
        return micro.old_logprobs, False


def old_policy_for(update: Update, mismatch: Mismatch | None, policy_logprobs) -> OldPolicy:
    """The strategy of an update with these settings; ``policy_logprobs(rollout, rows)``: the trainer's no-grad pass."""
    if mismatch is not None and mismatch.sampler_is_old:
        return GivenOldLogprobs()
    if mismatch is not None and mismatch.needs_trainer_old:
        return TrainerPassOverEveryRow(policy_logprobs, several_steps=not update.on_policy)
    if update.on_policy:
        return OnPolicy()
    return RecomputedBeforeFirstStep(policy_logprobs)
