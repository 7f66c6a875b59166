"""What an update does besides loss → backward → step: named hooks with one protocol, called by ``Learner.learn``.

before_update(update)                  the update's rollout and records, before the first epoch
around_micro(micro)                    a context around one micro-batch's forward and backward
before_loss(update, step)              a micro-batch's π_θ and π_old are known; its advantages may change
filler(update)                         a filler pass (``rank_pairing.py``) between its forward and backward: a hook whose
                                       before_loss is a collective joins the other ranks' here
after_backward(update, minibatch)      the minibatch's gradient is complete, not yet clipped
may_step(update, minibatch, loss, grad_norm)   whether the optimiser may step (every hook must agree)
metrics(update)                        the step's metrics, after the last epoch

MaskTruncated        DAPO's overlong filtering: rows whose last reply the token budget cut train on no token
HighEntropyTokens    "Beyond the 80/20 rule": only the micro-batch's top-ρ entropy tokens (of every rank's) carry the
                     policy gradient
MismatchCorrection   the sampler–trainer mismatch layer (``mismatch.py``): corrected rollout, OPSM, measures
RoutingReplay        MoE: the old pass's experts in the update's forward (and in backward's recomputation)
RoutingVolatility    MoE: how far the update moved the routing (``Learner.measure_routing``)
RatioDiagnostics     how far the product of token ratios drifts (``diagnostics.py``)
FiniteGuard          no optimiser step on a NaN/inf loss or gradient norm; ``max_nonfinite_steps`` in a row raise
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from lit_gspo.models.routing import replay_routing
from lit_gspo.rl.learn.diagnostics import RatioStats
from lit_gspo.rl.learn.mismatch import Mismatch, mismatch_metrics
from lit_gspo.rl.objectives.base import masked_mean
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.runtime.collectives import gather_cat


@dataclass
class MicroStep:
    """One micro-batch between its forward and its loss."""

    batch: RolloutBatch  # the (trimmed) micro-batch
    placeholder: bool  # its minibatch has no row with a gradient (a loss of 0 that keeps every rank stepping)
    logprobs: Tensor  # π_θ, with its graph
    old_logprobs: Tensor  # π_old
    old_is_current: bool  # π_old is π_θ itself (detached): the ratio is 1 by construction
    advantages: Tensor  # what the loss reads (a hook may change them)
    metrics: dict = field(default_factory=dict)  # added to the micro-batch's metrics
    entropy: Tensor | None = None  # (B, T) π_θ's entropy per token, detached, where the forward computed it
    trained: Tensor | None = None  # (B, T) bool: the tokens a hook left the policy gradient on (None: every one)


class UpdateHook:
    """A concern of the update outside its loop; each method a no-op unless overridden."""

    def before_update(self, update) -> None:
        pass

    def around_micro(self, micro: RolloutBatch):
        return nullcontext()

    def before_loss(self, update, step: MicroStep) -> None:
        pass

    def filler(self, update) -> None:
        pass

    def after_backward(self, update, minibatch) -> None:
        pass

    def may_step(self, update, minibatch, loss: float, grad_norm: float) -> bool:
        return True

    def metrics(self, update) -> dict[str, float]:
        return {}


class MaskTruncated(UpdateHook):
    """DAPO's overlong filtering (``update.mask_truncated_completions``): the loss mask of every row whose last reply the
    token budget cut (``RolloutBatch.truncated``) is emptied. The row keeps its advantage and counts as a sequence in
    the normalisers, as in TRL; it runs no forward or backward (no token of it carries a gradient)."""

    def before_update(self, update) -> None:
        rollout = update.rollout
        if rollout.truncated is None:
            raise ValueError(
                "update.mask_truncated_completions needs to know which rows the token budget cut, and this rollout "
                "does not say (RolloutBatch.truncated is None: the collector sets it); set it, or turn the option off"
            )
        keep = ~rollout.truncated.to(rollout.completion_mask.device)
        update.rollout = replace(rollout, completion_mask=rollout.completion_mask & keep[:, None])


class HighEntropyTokens(UpdateHook):
    """``update.top_entropy_quantile`` ρ < 1: Â_{i,t} ← 0 where H_{i,t} < the (1 − ρ)-quantile of H over the
    micro-batch's completion tokens of every rank (H: π_θ's entropy, detached), as TRL's ``get_high_entropy_mask`` over
    every process's forward. Collective: every rank gathers at each of its micro-batches, a filler's included (as many
    on every rank, ``rank_pairing.py``)."""

    def __init__(self, quantile: float):
        self.quantile = quantile

    def before_loss(self, update, step: MicroStep) -> None:
        mask = step.batch.completion_mask
        counted = not step.placeholder and step.entropy is not None
        everyone = gather_cat(step.entropy[mask].float() if counted else torch.zeros(0, device=mask.device))
        if not counted or not bool(mask.any()):
            return
        threshold = torch.quantile(everyone, 1 - self.quantile)
        keep = (step.entropy >= threshold) & mask
        advantages = step.advantages if step.advantages.dim() == 2 else step.advantages[:, None].expand_as(mask)
        step.advantages = torch.where(keep, advantages, torch.zeros((), dtype=advantages.dtype))
        step.trained = keep
        step.metrics["high_entropy_token_frac"] = masked_mean(keep.float(), mask)

    def filler(self, update) -> None:  # no token here: the gather of the others' micro-batches
        gather_cat(torch.zeros(0))


class Hooks(UpdateHook):
    """Several hooks as one, called in order."""

    def __init__(self, hooks: list[UpdateHook]):
        self.hooks = list(hooks)

    def before_update(self, update):
        for hook in self.hooks:
            hook.before_update(update)

    def around_micro(self, micro):
        stack = ExitStack()
        for hook in self.hooks:
            stack.enter_context(hook.around_micro(micro))
        return stack

    def before_loss(self, update, step):
        for hook in self.hooks:
            hook.before_loss(update, step)

    def filler(self, update):
        for hook in self.hooks:
            hook.filler(update)

    def after_backward(self, update, minibatch):
        for hook in self.hooks:
            hook.after_backward(update, minibatch)

    def may_step(self, update, minibatch, loss, grad_norm):
        return all([hook.may_step(update, minibatch, loss, grad_norm) for hook in self.hooks])  # each one asked

    def metrics(self, update):
        return {k: v for hook in self.hooks for k, v in hook.metrics(update).items()}


class MismatchCorrection(UpdateHook):
    """The mismatch layer (``mismatch.py``): the update learns from a corrected copy of the rollout (the caller's keeps
    its mask and advantages), OPSM acts in each micro-step on π_θ, and with the sampler as π_old every micro-step
    measures the trainer against it."""

    def __init__(self, mismatch: Mismatch):
        self.mismatch = mismatch

    def before_update(self, update):
        update.rollout, emptied, records = self.mismatch.before_update(update.rollout)
        update.emptied = emptied.cpu()
        update.records.extend(records)

    def before_loss(self, update, step):
        current = step.logprobs.detach()
        step.advantages, opsm = self.mismatch.in_update(step.batch, current)
        step.metrics.update(opsm)
        if self.mismatch.sampler_is_old and not step.placeholder:  # π_old is the sampler: the trainer against it
            mask = step.batch.completion_mask
            measured = mismatch_metrics(current, step.old_logprobs, mask)
            update.records.append(({k: float(v) for k, v in measured.items()}, float(mask.sum())))


class RoutingReplay(UpdateHook):
    """MoE: each micro-batch routes through the experts its old-policy pass chose (``rollout.routing``), around
    backward too: checkpointed layers route again when recomputed."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    def around_micro(self, micro):
        return replay_routing(self.policy, micro.routing) if micro.routing is not None else nullcontext()


