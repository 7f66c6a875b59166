"""learn: the old-policy snapshot and K epochs × M minibatches × micro-batches of optimiser steps.

    snapshot(rollout):  reference log-probs; old values and MoE routes when a critic or routing needs the
                        old-policy pass; old log-probs of every row when π_old's strategy asks for them
    learn(rollout):     for epoch in 1..K:
                            for minibatch in 1..M:
                                counts = tokens and sequences of the whole minibatch, over every rank
                                for micro-batch: loss = objective(logp, old_logp, Â, mask, counts); backward
                                clip, optimiser step, scheduler step

Where π_old comes from is one object chosen at construction (``old_policy.py``); the mismatch correction, MoE routing
replay and volatility, the ratio diagnostics and the finite guard are hooks (``hooks.py``); the optimiser step is
a callable the trainer may replace (``optimizer_step.py``: fp16's GradScaler). Rows whose advantage is 0 everywhere
are left out of forward and backward when the objective's gradient vanishes there; they still count in the
normalisers. Under DDP or FSDP2 every rank runs as many passes and steps as the others, whatever rows it holds
(``rank_pairing.py``). No Lightning here: the trainer hands in the optimiser, the scheduler, its backward and its step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lit_gspo.models import checkpointing_active, checkpointing_paused, eval_mode
from lit_gspo.models.cast_parameters import PARAM_DTYPES, CastParameters
from lit_gspo.models.lean_activations import LeanActivations
from lit_gspo.models.lora import reference_mode
from lit_gspo.models.regional_compile import CompiledLayers
from lit_gspo.models.routing import (
    RoutingRecord,
    moe_routers,
    record_routing,
    rerouted_tokens,
    router_aux_coefficient,
    routing_volatility,
)
from lit_gspo.rl.config import Update
from lit_gspo.rl.forward_checks import packing_keeps_rows_apart
from lit_gspo.rl.learn.entropy_bonus import EntropyBonus
from lit_gspo.rl.learn.hooks import (
    FiniteGuard,
    HighEntropyTokens,
    Hooks,
    MaskTruncated,
    MicroStep,
    MismatchCorrection,
    RatioDiagnostics,
    RoutingReplay,
    RoutingVolatility,
    UpdateHook,
)
from lit_gspo.rl.learn.host_reads import host_floats, records_on_host
from lit_gspo.rl.learn.mismatch import Mismatch
from lit_gspo.rl.learn.old_policy import OldPolicy, old_policy_for
from lit_gspo.rl.learn.optimizer_step import clip_then_step
from lit_gspo.rl.learn.rank_pairing import MicroBatch, agreed_count, filler_loss, with_fillers
from lit_gspo.rl.objectives import Counts, Objective
from lit_gspo.rl.rollout import (
    RolloutBatch,
    RowExtents,
    TokenForward,
    index_on,
    micro_batch_rows,
    token_logprobs,
)
from lit_gspo.runtime.collectives import all_reduce_sum, reduce_weighted_means, sum_over_ranks
from lit_gspo.runtime.sample_stats import WEIGHT
from lit_gspo.runtime.sharding import is_sharded, resharded
from lit_gspo.runtime.token_budget import checkpointed_bytes_per_token, saved_bytes_per_token, token_budget

#: attention kernels that skip the other rows' blocks of a packed sequence (varlen / block-sparse)
PACKING_KERNELS = ("flash_attention_2", "flash_attention_3", "flex_attention")
#: on a GPU a shared prompt forward runs only where it saves this share of the backbone's tokens: its two passes
#: launch every layer's kernels twice, and a small model's update is bound by those launches there
SHARED_PROMPT_MIN_SAVING_ON_GPU = 0.5


def flag_last(items: Iterable) -> Iterator[tuple[object, bool]]:
    """(item, whether it is the last) of each of ``items``, reading one ahead."""
    iterator = iter(items)
    previous = next(iterator, _NONE)
    while previous is not _NONE:
        current = next(iterator, _NONE)
        yield previous, current is _NONE
        previous = current


_NONE = object()


def in_rollout_order(parts: list[Tensor], inverse: Tensor | None, rollout: RolloutBatch) -> Tensor:
    """(N, T) fp32: the micro-batches' (rows, ≤ T) outputs ``parts``, dealt in the order whose inverse permutation is
    ``inverse``, joined and put back in ``rollout``'s row order; (0, T) where ``rollout`` has no rows."""
    if not parts:
        return torch.zeros(0, rollout.completion_mask.shape[1], dtype=torch.float32, device=rollout.input_ids.device)
    joined = torch.cat(parts)
    return joined[index_on(inverse, joined)]


