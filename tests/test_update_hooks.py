"""The update's hooks, each alone, on hand-made tensors; the plain optimiser step and fp16's; RolloutBatch.to."""

import math
from contextlib import contextmanager
from math import log

import pytest
import torch

from lit_gspo.lightning.fp16 import GradScalerStep
from lit_gspo.rl.learn.hooks import (
    FiniteGuard,
    Hooks,
    MicroStep,
    MismatchCorrection,
    RatioDiagnostics,
    RoutingReplay,
    RoutingVolatility,
    UpdateHook,
)
from lit_gspo.rl.learn.learner import Minibatch, UpdateState
from lit_gspo.rl.learn.mismatch import OPSM, TIS, Mismatch
from lit_gspo.rl.learn.optimizer_step import clip_then_step
from lit_gspo.rl.objectives import Counts
from lit_gspo.rl.rollout import RolloutBatch


def batch(sampler, advantages, old=None, mask=None) -> RolloutBatch:
    sampler = torch.tensor(sampler)
    n, t = sampler.shape
    mask = torch.ones(n, t, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    return RolloutBatch(
        input_ids=torch.zeros(n, 1 + t, dtype=torch.long),
        attention_mask=torch.ones(n, 1 + t),
        prompt_length=1,
        completion_mask=mask,
        engine_logprobs=sampler,
        advantages=torch.tensor(advantages),
        old_logprobs=None if old is None else torch.tensor(old),
    )


def state(rollout) -> UpdateState:
    return UpdateState(rollout=rollout, emptied=torch.zeros(len(rollout), dtype=torch.bool), size=len(rollout))


def micro_step(rollout, logprobs, old=None, old_is_current=False, placeholder=False) -> MicroStep:
    logprobs = torch.tensor(logprobs)
    old = rollout.old_logprobs if old is None else torch.tensor(old)
    return MicroStep(rollout, placeholder, logprobs, old, old_is_current, advantages=rollout.advantages)


MINIBATCH = Minibatch(
    rows=torch.arange(2),
    counts=Counts(tokens=4.0, seqs=2.0, max_len=2.0),
    epoch=1,
    index=2,
    placeholder=False,
    skipped_tokens=0.0,
    first_record=0,
)


# ------------------------------------------------------------------ MismatchCorrection
def test_mismatch_correction_learns_from_a_corrected_copy_and_records_its_measures():
    rollout = batch([[-1.0, -1.0], [-1.0, -1.0]], [1.0, -1.0], old=[[-1.0 + log(3), -1.0], [-1.0, -1.0]])
    update = state(rollout)
    MismatchCorrection(Mismatch([TIS(cap=2.0)])).before_update(update)
    assert update.rollout is not rollout and torch.equal(rollout.advantages, torch.tensor([1.0, -1.0]))  # caller's kept
    torch.testing.assert_close(update.rollout.advantages, torch.tensor([[2.0, 1.0], [-1.0, -1.0]]))  # min(3, 2) · Â
    assert update.records[0][0]["mismatch/truncated_token_frac"] == pytest.approx(1 / 4) and update.records[0][1] == 4


def test_opsm_in_the_micro_step_zeroes_negative_advantages_that_drifted():
    rollout = batch([[-1.0, -1.0], [-1.0, -1.0]], [-1.0, -1.0], old=[[-1.0, -1.0], [-1.0, -1.0]])
    step = micro_step(rollout, [[-1.6, -1.6], [-1.2, -1.2]])  # drifts 0.6 and 0.2 nats per token
    update = state(rollout)
    MismatchCorrection(Mismatch([OPSM(delta=0.5)])).before_loss(update, step)
    assert step.advantages.tolist() == [[0.0, 0.0], [-1.0, -1.0]]
    assert step.metrics == {"mismatch/opsm_masked_token_frac": 0.5}
    assert update.records == []  # the trainer's π_old: nothing measured per micro-step


def test_with_the_sampler_as_old_every_real_micro_step_measures_the_trainer_against_it():
    rollout = batch([[-1.0, -2.0]], [1.0], old=[[-1.0, -2.0]])
    hook = MismatchCorrection(Mismatch(old_logprobs="sampler"))
    update = state(rollout)
    hook.before_loss(update, micro_step(rollout, [[-1.5, -1.75]]))
    ((metrics, tokens),) = update.records
    assert tokens == 2 and metrics["mismatch/log_ratio_abs_mean"] == pytest.approx(0.375)
    assert metrics["mismatch/log_ratio_abs_max"] == pytest.approx(0.5)
    hook.before_loss(update, micro_step(rollout, [[-1.5, -1.75]], placeholder=True))
    assert len(update.records) == 1  # a placeholder measures nothing


# ------------------------------------------------------------------ RatioDiagnostics
def test_ratio_diagnostics_see_only_ratios_that_are_not_one_by_construction():
    rollout = batch([[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0], old=[[-1.0, -1.0], [-1.0, -1.0]], mask=[[1, 1], [1, 0]])
    hook = RatioDiagnostics(max_len=2)
    hook.before_update(state(rollout))
    assert math.isnan(hook.metrics(None)["ratio/seq_logratio_absmax"])  # nothing seen: NaN, the same keys
    hook.before_loss(None, micro_step(rollout, [[-0.5, -0.5], [-1.0, -1.0]], old_is_current=True))
    hook.before_loss(None, micro_step(rollout, [[-0.5, -0.5], [-1.0, -1.0]], placeholder=True))
    assert len(hook.stats) == 0
    hook.before_loss(None, micro_step(rollout, [[-0.5, -0.25], [-1.5, 9.0]]))  # Σ log r: 0.5 + 0.75, −0.5 (9 masked)
    metrics = hook.metrics(None)
    assert metrics["ratio/seq_logratio_absmax"] == pytest.approx(1.25)
    assert metrics["ratio/seq_logratio_std"] == pytest.approx(0.875)  # population std of (1.25, −0.5)
    hook.before_update(state(rollout))  # a new update starts from nothing
    assert len(hook.stats) == 0


# ------------------------------------------------------------------ routing
def test_routing_volatility_measures_a_rollout_with_routes_or_without_rows():
    seen = []
    hook = RoutingVolatility(lambda rollout: seen.append(rollout) or {"routing_volatility": 0.25})
    rollout = batch([[0.0]], [1.0])
    assert hook.metrics(state(rollout)) == {} and seen == []
    rollout.routing = object()
    assert hook.metrics(state(rollout)) == {"routing_volatility": 0.25} and seen == [rollout]
    rowless = (
        RolloutBatch.without_rows()
    )  # a rank whose sampling kept nothing: its measure's passes pair with the others'
    assert hook.metrics(state(rowless)) == {"routing_volatility": 0.25} and seen == [rollout, rowless]


def test_routing_replay_pins_the_recorded_experts_of_a_micro_batch():
    from lit_gspo.models import load_policy
    from lit_gspo.models.routing import moe_routers, record_routing
    from lit_gspo.rl.rollout import token_logprobs

    policy, _ = load_policy("tiny-qwen3-moe", seed=0)
    gen = torch.Generator().manual_seed(0)
    micro = RolloutBatch(
        input_ids=torch.randint(3, policy.config.vocab_size, (2, 7), generator=gen),
        attention_mask=torch.ones(2, 7),
        prompt_length=3,
        completion_mask=torch.ones(2, 4, dtype=torch.bool),
    )
    hook = RoutingReplay(policy)
    with torch.no_grad(), hook.around_micro(micro):  # no routes recorded: the router routes
        before = token_logprobs(policy, micro).logprobs
    with torch.no_grad(), record_routing(policy) as recorder:
        token_logprobs(policy, micro)
    micro.routing = recorder.record
    with torch.no_grad():
        for router in moe_routers(policy):
            router.weight.add_(2.0 * torch.randn(router.weight.shape, generator=gen))
        moved = token_logprobs(policy, micro).logprobs
        with record_routing(policy) as rerouted:
            token_logprobs(policy, micro)
        assert any(not torch.equal(a, b) for a, b in zip(rerouted.record.indices, micro.routing.indices))
        with hook.around_micro(micro), record_routing(policy) as replayed:
            pinned = token_logprobs(policy, micro).logprobs
    assert all(torch.equal(a, b) for a, b in zip(replayed.record.indices, micro.routing.indices))
    assert not torch.equal(moved, before) and not torch.equal(pinned, moved)


# ------------------------------------------------------------------ FiniteGuard and the steps
def test_the_finite_guard_counts_non_finite_steps_in_a_row_across_updates_and_stops_at_the_limit():
    guard = FiniteGuard(max_nonfinite_steps=3)
    assert guard.may_step(None, MINIBATCH, 1.0, 2.0)
    with pytest.warns(RuntimeWarning, match=r"update 2 \(epoch 2, minibatch 3 .*grad_norm=inf.*1 in a row"):
        assert not guard.may_step(None, MINIBATCH, 1.0, math.inf)
    with pytest.warns(RuntimeWarning, match="2 in a row"):
        assert not guard.may_step(None, MINIBATCH, math.nan, 0.0)
    assert guard.may_step(None, MINIBATCH, 0.5, 0.5) and guard.in_a_row == 0  # a finite step resets the run
    for _ in range(2):
        with pytest.warns(RuntimeWarning):
            guard.may_step(None, MINIBATCH, math.nan, 1.0)
    with pytest.raises(RuntimeError, match="3 optimiser steps in a row"), pytest.warns(RuntimeWarning):
        guard.may_step(None, MINIBATCH, math.nan, 1.0)


class Recorder(UpdateHook):
    def __init__(self, name, log, allow=True):
        self.name, self.log, self.allow = name, log, allow

    @contextmanager
    def _context(self):
        self.log.append(f"enter {self.name}")
        yield
        self.log.append(f"exit {self.name}")

    def around_micro(self, micro):
        return self._context()

    def may_step(self, update, minibatch, loss, grad_norm):
        self.log.append(f"asked {self.name}")
        return self.allow

    def metrics(self, update):
        return {"shared": self.name, self.name: 1.0}


def test_hooks_nest_in_order_all_are_asked_and_later_metrics_win():
    log = []
    hooks = Hooks([Recorder("a", log, allow=False), Recorder("b", log)])
    with hooks.around_micro(None):
        log.append("body")
    assert log == ["enter a", "enter b", "body", "exit b", "exit a"]
    assert not hooks.may_step(None, None, 0.0, 0.0) and log[-2:] == ["asked a", "asked b"]
    assert hooks.metrics(None) == {"shared": "b", "a": 1.0, "b": 1.0}


class CountingOptimizer:
    def __init__(self, on_step=None):
        self.steps, self.on_step = 0, on_step

    def step(self):
        self.steps += 1
        if self.on_step is not None:
            self.on_step()


def test_clip_then_step_clips_asks_and_steps_only_when_allowed():
    opt, asked = CountingOptimizer(), []
    assert clip_then_step(opt, lambda: 3.0, lambda norm: asked.append(norm) or True) == 3.0
    assert clip_then_step(opt, lambda: math.nan, lambda norm: asked.append(norm) or False) is None
    assert opt.steps == 1 and asked[0] == 3.0 and math.isnan(asked[1])


class FakeScaler:
    def __init__(self, scale):
        self.scale = scale

    def get_scale(self):
        return self.scale


def test_the_fp16_step_clips_inside_the_optimiser_step_and_skips_an_overflow():
    scaler = FakeScaler(2.0**16)
    step = GradScalerStep(scaler)
    asked = []
    opt = CountingOptimizer(on_step=step.clip_unscaled)  # as Lightning's plugin: unscale, then the module's hook
    assert step(opt, lambda: 0.75, lambda norm: asked.append(norm) or True) == 0.75
    assert asked == [0.0]  # the guard sees the loss only: the gradients were still scaled

    def overflow():
        step.clip_unscaled()
        scaler.scale /= 2  # the scaler skipped the step and lowered its scale

    assert step(CountingOptimizer(on_step=overflow), lambda: 0.75, lambda norm: True) is None
    opt = CountingOptimizer(on_step=step.clip_unscaled)
    assert step(opt, lambda: 0.75, lambda norm: False) is None and opt.steps == 0  # a non-finite loss: no step at all
