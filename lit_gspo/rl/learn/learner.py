"""learn: the old-policy snapshot and K epochs × M minibatches × micro-batches of optimiser steps.

    snapshot(rollout):  reference log-probs; old values and MoE routes when a critic or routing needs the
                        old-policy pass (old log-probs otherwise wait for learn: see below)
    learn(rollout):     for epoch in 1..K:
                            π_old of minibatches 2..M                             fill_old_logprobs
                            for minibatch in 1..M:                                minibatches
                                counts = tokens and sequences of the whole minibatch, over every rank
                                for micro-batch: loss = objective(logp, old_logp, Â, mask, counts); backward
                                                                                  micro_loss
                                (a hook for subclasses)                           after_backward
                                clip, optimiser step, scheduler step              optimizer_step
                                (no step when the loss or gradient norm is NaN/inf: counted, warned, and
                                ``update.max_nonfinite_steps`` of them in a row raise)

:meth:`Learner.learn` is that loop and nothing else; each concern lives in the hook named beside it, and the state
one update carries from minibatch to minibatch is an :class:`UpdateState`.

Old log-probs: the first minibatch's equal its own detached log-probs (no optimiser step yet), so an
old-policy pass runs only for minibatches 2..M, and not at all on-policy (one epoch, one minibatch).
With ``mismatch`` (lit_gspo.rl.learn.mismatch) the pass runs over every row in ``snapshot`` (its corrections compare
it with the sampler's log-probs before the update), or never (``old_logprobs: sampler``: π_old = π_sampler).
Rows whose advantage is 0 everywhere are left out of forward and backward when the objective's
gradient vanishes there; they still count in the normalisers. No Lightning here: the trainer hands in
the optimiser, the scheduler and its backward.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.diagnostics import RatioStats
from lit_gspo.runtime.collectives import all_reduce_sum, reduce_weighted_means, sum_over_ranks
from lit_gspo.runtime.sharding import is_sharded
from lit_gspo.rl.learn.mismatch import Mismatch, mismatch_metrics
from lit_gspo.models import checkpointing_active
from lit_gspo.models.lora import reference_mode
from lit_gspo.models.routing import (RoutingRecord, moe_routers, record_routing, replay_routing, rerouted_tokens,
                                     routing_volatility)
from lit_gspo.rl.objectives import Counts, Objective
from lit_gspo.rl.rollout import RolloutBatch, TokenForward, micro_batch_rows, token_logprobs


@dataclass
class UpdateState:
    """What one :meth:`Learner.learn` carries from minibatch to minibatch."""

    rollout: RolloutBatch  # what is learned from (a mismatch-corrected copy under ``mismatch``)
    emptied: Tensor  # (N,) bool: sequences the mismatch masks emptied, out of the sequence count
    active: Tensor  # (N,) bool: rows whose loss can have a gradient (:meth:`Learner.rows_with_gradient`)
    records: list[tuple[dict, float]]  # (metrics, tokens) of each micro-batch, token-weighted at the end
    size: int  # rows per minibatch, ⌈N / M⌉
    ratio_stats: RatioStats = field(default_factory=RatioStats)  # ratios seen after ≥1 step (before it they are 1)
    steps_done: int = 0  # optimiser steps taken
    losses: list[float] = field(default_factory=list)  # of the steps taken (global: summed over ranks)
    grad_norms: list[float] = field(default_factory=list)
    nonfinite: int = 0  # minibatches skipped as non-finite


@dataclass
class Minibatch:
    """One minibatch of an epoch: the rows that run forward and backward, the global counts of all its rows."""

    rows: Tensor
    counts: Counts
    epoch: int
    index: int
    placeholder: bool  # no row has a gradient: one row runs with loss 0, so that every rank steps alike
    skipped_tokens: float  # tokens of the rows left out (Â = 0 everywhere)
    first_record: int  # where its metric records start (dropped if the step is skipped)
    loss: float = 0.0  # this rank's share of the minibatch loss (normalised by the global counts)


class Learner:
    """Updates ``policy`` (and ``value_head``) on rollouts with ``objective``.

    Args:
        policy: the causal LM being trained.
        objective: the loss.
        update: epochs, minibatches, micro-batches, gradient clipping, row skipping, prompt sharing.
        value_head: the critic's head on the decoder's last state (objectives with ``needs_critic``).
        reference: where reference log-probs come from: a frozen model, ``"adapters_off"`` (LoRA: the
            policy with its adapters disabled) or None (no reference log-probs).
        temperature: the sampling temperature (log-probs are those of the distribution sampled from).
        max_len: the generation budget L (``Counts.max_len``, Dr. GRPO's constant length).
        group_size: G, for ``update.shuffle="groups"``.
        routing_replay: MoE: replay the old pass's experts in the update's forward.
        record_routing: MoE: record the old pass's experts (for replay, or to measure volatility).
        gradient_checkpointing: the policy recomputes its layers in backward (no shared prompt forward).
        mismatch: correct and measure the sampler–trainer mismatch (``lit_gspo.rl.learn.mismatch``); None: off.
    """

    def __init__(self, policy: nn.Module, objective: Objective, update: Update, *, value_head: nn.Module | None = None,
                 reference: nn.Module | str | None = None, temperature: float = 1.0, max_len: int = 1,
                 group_size: int = 1, routing_replay: bool = False, record_routing: bool = False,
                 gradient_checkpointing: bool = False, mismatch: Mismatch | None = None):
        if reference is not None and not isinstance(reference, nn.Module) and reference != "adapters_off":
            raise ValueError(f"reference must be a model, 'adapters_off' or None, got {reference!r}")
        if (routing_replay or record_routing) and not moe_routers(policy):
            raise ValueError("routing_replay/record_routing need an MoE policy with top-k routers; this one has none")
        self.policy, self.objective, self.cfg, self.value_head = policy, objective, update, value_head
        self.reference, self.temperature, self.max_len, self.group_size = reference, temperature, max_len, group_size
        self.routing_replay, self.records_routing = routing_replay, record_routing or routing_replay
        self.gradient_checkpointing, self.mismatch = gradient_checkpointing, mismatch
        self.sampler_is_old = mismatch is not None and mismatch.sampler_is_old
        self.is_moe = bool(moe_routers(policy))
        self.updates = 0  # minibatch updates attempted, across rollouts (named in non-finite warnings)
        self.nonfinite_in_a_row = 0
        # fp16 (16-mixed): Lightning's GradScaler, set by the module. Its plugin unscales inside ``opt.step()`` and then
        # calls ``on_before_optimizer_step``, where the module clips (:meth:`clip_unscaled`); an overflow step is skipped
        # by the scaler, which lowers its scale: expected in fp16, so not counted as a non-finite step.
        self.grad_scaler = None
        self.unscaled_norm = float("nan")

    # ------------------------------------------------------------------ snapshot
    @torch.no_grad()
    def snapshot(self, rollout: RolloutBatch) -> None:
        """Reference log-probs; old values, routes (and old log-probs, off-policy) when a critic or routing needs the pass;
        old log-probs of every row when the mismatch corrections compare them with the sampler's."""
        need_old = self.value_head is not None or self.records_routing
        every_old = self.mismatch is not None and self.mismatch.needs_trainer_old  # π_old of every row, even on-policy
        olds, refs, vals, routes, order = [], [], [], [], []
        for micro_rows, micro in self.micro_batches(rollout, with_rows=True):
            order.append(micro_rows)
            if need_old:
                with record_routing(self.policy) if self.records_routing else nullcontext() as recorder:
                    fwd = self.completion_logprobs(self.policy, micro, value_head=self.value_head)
                if recorder is not None:
                    routes.append(recorder.record)
                olds.append(fwd.logprobs)
                if fwd.values is not None:
                    vals.append(fwd.values.float())
            elif every_old:
                olds.append(self.completion_logprobs(self.policy, micro).logprobs)
            if self.reference is not None:
                refs.append(self.reference_logprobs(micro))
        # a token budget deals rows to micro-batches by length: put them back in rollout order
        inverse = torch.argsort(torch.cat(order)) if order else None
        if need_old and not self.cfg.on_policy or every_old:  # on-policy the update still reads its own forward
            rollout.old_logprobs = torch.cat(olds)[inverse]
        if routes:
            rollout.routing = RoutingRecord.cat(routes)[inverse]  # (N, P + T, k) per MoE layer
        if refs:
            rollout.ref_logprobs = torch.cat(refs)[inverse]
        if vals:
            rollout.old_values = torch.cat(vals)[inverse]

    def reference_logprobs(self, micro: RolloutBatch) -> Tensor:
        if self.reference == "adapters_off":
            with reference_mode(self.policy):
                return self.completion_logprobs(self.policy, micro).logprobs
        return self.completion_logprobs(self.reference, micro).logprobs

    # ------------------------------------------------------------------ learn
    def learn(self, rollout: RolloutBatch, optimizer, scheduler=None, *, backward: Callable[[Tensor], None] | None = None,
              world_size: int = 1) -> dict[str, float]:
        """K epochs × M minibatches of optimiser steps on ``rollout`` (advantages set); returns the step's metrics.

        ``backward(loss)`` defaults to ``loss.backward()``; ``world_size``: each rank's loss is its share of the
        global minibatch, multiplied by the world size because DDP and FSDP2 average gradients over ranks.
        """
        backward = backward or Tensor.backward
        with checkpointing_active(self.policy):  # a no-op unless gradient checkpointing is on
            update = self.begin(rollout)
            for epoch in range(self.cfg.epochs):
                order = self.minibatch_order(len(rollout))
                self.fill_old_logprobs(update, order)
                for minibatch in self.minibatches(update, order, epoch):
                    optimizer.zero_grad()
                    for micro_rows, micro in self.micro_batches(update.rollout.select(minibatch.rows), with_rows=True):
                        micro = micro.trimmed()
                        with self.replayed_routing(micro):  # around backward too: checkpointed layers route again
                            loss = self.micro_loss(update, minibatch, micro_rows, micro)
                            backward(loss * world_size)  # DDP/FSDP2 average gradients over ranks
                    self.after_backward(update, minibatch)
                    self.optimizer_step(update, minibatch, optimizer, scheduler)
            return self.metrics(update, optimizer)

    # ------------------------------------------------------------------ the hooks of learn, in the order it calls them
    def begin(self, rollout: RolloutBatch) -> UpdateState:
        """The state of one ``learn``: the rollout to learn from (a mismatch-corrected copy when ``mismatch`` is set: the
        caller's keeps its mask and advantages), the rows with a gradient, the metric records."""
        n = len(rollout)
        records: list[tuple[dict, float]] = []
        emptied = torch.zeros(n, dtype=torch.bool)  # sequences the mismatch masks emptied: out of the sequence count
        if self.mismatch is not None:
            rollout, emptied, records = self.mismatch.before_update(rollout)
            emptied = emptied.cpu()
        return UpdateState(rollout=rollout, emptied=emptied, active=self.rows_with_gradient(rollout), records=records,
                           size=math.ceil(n / self.cfg.num_minibatches))

    def fill_old_logprobs(self, update: UpdateState, order: Tensor) -> None:
        """Off-policy, before the first epoch: π_old of the rows of minibatches 2..M (those of the first minibatch come
        from its own forward, before any optimiser step: :meth:`micro_loss`)."""
        rollout = update.rollout
        if self.cfg.on_policy or rollout.old_logprobs is not None:
            return
        later = order[update.size:]
        rollout.old_logprobs = self.old_logprobs(rollout, later[update.active[later]])

    def minibatches(self, update: UpdateState, order: Tensor, epoch: int):
        """The minibatches of one epoch, ``order`` cut in M: each with the global counts of all its rows, and the rows
        that run forward and backward (those without gradient left out; if none has one, a single row still runs, a
        placeholder whose loss is 0, so that every rank backpropagates and the optimiser steps as on a zero gradient)."""
        rollout, size = update.rollout, update.size
        for start in range(0, len(order), size):
            rows = order[start:start + size]
            counts = self.global_counts(rollout.completion_mask[rows], int(update.emptied[rows].sum()))
            kept = update.active[rows].clone()
            placeholder = not bool(kept.any())
            kept[0] |= placeholder
            yield Minibatch(rows=rows[kept], counts=counts, epoch=epoch, index=start // size, placeholder=placeholder,
                            skipped_tokens=float(rollout.completion_mask[rows[~kept]].sum()), first_record=len(update.records))

    def micro_loss(self, update: UpdateState, minibatch: Minibatch, micro_rows: Tensor, micro: RolloutBatch) -> Tensor:
        """The loss of one (trimmed) micro-batch, normalised by its minibatch's global counts; records its metrics and,
        before the first optimiser step, its log-probs as π_old (or their mismatch with the sampler's)."""
        rollout, first_step = update.rollout, update.steps_done == 0
        measured = (update.steps_done or self.sampler_is_old) and not minibatch.placeholder  # ratios not 1 by construction
        out, tokens, logprobs = self.micro_step(
            micro, minibatch.counts, with_entropy=minibatch.epoch == 0, ratio_stats=update.ratio_stats if measured else None,
            current_is_old=(first_step or minibatch.placeholder) and not self.sampler_is_old)
        if first_step and self.sampler_is_old and not minibatch.placeholder:  # π_old (the sampler) vs the trainer
            update.records.append(({k: float(v) for k, v in mismatch_metrics(logprobs, micro.old_logprobs,
                                                                            micro.completion_mask).items()}, tokens))
        elif first_step and rollout.old_logprobs is not None:  # later epochs reuse these rows
            rollout.old_logprobs[minibatch.rows[micro_rows], :logprobs.shape[1]] = logprobs
        metrics = {k: float(v) for k, v in out.metrics.items()}
        if minibatch.placeholder:  # its ratio is 1 by construction: keep only what it measures for real
            metrics = {k: v for k, v in metrics.items() if k.startswith("clip_frac") or k in ("entropy", "kl")}
        update.records.append((metrics, tokens))
        minibatch.loss += float(out.loss.detach())
        return out.loss

    def after_backward(self, update: UpdateState, minibatch: Minibatch) -> None:
        """The minibatch's gradient is complete (still scaled under fp16) and not yet clipped: nothing by default, a hook
        for subclasses (``lit-gspo compare`` reads each step's gradient here)."""

    def optimizer_step(self, update: UpdateState, minibatch: Minibatch, optimizer, scheduler) -> None:
        """Clip and step, or skip a non-finite minibatch (its metrics dropped; ``update.max_nonfinite_steps`` in a row
        raise). Under fp16 Lightning's GradScaler unscales and clips inside ``optimizer.step()`` (:meth:`clip_unscaled`)
        and skips an overflow step itself."""
        if minibatch.skipped_tokens:  # Â = 0: no clipping can zero a gradient there, so clip fractions stay over every token
            keys = update.records[-1][0]  # the last micro-batch's metrics
            update.records.append(({k: 0.0 for k in keys if k.startswith("clip_frac")}, minibatch.skipped_tokens))
        if self.grad_scaler is not None:
            loss = sum_over_ranks(minibatch.loss)  # the rank shares add up
            self.updates += 1
            stepped = self.step_is_finite(loss, 0.0, minibatch.epoch, minibatch.index) and self.scaled_step(optimizer)
            norm = self.unscaled_norm
        else:
            norm, loss = self.clip_and_norm(), sum_over_ranks(minibatch.loss)
            self.updates += 1
            stepped = self.step_is_finite(loss, norm, minibatch.epoch, minibatch.index)
            if stepped:
                optimizer.step()
                torch.clear_autocast_cache()  # an autocast with its cast cache on (not Lightning's) would keep old weights
        if not stepped:  # NaN/inf gradients never reach the weights, the optimiser state or the schedule
            optimizer.zero_grad()
            del update.records[minibatch.first_record:]  # the metrics describe the steps taken
            update.nonfinite += 1
            return
        update.losses.append(loss)
        update.grad_norms.append(norm)
        update.steps_done += 1
        if scheduler is not None:
            scheduler.step()

    def metrics(self, update: UpdateState, optimizer) -> dict[str, float]:
        """The step's metrics: token-weighted means over every rank's micro-batches, the loss and gradient norm over the
        steps taken, the ratio diagnostics off-policy, the MoE routing measures."""
        metrics = reduce_weighted_means(update.records)
        nan = float("nan")  # (every minibatch skipped as non-finite)
        metrics["loss"] = sum(update.losses) / len(update.losses) if update.losses else nan
        metrics["grad_norm"] = sum(update.grad_norms) / len(update.grad_norms) if update.grad_norms else nan
        metrics["nonfinite_steps"] = float(update.nonfinite)  # minibatches whose optimiser step was skipped
        metrics["rows_with_gradient"] = float(update.active.float().mean())  # share of rows the update ran (this rank)
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps the torch one
        metrics["lr"] = inner.param_groups[0]["lr"]
        if not self.cfg.on_policy or self.sampler_is_old:  # NaN where undefined, same keys every step
            metrics.update({f"ratio/{k}": v for k, v in update.ratio_stats.compute(self.max_len).items()})
        if self.records_routing and update.rollout.routing is not None:
            metrics.update(self.measure_routing(update.rollout))
        return metrics

    def micro_step(self, micro: RolloutBatch, counts: Counts, with_entropy: bool, ratio_stats: RatioStats | None = None,
                   current_is_old: bool = False):
        """Loss of one (trimmed) micro-batch; returns (loss output, completion tokens, detached log-probs).

        ``current_is_old``: no optimiser step since the rollout, so the old log-probs are these very
        log-probs (detached) and ``micro.old_logprobs`` is not read.
        """
        fwd = self.completion_logprobs(self.policy, micro, with_entropy=with_entropy, value_head=self.value_head)
        old = fwd.logprobs.detach() if current_is_old or micro.old_logprobs is None else micro.old_logprobs
        advantages, opsm_metrics = micro.advantages, {}
        if self.mismatch is not None:  # OPSM: on π_θ of this step
            advantages, opsm_metrics = self.mismatch.in_update(micro, fwd.logprobs.detach())
        if ratio_stats is not None and micro.old_logprobs is not None:
            ratio_stats.add(fwd.logprobs, old, micro.completion_mask)
        extra = {}
        if self.value_head is not None:
            extra = dict(values=fwd.values, old_values=micro.old_values, returns=micro.returns)
        out = self.objective(fwd.logprobs, old, advantages, micro.completion_mask, counts=counts,
                             ref_logprobs=micro.ref_logprobs, **extra)
        out.metrics.update(opsm_metrics)
        mask = micro.completion_mask
        if fwd.entropy is not None and mask.any():
            out.metrics["entropy"] = fwd.entropy[mask].mean()
        return out, float(mask.sum()), fwd.logprobs.detach()

    def scaled_step(self, opt) -> bool:
        """fp16 with a GradScaler: ``opt.step()`` unscales, clips through :meth:`clip_unscaled` (the module's
        ``on_before_optimizer_step``) and steps unless the gradients overflowed; returns whether it stepped."""
        self.unscaled_norm = float("nan")
        scale = self.grad_scaler.get_scale()
        opt.step()
        torch.clear_autocast_cache()
        return math.isfinite(self.unscaled_norm) and self.grad_scaler.get_scale() >= scale  # lowered: skipped

    def clip_unscaled(self) -> None:
        """Clip the unscaled gradients (called between the scaler's unscale and its step) and keep their norm."""
        self.unscaled_norm = self.clip_and_norm()

    def step_is_finite(self, loss: float, grad_norm: float, epoch: int, minibatch: int) -> bool:
        """Whether this minibatch may step; warns on a non-finite loss or gradient norm and raises after
        ``update.max_nonfinite_steps`` in a row. ``loss`` and ``grad_norm`` are global (summed over ranks), so
        every rank decides alike and none steps, raises or waits alone."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.nonfinite_in_a_row = 0
            return True
        self.nonfinite_in_a_row += 1
        limit = self.cfg.max_nonfinite_steps
        where = (f"update {self.updates} (epoch {epoch + 1}, minibatch {minibatch + 1} of this rollout): "
                 f"loss={loss}, grad_norm={grad_norm}")
        warnings.warn(f"non-finite {where}; skipped the optimiser step ({self.nonfinite_in_a_row} in a row, "
                      f"the run stops at max_nonfinite_steps={limit})", RuntimeWarning, stacklevel=3)
        if self.nonfinite_in_a_row >= limit:
            raise RuntimeError(
                f"{self.nonfinite_in_a_row} optimiser steps in a row had a non-finite loss or gradient norm (last: {where}); "
                "no weights were changed by them. Lower the learning rate, check the rewards and the objective for "
                f"NaN/inf, or raise update.max_nonfinite_steps={limit}")
        return False

    # ------------------------------------------------------------------ pieces
    # ------------------------------------------------------------------ pieces
    def rows_with_gradient(self, rollout: RolloutBatch) -> Tensor:
        """(N,) bool: rows whose loss can have a gradient.

        With ``update.skip_zero_advantage_rows``, an objective whose loss vanishes with Â
        (``zero_advantage_has_no_gradient``), β = 0 and no critic, a row whose advantage is 0 on every
        completion token (e.g. a group whose rewards are all equal) adds exactly nothing to the
        gradient, so the update skips its forward and backward. It still counts in the normalisers.
        """
        n = len(rollout)
        if not (self.cfg.skip_zero_advantage_rows and self.objective.zero_advantage_has_no_gradient
                and self.objective.beta == 0 and self.value_head is None):
            return torch.ones(n, dtype=torch.bool)
        adv = rollout.advantages.to(rollout.completion_mask.device)
        nonzero = adv != 0 if adv.dim() == 1 else ((adv != 0) & rollout.completion_mask).any(1)
        return (nonzero & rollout.completion_mask.any(1)).cpu()

    def minibatch_order(self, n: int) -> Tensor:
        """The rows of a group-major rollout in the order minibatches take them (``update.shuffle``)."""
        cfg, G = self.cfg, self.group_size
        if cfg.num_minibatches == 1:
            return torch.arange(n)
        if cfg.shuffle == "rows" or n % G:
            return torch.randperm(n)
        return (torch.randperm(n // G)[:, None] * G + torch.arange(G)).flatten()

    @property
    def shares_prompts(self) -> bool:
        """Whether rows with the same prompt share one forward of it (``update.share_prompt_forward``).

        Off where the two-part forward would not be the same computation: MoE routing records and
        replays positions of one whole-sequence forward, checkpointed layers would append to the KV
        cache again when recomputed, and FSDP2 expects one root forward per backward.
        """
        return (self.cfg.share_prompt_forward and not self.is_moe and not self.gradient_checkpointing
                and not is_sharded(self.policy))

    def completion_logprobs(self, model: nn.Module, micro: RolloutBatch, **kwargs) -> TokenForward:
        """:func:`token_logprobs` at the sampling temperature, sharing prompts where :attr:`shares_prompts`."""
        return token_logprobs(model, micro, temperature=self.temperature, share_prompts=self.shares_prompts, **kwargs)

    @torch.no_grad()
    def old_logprobs(self, rollout: RolloutBatch, rows: Tensor) -> Tensor:
        """(N, T) log-probs of the policy before this update's first optimiser step, computed for ``rows`` (0 elsewhere)."""
        old = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=rollout.input_ids.device)
        if len(rows):
            for micro_rows, micro in self.micro_batches(rollout.select(rows), with_rows=True):
                micro = micro.trimmed()
                logprobs = self.completion_logprobs(self.policy, micro).logprobs
                old[rows[micro_rows], :logprobs.shape[1]] = logprobs
        return old

    def global_counts(self, mask: Tensor, emptied: int = 0) -> Counts:
        """Tokens and sequences of the whole minibatch (less ``emptied`` sequences the mismatch masks emptied), summed over ranks."""
        local = torch.tensor([float(mask.sum()), float(mask.shape[0] - emptied)], dtype=torch.float64, device=mask.device)
        total = all_reduce_sum(local)
        return Counts(tokens=float(total[0]), seqs=float(total[1]), max_len=float(self.max_len))

    def clip_and_norm(self) -> float:
        """Clip the gradient norm to ``update.max_grad_norm`` (None: no clipping); returns the norm before clipping."""
        modules = [self.policy] if self.value_head is None else [self.policy, self.value_head]
        params = [p for m in modules for p in m.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def micro_batches(self, batch: RolloutBatch, with_rows: bool = False):
        """Micro-batches of ``batch`` (with their row indices into it when ``with_rows``); see ``micro_batch_rows``."""
        for rows in micro_batch_rows(batch, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens):
            yield (rows, batch.select(rows)) if with_rows else batch.select(rows)

    def replayed_routing(self, micro: RolloutBatch):
        if self.routing_replay and micro.routing is not None:
            return replay_routing(self.policy, micro.routing)
        return nullcontext()

    @torch.no_grad()
    def measure_routing(self, rollout: RolloutBatch) -> dict[str, float]:
        """How far the update moved the MoE routing away from ``rollout.routing`` (the old-policy pass's).

        One no-grad forward over the whole rollout, in micro-batches, without replay:

        * ``routing_volatility``: share of (completion token, layer, top-k slot) choices that differ;
        * ``routing/rerouted_tokens``: share of completion tokens with a changed expert in some layer;
        * ``routing/abs_logratio_rerouted`` and ``routing/abs_logratio_kept``: mean |log π_θ(y_t) − log π_old(y_t)|
          over the rerouted tokens and over the others (NaN for an empty set, or without old log-probs). The
          GSPO paper's case for Routing Replay is that rerouted tokens' ratios swing; these measure it.
        """
        with record_routing(self.policy) as recorder:
            logprobs = torch.cat([token_logprobs(self.policy, micro, temperature=self.temperature).logprobs
                                  for micro in self.micro_batches(rollout)])
        mask = rollout.completion_mask.bool()
        full_mask = torch.cat([torch.zeros_like(rollout.input_ids[:, :rollout.prompt_length], dtype=torch.bool), mask], 1)
        metrics = {"routing_volatility": routing_volatility(rollout.routing, recorder.record, full_mask)}
        rerouted = rerouted_tokens(rollout.routing, recorder.record)[:, rollout.prompt_length:].to(mask.device) & mask
        metrics["routing/rerouted_tokens"] = float(rerouted.sum() / mask.sum()) if mask.any() else float("nan")
        shift = (logprobs - rollout.old_logprobs).abs() if rollout.old_logprobs is not None else None
        for name, tokens in (("rerouted", rerouted), ("kept", mask & ~rerouted)):
            metrics[f"routing/abs_logratio_{name}"] = (float(shift[tokens].mean()) if shift is not None and tokens.any()
                                                       else float("nan"))
        return metrics