@dataclass
class UpdateState:
    """What one :meth:`Learner.learn` carries from minibatch to minibatch."""

    rollout: RolloutBatch  # what is learned from (a mismatch-corrected copy under ``mismatch``)
    emptied: Tensor  # (N,) bool: sequences the mismatch masks emptied, out of the sequence count
    size: int  # rows per minibatch, ⌈N / M⌉
    extents: RowExtents | None = None  # each row's extent in the rollout's columns, on the host (read once)
    active: Tensor | None = None  # (N,) bool: rows whose loss can have a gradient (:meth:`Learner.rows_with_gradient`)
    # (metrics, tokens), token-weighted at the end; a metric is a float, a 0-d tensor or a function that computes one
    # (read from the device together at the end: a read between a forward and its backward would stall the host)
    records: list[tuple[dict, float]] = field(default_factory=list)
    steps_done: int = 0  # optimiser steps taken
    losses: list[float] = field(default_factory=list)  # of the steps taken (global: summed over ranks)
    grad_norms: list[float] = field(default_factory=list)
    nonfinite: int = 0  # minibatches whose step was skipped


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
    # its micro-batches' losses, this rank's share of the minibatch loss (normalised by the global counts)
    losses: list[Tensor] = field(default_factory=list)


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
        old_policy: where π_old comes from (``old_policy.py``); None: the one ``update`` and ``mismatch`` imply.
        hooks: more :class:`~lit_gspo.rl.learn.hooks.UpdateHook`\\ s, called after the built-in ones.
    """

    def __init__(
        self,
        policy: nn.Module,
        objective: Objective,
        update: Update,
        *,
        value_head: nn.Module | None = None,
        reference: nn.Module | str | None = None,
        temperature: float = 1.0,
        max_len: int = 1,
        group_size: int = 1,
        routing_replay: bool = False,
        record_routing: bool = False,
        gradient_checkpointing: bool = False,
        mismatch: Mismatch | None = None,
        old_policy: OldPolicy | None = None,
        hooks: list[UpdateHook] = (),
    ):
        if reference is not None and not isinstance(reference, nn.Module) and reference != "adapters_off":
            raise ValueError(f"reference must be a model, 'adapters_off' or None, got {reference!r}")
        if (routing_replay or record_routing) and not moe_routers(policy):
            raise ValueError("routing_replay/record_routing need an MoE policy with top-k routers; this one has none")
        self.policy, self.objective, self.cfg, self.value_head = policy, objective, update, value_head
        self.reference, self.temperature, self.max_len, self.group_size = reference, temperature, max_len, group_size
        self.records_routing = record_routing or routing_replay
        self.gradient_checkpointing, self.mismatch = gradient_checkpointing, mismatch
        self.is_moe = bool(moe_routers(policy))
        self.router_aux_coef = router_aux_coefficient(update.router_aux_loss_coef, policy)
        self.compiled_layers = CompiledLayers() if update.compile else None
        self.lean_activations = LeanActivations() if update.lean_activations else None
        self.cast_parameters = CastParameters(PARAM_DTYPES[update.param_dtype]) if update.param_dtype else None
        self.packing_holds: bool | None = None  # probed before the first packed update (:attr:`packs`)
        self.bytes_per_token: dict[tuple, int] = {}  # (compute dtype, aligned rows) -> measured activation bytes
        self.old_policy = old_policy or old_policy_for(update, mismatch, self.old_logprobs)
        self.guard = FiniteGuard(update.max_nonfinite_steps)
        built_in: list[UpdateHook] = [MaskTruncated()] if update.mask_truncated_completions else []
        if update.top_entropy_quantile < 1:
            built_in.append(HighEntropyTokens(update.top_entropy_quantile))
        self.entropy_bonus = EntropyBonus.of(update)
        if self.entropy_bonus is not None:
            built_in.append(self.entropy_bonus)
        if mismatch is not None:
            built_in.append(MismatchCorrection(mismatch))
        if routing_replay:
            built_in.append(RoutingReplay(policy))
        if self.old_policy.ratios_move:  # NaN where undefined, the same keys every step
            built_in.append(RatioDiagnostics(max_len))
        if self.records_routing:
            built_in.append(RoutingVolatility(self.measure_routing))
        self.hooks = Hooks([*built_in, self.guard, *hooks])

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    # ------------------------------------------------------------------ snapshot
    @torch.no_grad()
    def snapshot(self, rollout: RolloutBatch) -> None:
        """Reference log-probs; old values and routes when a critic or routing needs the old-policy pass; old
        log-probs when π_old's strategy asks for every row's, or keeps what that pass computed."""
        old_pass = self.value_head is not None or self.records_routing or self.old_policy.snapshot_computes_old
        keep_old = self.old_policy.snapshot_computes_old or self.old_policy.snapshot_keeps_old
        olds, refs, vals, routes, order = [], [], [], [], []
        with (
            eval_mode(self.policy, self.value_head),
            self.compiled(),
            self.cast(self.policy),
            self.cast(self.reference),
        ):
            for micro_rows, micro, _, filler in self.micro_batches(rollout.to(self.device)):
                if filler:  # the same passes as a micro-batch's below
                    if old_pass:
                        self.filler_pass(micro)
                    if self.reference is not None:
                        self.reference_logprobs(micro)
                    continue
                order.append(micro_rows)
                if old_pass:
                    with record_routing(self.policy) if self.records_routing else nullcontext() as recorder:
                        fwd = self.completion_logprobs(self.policy, micro, value_head=self.value_head)
                    if recorder is not None:
                        routes.append(recorder.record)
                    olds.append(fwd.logprobs)
                    if fwd.values is not None:
                        vals.append(fwd.values.float())
                if self.reference is not None:
                    refs.append(self.reference_logprobs(micro))
        resharded(self.policy)
        resharded(self.reference)
        # a token budget deals rows to micro-batches by length: put them back in rollout order
        inverse = torch.argsort(torch.cat(order)) if order else None
        if old_pass and keep_old:
            rollout.old_logprobs = in_rollout_order(olds, inverse, rollout)
        if routes:
            rollout.routing = RoutingRecord.cat(routes)[inverse]  # (N, P + T, k) per MoE layer
        if self.reference is not None:
            rollout.ref_logprobs = in_rollout_order(refs, inverse, rollout)
        if old_pass and self.value_head is not None:
            rollout.old_values = in_rollout_order(vals, inverse, rollout)

    def reference_logprobs(self, micro: RolloutBatch) -> Tensor:
        if self.reference == "adapters_off":
            with reference_mode(self.policy):
                return self.completion_logprobs(self.policy, micro).logprobs
        return self.completion_logprobs(self.reference, micro).logprobs

    # ------------------------------------------------------------------ learn
    def learn(
        self,
        rollout: RolloutBatch,
        optimizer,
        scheduler=None,
        *,
        backward: Callable[[Tensor], None] | None = None,
        step: Callable | None = None,
        world_size: int = 1,
        gradient_sync_blocked: Callable[[], AbstractContextManager] | None = None,
    ) -> dict[str, float]:
        """K epochs × M minibatches of optimiser steps on ``rollout`` (advantages set); returns the step's metrics.

        ``backward(loss)`` defaults to ``loss.backward()``; ``step(optimizer, clip, may_step)`` to
        :func:`~lit_gspo.rl.learn.optimizer_step.clip_then_step`; ``world_size``: each rank's loss is its share of the
        global minibatch, multiplied by the world size because DDP and FSDP2 average gradients over ranks;
        ``gradient_sync_blocked()``: a context whose backward passes do not reduce gradients over ranks (DDP's
        ``no_sync``, Lightning's ``strategy.block_backward_sync``): each minibatch's micro-batches but the last run in
        it, so the gradients are reduced once per optimiser step, not once per micro-batch.
        """
        backward, step = backward or Tensor.backward, step or clip_then_step
        # dropout off whatever mode the policy is in (eval_mode); the rest each a no-op unless asked for
        with eval_mode(self.policy, self.value_head), checkpointing_active(self.policy), self.compiled(), self.lean():
            update = self.begin(rollout.to(self.device))
            for epoch in range(self.cfg.epochs):
                order = self.minibatch_order(len(rollout))
                self.old_policy.before_epoch(update, order)
                for minibatch in self.minibatches(update, order, epoch):
                    optimizer.zero_grad()
                    rows, extents = minibatch.rows, update.extents[minibatch.rows]
                    micro_batches = self.micro_batches(update.rollout.select(rows), extents, at_least=1)
                    with self.cast(self.policy):  # (cast again after each step)
                        for (micro_rows, micro, micro_extents, filler), last in flag_last(micro_batches):
                            with nullcontext() if last or gradient_sync_blocked is None else gradient_sync_blocked():
                                if filler:
                                    self.filler_pass(micro, backward, between=lambda: self.hooks.filler(update))
                                    continue
                                micro = micro.trimmed(micro_extents)
                                tokens = float(micro_extents.completion_tokens.sum())
                                with self.hooks.around_micro(micro):
                                    loss = self.micro_loss(update, minibatch, rows[micro_rows], micro, tokens)
                                    backward(loss * world_size)  # DDP/FSDP2 average gradients over ranks
                    self.hooks.after_backward(update, minibatch)
                    self.optimizer_step(update, minibatch, optimizer, scheduler, step)
                    optimizer.zero_grad()  # applied: freed, not held through the next rollout (or to the end)
            return self.metrics(update, optimizer)

    # ------------------------------------------------------------------ the steps of learn, in the order it takes them
    def begin(self, rollout: RolloutBatch) -> UpdateState:
        """The state of one ``learn`` (the hooks may replace its rollout) and the rows with a gradient."""
        n = len(rollout)
        update = UpdateState(
            rollout=rollout, emptied=torch.zeros(n, dtype=torch.bool), size=math.ceil(n / self.cfg.num_minibatches)
        )
        self.hooks.before_update(update)
        update.extents = RowExtents.of(update.rollout)
        update.active = self.rows_with_gradient(update.rollout)
        return update

    def minibatches(self, update: UpdateState, order: Tensor, epoch: int):
        """The minibatches of one epoch, ``order`` cut in chunks of ⌈N / M⌉: each with the global counts of all its rows,
        and the rows that run forward and backward (those without gradient left out; if none has one, a single row
        still runs, a placeholder whose loss is 0, so that every rank backpropagates and the optimiser steps as on a
        zero gradient). Every rank takes as many as any rank has (``rank_pairing.py``), with no rows where it has
        fewer."""
        size, tokens = update.size, update.extents.completion_tokens
        own = [order[start : start + size] for start in range(0, len(order), size)] if size else []
        for index in range(agreed_count(len(own))):  # as many on every rank: a rank short of rows has empty ones
            rows = own[index] if index < len(own) else order[:0]
            counts = self.global_counts(float(tokens[rows].sum()), len(rows) - int(update.emptied[rows].sum()))
            kept = update.active[rows].clone()
            placeholder = not bool(kept.any())
            if len(kept):
                kept[0] |= placeholder
            yield Minibatch(
                rows=rows[kept],
                counts=counts,
                epoch=epoch,
                index=index,
                placeholder=placeholder,
                skipped_tokens=float(tokens[rows[~kept]].sum()),
                first_record=len(update.records),
            )

    def micro_loss(
        self, update: UpdateState, minibatch: Minibatch, rows: Tensor, micro: RolloutBatch, tokens: float
    ) -> Tensor:
        """The loss of one (trimmed) micro-batch, rows ``rows`` of the update's rollout with ``tokens`` completion
        tokens, normalised by its minibatch's global counts; records its metrics (as tensors: read at the end)."""
        bonus, router_aux = self.entropy_bonus, self.router_aux_coef > 0
        # every epoch where a hook or the bonus reads it
        with_entropy = minibatch.epoch == 0 or self.cfg.top_entropy_quantile < 1 or bonus is not None
        fwd = self.completion_logprobs(
            self.policy,
            micro,
            with_entropy=with_entropy,
            entropy_grad=bonus is not None,
            value_head=self.value_head,
            router_aux_loss=router_aux,
        )
        old, old_is_current = self.old_policy.old_logprobs(update, minibatch, rows, micro, fwd.logprobs.detach())
        entropy = None if fwd.entropy is None else fwd.entropy.detach()
        step = MicroStep(
            micro, minibatch.placeholder, fwd.logprobs, old, old_is_current, micro.advantages, entropy=entropy
        )
        self.hooks.before_loss(update, step)
        critic = (
            dict(values=fwd.values, old_values=micro.old_values, returns=micro.returns)
            if self.value_head is not None
            else {}
        )
        mask = micro.completion_mask
        out = self.objective(
            fwd.logprobs, old, step.advantages, mask, counts=minibatch.counts, ref_logprobs=micro.ref_logprobs, **critic
        )
        loss = out.loss
        if bonus is not None:
            loss = loss + bonus.loss(fwd.entropy, mask if step.trained is None else step.trained, minibatch.counts)
        if router_aux:  # the micro-batch's share of the minibatch's tokens (over every rank) of c · L_aux
            share = tokens / max(minibatch.counts.tokens, 1.0)
            loss = loss + fwd.router_aux_loss * (self.router_aux_coef * share)
            step.metrics["router_aux_loss"] = fwd.router_aux_loss.detach()
        metrics = {k: v.detach() if isinstance(v, Tensor) else v for k, v in {**out.metrics, **step.metrics}.items()}
        if entropy is not None and tokens and minibatch.epoch == 0:  # the first epoch's, as without the hook
            metrics["entropy"] = lambda: entropy[mask].mean()  # indexing by the mask reads it: done at the end
        if minibatch.placeholder:  # its ratio is 1 by construction: keep only what it measures for real
            metrics = {k: v for k, v in metrics.items() if k.startswith("clip_frac") or k in ("entropy", "kl")}
        update.records.append((metrics, tokens))
        minibatch.losses.append(loss.detach())
        return loss

    def optimizer_step(self, update: UpdateState, minibatch: Minibatch, optimizer, scheduler, step) -> None:
        """Clip and step, or skip a minibatch the hooks refuse (a non-finite one; its metrics dropped) or that ``step``
        skipped (fp16: an overflow)."""
        if (
            minibatch.skipped_tokens
        ):  # Â = 0: no clipping can zero a gradient there, so clip fractions stay over every token
            keys = update.records[-1][0]  # the last micro-batch's metrics
            update.records.append(({k: 0.0 for k in keys if k.startswith("clip_frac")}, minibatch.skipped_tokens))
        loss = sum_over_ranks(sum(host_floats(minibatch.losses), 0.0))  # the rank shares add up
        norm = step(optimizer, self.clip_and_norm, lambda norm: self.hooks.may_step(update, minibatch, loss, norm))
        if norm is None:  # NaN/inf gradients never reach the weights, the optimiser state or the schedule
            optimizer.zero_grad()
            del update.records[minibatch.first_record :]  # the metrics describe the steps taken
            update.nonfinite += 1
            return
        update.losses.append(loss)
        update.grad_norms.append(norm)
        update.steps_done += 1
        if scheduler is not None:
            scheduler.step()

    def metrics(self, update: UpdateState, optimizer) -> dict[str, float]:
        """The step's metrics: token-weighted means over every rank's micro-batches, the loss and gradient norm over the
        steps taken, then the hooks' (ratio diagnostics, MoE routing measures)."""
        metrics = reduce_weighted_means(records_on_host(update.records))
        nan = float("nan")  # (every minibatch skipped as non-finite)
        metrics["loss"] = sum(update.losses) / len(update.losses) if update.losses else nan
        metrics["grad_norm"] = sum(update.grad_norms) / len(update.grad_norms) if update.grad_norms else nan
        metrics["nonfinite_steps"] = float(update.nonfinite)  # minibatches whose optimiser step was skipped
        metrics["rows_with_gradient"] = float(update.active.float().mean())  # share of rows the update ran
        metrics[WEIGHT + "rows_with_gradient"] = float(len(update.active))  # over ranks: of every rank's rows
        metrics["lr"] = optimizer.param_groups[0]["lr"]
        metrics.update(self.hooks.metrics(update))
        return metrics

    # ------------------------------------------------------------------ pieces
    def rows_with_gradient(self, rollout: RolloutBatch) -> Tensor:
        """(N,) bool: rows whose loss can have a gradient.

        With ``update.skip_zero_advantage_rows``, an objective whose loss vanishes with Â
        (``zero_advantage_has_no_gradient``), β = 0, no critic, entropy bonus or router loss, a row whose advantage is
        0 on every completion token (e.g. a group whose rewards are all equal) adds exactly nothing to the
        gradient, so the update skips its forward and backward. It still counts in the normalisers.
        """
        n = len(rollout)
        if not (
            self.cfg.skip_zero_advantage_rows
            and self.objective.zero_advantage_has_no_gradient
            and self.objective.beta == 0
            and self.value_head is None
            and self.entropy_bonus is None
            and not self.router_aux_coef
        ):
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
        cache again when recomputed, and FSDP2 expects one root forward per backward. Off with compiled
        layers (``update.compile``): each layer reads its own slot of the KV cache, which the compiled
        layer guards on, so every layer and pass would compile a graph of its own (past torch's limit of
        8 recompiles the rest would run eagerly).
        """
        return (
            self.cfg.share_prompt_forward
            and not self.is_moe
            and not self.gradient_checkpointing
            and not is_sharded(self.policy)
            and self.compiled_layers is None
        )

    @property
    def packs(self) -> bool:
        """Whether a micro-batch's rows run as one sequence without padding (``update.pack_sequences``; None: where the
        attention kernel skips the other rows' blocks). Never with MoE routing records, which hold padded positions, nor
        the router loss, which needs the padding mask, nor with a policy whose packed rows see each other
        (``forward_checks.packing_keeps_rows_apart``, probed before the first packed update: an error with
        ``pack_sequences: true``, padded rows with None)."""
        if self.records_routing or self.router_aux_coef:
            return False
        wanted = self.cfg.pack_sequences
        if wanted is None:
            wanted = getattr(getattr(self.policy, "config", None), "_attn_implementation", None) in PACKING_KERNELS
        if wanted and self.packing_holds is None:
            self.packing_holds = packing_keeps_rows_apart(self.policy)
            if not self.packing_holds:
                why = (
                    f"{type(self.policy).__name__}'s packed rows see each other (a row's states change with the rows "
                    "packed before it: its attention mask or its layers do not restart at each row's first position)"
                )
                if self.cfg.pack_sequences:
                    raise ValueError(f"update.pack_sequences=True: {why}; set it to null or false")
                warnings.warn(f"update.pack_sequences: the update runs padded rows: {why}", stacklevel=3)
        return bool(wanted and self.packing_holds)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the update's forward computes in: ``update.param_dtype``, else autocast's dtype under mixed precision,
        else the parameters'."""
        if self.cast_parameters is not None:
            return self.cast_parameters.dtype
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return next(self.policy.parameters()).dtype

    @property
    def aligns(self) -> bool:
        """Whether a micro-batch's rows run with their tokens first and no attention mask (``update.align_rows``;
        ``auto``: on a GPU computing in 16 bits, where sdpa's flash kernel takes grouped key-value heads as they are;
        in fp32 only its math kernel does, which holds every (L, L) score, so fp32 rows stay padded for the efficient
        kernel). Never with MoE routing records, which hold padded positions, nor the router loss, which needs the
        padding mask."""
        if self.records_routing or self.router_aux_coef:
            return False
        if self.cfg.align_rows == "auto":
            return self.device.type != "cpu" and self.compute_dtype in (torch.float16, torch.bfloat16)
        return self.cfg.align_rows

    def compiled(self):
        """The policy's decoder layers compiled while in this context (``update.compile``), where that is supported."""
        if self.compiled_layers is None:
            return nullcontext()
        why_not = self.compile_blocker()
        if why_not:
            warnings.warn(f"update.compile: the update runs eagerly under {why_not}", stacklevel=3)
            return nullcontext()
        return self.compiled_layers.active(self.policy)

    def compile_blocker(self) -> str | None:
        """What keeps ``update.compile`` from compiling the layers here (None: nothing)."""
        unsupported = {
            "gradient checkpointing": self.gradient_checkpointing,
            "FSDP2": is_sharded(self.policy),
            "MoE routing records": self.records_routing,
        }
        return next((name for name, applies in unsupported.items() if applies), None)

    def lean(self):
        """The policy keeping less for backward while in this context (``update.lean_activations``: lean RMSNorms and
        SwiGLUs, autocast's copies shared); not in compiled layers, whose compiler chooses what to keep."""
        if self.lean_activations is None or (self.compiled_layers is not None and self.compile_blocker() is None):
            return nullcontext()
        return self.lean_activations.active(self.policy)

    def cast(self, model: nn.Module | str | None):
        """``model``'s parameters read in ``update.param_dtype`` while in this context (cast on entering it), where that
        is set; nested, the inner context changes nothing. Under FSDP2 nothing either: ``shard_model`` gave it the
        mixed precision that casts the parameters as it gathers them."""
        if self.cast_parameters is None or not isinstance(model, nn.Module) or is_sharded(model):
            return nullcontext()
        return self.cast_parameters.active(model)

    @property
    def min_prompt_saving(self) -> float:
        """The share of the tokens a shared prompt forward must save to run (``update.share_prompt_forward``)."""
        if self.cfg.share_prompt_forward == "auto" and self.device.type != "cpu":
            return SHARED_PROMPT_MIN_SAVING_ON_GPU
        return 0.0

    def completion_logprobs(self, model: nn.Module, micro: RolloutBatch, **kwargs) -> TokenForward:
        """:func:`token_logprobs` at the sampling temperature, packed where :attr:`packs`, else sharing prompts where
        :attr:`shares_prompts` and it saves enough tokens (:attr:`min_prompt_saving`), else aligned where
        :attr:`aligns`."""
        return token_logprobs(
            model,
            micro,
            temperature=self.temperature,
            share_prompts=self.shares_prompts,
            min_prompt_saving=self.min_prompt_saving,
            pack=self.packs,
            align=self.aligns,
            **kwargs,
        )

    @torch.no_grad()
    def old_logprobs(self, rollout: RolloutBatch, rows: Tensor) -> Tensor:
        """(N, T) log-probs of the policy before this update's first optimiser step, computed for ``rows`` (0 elsewhere)."""
        old = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=rollout.input_ids.device)
        with self.cast(self.policy):
            for micro_rows, micro, micro_extents, filler in self.micro_batches(rollout.select(rows)):
                if filler:
                    self.filler_pass(micro)
                    continue
                micro = micro.trimmed(micro_extents)
                logprobs = self.completion_logprobs(self.policy, micro).logprobs
                old[index_on(rows[micro_rows], old), : logprobs.shape[1]] = logprobs
        resharded(self.policy)
        return old

    def global_counts(self, tokens: float, seqs: int) -> Counts:
        """This rank's ``tokens`` and ``seqs`` of a minibatch (the sequences the mismatch masks emptied left out),
        summed over ranks."""
        total = all_reduce_sum(torch.tensor([tokens, float(seqs)], dtype=torch.float64))
        return Counts(tokens=float(total[0]), seqs=float(total[1]), max_len=float(self.max_len))

    def clip_and_norm(self) -> float:
        """Clip the gradient norm to ``update.max_grad_norm`` (None: no clipping); returns the norm before clipping."""
        modules = [self.policy] if self.value_head is None else [self.policy, self.value_head]
        params = [p for m in modules for p in m.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def micro_batch_tokens(self) -> int | None:
        """``update.micro_batch_tokens``, with ``"auto"`` sized from the GPU memory free now (None on the CPU)."""
        if self.cfg.micro_batch_tokens != "auto":
            return self.cfg.micro_batch_tokens
        if self.device.type != "cuda":
            return None
        return token_budget(self.activation_bytes_per_token(), self.device)

    def activation_bytes_per_token(self) -> int:
        """Bytes one token of a micro-batch keeps for backward (``runtime/token_budget.py``): measured by a micro-batch's
        forward at two lengths (:meth:`probe_forward`), once per compute dtype and row layout, under the update's
        settings."""
        key = (self.compute_dtype, self.aligns)
        if key not in self.bytes_per_token:
            with checkpointing_paused(self.policy), self.cast(self.policy), self.lean():
                full = saved_bytes_per_token(self.probe_forward)
            if (
                self.gradient_checkpointing
            ):  # each block's input kept: the residual stream, in the parameters' read dtype
                stream = self.cast_parameters.dtype if self.cast_parameters else next(self.policy.parameters()).dtype
                full = checkpointed_bytes_per_token(self.policy.config, full, torch.finfo(stream).bits // 8)
            self.bytes_per_token[key] = full
        return self.bytes_per_token[key]

    def probe_forward(self, length: int) -> Tensor:
        """A micro-batch's forward (``completion_logprobs``) of one row of ``length`` fixed tokens (no random draw) whose
        padding, if rows are padded, is one prompt token; the LM head one position at a time (its memory is bounded
        apart: ``token_logprobs``' chunks)."""
        device = next(self.policy.parameters()).device
        ids = (torch.arange(length, device=device) * 7919 % self.policy.config.vocab_size)[None]
        attention = torch.ones_like(ids).index_fill_(1, torch.tensor([0], device=device), 0)
        completion = torch.ones(1, length - 2, dtype=torch.bool, device=device)
        probe = RolloutBatch(ids, attention, 2, completion)
        logprobs = self.completion_logprobs(self.policy, probe, max_chunk_elements=1).logprobs
        if is_sharded(self.policy):  # FSDP2 expects a backward after a forward with grad: a zero one, leaving no grad
            without = [p for p in self.policy.parameters() if p.grad is None]  # (where one was, it added 0)
            (logprobs.sum() * 0).backward(retain_graph=True)
            for param in without:
                param.grad = None
        return logprobs

    def micro_batches(
        self, batch: RolloutBatch, extents: RowExtents | None = None, at_least: int = 0
    ) -> Iterator[MicroBatch]:
        """The micro-batches of ``batch`` (``micro_batch_rows``), then fillers up to as many as any rank runs, at least
        ``at_least`` (``rank_pairing.py``; collective: every rank must call it). ``extents``: the batch's, where the
        caller holds them; else read here when a token budget needs them (else None: trimming reads them)."""
        budget = self.micro_batch_tokens()
        if budget and extents is None:
            extents = RowExtents.of(batch)
        dealt = micro_batch_rows(batch, self.cfg.micro_batch_size, budget, extents)
        real = (MicroBatch(rows, batch.select(rows), extents[rows] if extents is not None else None) for rows in dealt)
        return with_fillers(real, len(dealt), batch, at_least)

    def filler_pass(
        self,
        micro: RolloutBatch,
        backward: Callable[[Tensor], None] | None = None,
        between: Callable[[], None] | None = None,
    ) -> None:
        """A pass that only pairs this rank's collectives with the other ranks' (``rank_pairing.py``): a no-grad forward,
        or with ``backward`` a forward and the backward of 0 × its outputs; ``between()`` runs between the two, where a
        micro-batch's loss would (the hooks' collectives)."""
        with torch.set_grad_enabled(backward is not None):
            fwd = self.completion_logprobs(self.policy, micro, value_head=self.value_head)
        if between is not None:
            between()
        if backward is not None:
            backward(filler_loss(fwd.logprobs, fwd.values))

    @torch.no_grad()
    def measure_routing(self, rollout: RolloutBatch) -> dict[str, float]:
        """How far the update moved the MoE routing away from ``rollout.routing`` (the old-policy pass's).

        One no-grad forward over the whole rollout, in micro-batches, without replay:

        * ``routing_volatility``: share of (completion token, layer, top-k slot) choices that differ;
        * ``routing/rerouted_tokens``: share of completion tokens with a changed expert in some layer;
        * ``routing/abs_logratio_rerouted`` and ``routing/abs_logratio_kept``: mean |log π_θ(y_t) − log π_old(y_t)|
          over the rerouted tokens and over the others (NaN for an empty set, or without old log-probs). The
          GSPO paper's case for Routing Replay is that rerouted tokens' ratios swing; these measure it.

        Each with the tokens it is a mean over (``WEIGHT`` keys), so that over ranks the step logs the mean over
        every rank's tokens (``runtime/sample_stats.py``).
        """
        parts, routes, order = [], [], []
        with eval_mode(self.policy), self.cast(self.policy):
            for micro_rows, micro, _, filler in self.micro_batches(rollout):
                if filler:
                    self.filler_pass(micro)
                    continue
                with record_routing(self.policy) as recorder:
                    parts.append(token_logprobs(self.policy, micro, temperature=self.temperature).logprobs)
                routes.append(recorder.record)
                order.append(micro_rows)
        resharded(self.policy)
        if not order:  # no row on this rank: nothing measured (weight 0)
            keys = (
                "routing_volatility",
                "routing/rerouted_tokens",
                *(f"routing/abs_logratio_{n}" for n in ("rerouted", "kept")),
            )
            return {**dict.fromkeys(keys, float("nan")), **{WEIGHT + k: 0.0 for k in keys}}
        inverse = torch.argsort(torch.cat(order))  # a token budget deals rows by length: back in rollout order
        logprobs, record = in_rollout_order(parts, inverse, rollout), RoutingRecord.cat(routes)[inverse]
        mask = rollout.completion_mask.bool()
        full_mask = torch.cat(
            [torch.zeros_like(rollout.input_ids[:, : rollout.prompt_length], dtype=torch.bool), mask], 1
        )
        metrics = {"routing_volatility": routing_volatility(rollout.routing, record, full_mask)}
        rerouted = rerouted_tokens(rollout.routing, record)[:, rollout.prompt_length :].to(mask.device) & mask
        metrics["routing/rerouted_tokens"] = float(rerouted.sum() / mask.sum()) if mask.any() else float("nan")
        shift = (logprobs - rollout.old_logprobs).abs() if rollout.old_logprobs is not None else None
        for name, tokens in (("rerouted", rerouted), ("kept", mask & ~rerouted)):
            metrics[f"routing/abs_logratio_{name}"] = (
                float(shift[tokens].mean()) if shift is not None and tokens.any() else float("nan")
            )
            metrics[WEIGHT + f"routing/abs_logratio_{name}"] = float(tokens.sum()) if shift is not None else 0.0
        # means over this rank's completion tokens: over ranks, weighted by them (runtime/sample_stats.py)
        tokens = float(mask.sum())
        metrics.update({WEIGHT + "routing_volatility": tokens, WEIGHT + "routing/rerouted_tokens": tokens})
        return metrics