class RoutingVolatility(UpdateHook):
    """MoE: the routing measures of ``measure(rollout)`` after the update, against the old pass's routes."""

    def __init__(self, measure):
        self.measure = measure

    def metrics(self, update):  # also on a rank without rows (NaN there): its passes pair with the others'
        rollout = update.rollout
        return self.measure(rollout) if rollout.routing is not None or not len(rollout) else {}


class RatioDiagnostics(UpdateHook):
    """``ratio/*``: the ratios of the micro-steps whose π_old is not their own forward (``diagnostics.py``); NaN when
    there are none, so every step logs the same keys."""

    def __init__(self, max_len: int):
        self.max_len, self.stats = max_len, RatioStats()

    def before_update(self, update):
        self.stats = RatioStats()

    def before_loss(self, update, step):
        if not step.old_is_current and not step.placeholder:
            self.stats.add(step.logprobs, step.old_logprobs, step.batch.completion_mask)

    def metrics(self, update):
        return {f"ratio/{k}": v for k, v in self.stats.compute(self.max_len).items()}


class FiniteGuard(UpdateHook):
    """No optimiser step on a non-finite loss or gradient norm: a warning, and ``max_nonfinite_steps`` in a row raise.
    ``loss`` and ``grad_norm`` are global (summed over ranks), so every rank decides alike and none steps, raises or
    waits alone. Counts across updates."""

    def __init__(self, max_nonfinite_steps: int):
        self.limit, self.updates, self.in_a_row = max_nonfinite_steps, 0, 0

    def may_step(self, update, minibatch, loss, grad_norm):
        self.updates += 1
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        where = (
            f"update {self.updates} (epoch {minibatch.epoch + 1}, minibatch {minibatch.index + 1} of this rollout): "
            f"loss={loss}, grad_norm={grad_norm}"
        )
        warnings.warn(
            f"non-finite {where}; skipped the optimiser step ({self.in_a_row} in a row, "
            f"the run stops at max_nonfinite_steps={self.limit})",
            RuntimeWarning,
            stacklevel=2,
        )
        if self.in_a_row >= self.limit:
            raise RuntimeError(
                f"{self.in_a_row} optimiser steps in a row had a non-finite loss or gradient norm (last: {where}); "
                "no weights were changed by them. Lower the learning rate, check the rewards and the objective for "
                f"NaN/inf, or raise update.max_nonfinite_steps={self.limit}"
            )
        return False
