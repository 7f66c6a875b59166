"""π_old strategies, each alone: what π_old a micro-batch reads, what is filled before an epoch, which one an update's
settings choose; and one identity through the learner (the sampler's log-probs equal to π_θ0 change nothing)."""

import copy

import pytest
import torch

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.learner import Learner, Minibatch, UpdateState
from lit_gspo.rl.learn.mismatch import OPSM, TIS, Mismatch
from lit_gspo.rl.learn.old_policy import (
    GivenOldLogprobs,
    OnPolicy,
    RecomputedBeforeFirstStep,
    TrainerPassOverEveryRow,
    old_policy_for,
)
from lit_gspo.rl.objectives import Counts
from lit_gspo.rl.rollout import RolloutBatch

N, T = 6, 4


def rollout(old=None) -> RolloutBatch:
    return RolloutBatch(
        input_ids=torch.zeros(N, 2 + T, dtype=torch.long),
        attention_mask=torch.ones(N, 2 + T),
        prompt_length=2,
        completion_mask=torch.ones(N, T, dtype=torch.bool),
        old_logprobs=old,
    )


def state(batch, steps_done=0, active=None) -> UpdateState:
    return UpdateState(
        rollout=batch,
        emptied=torch.zeros(N, dtype=torch.bool),
        size=2,
        steps_done=steps_done,
        active=torch.ones(N, dtype=torch.bool) if active is None else active,
    )


def minibatch(rows, placeholder=False) -> Minibatch:
    return Minibatch(
        rows=rows,
        counts=Counts(tokens=1.0, seqs=1.0, max_len=float(T)),
        epoch=0,
        index=0,
        placeholder=placeholder,
        skipped_tokens=0.0,
        first_record=0,
    )


def test_on_policy_reads_its_own_forward():
    logprobs = -torch.rand(2, 3)
    old, is_current = OnPolicy().old_logprobs(
        state(rollout()),
        minibatch(torch.tensor([0, 1])),
        torch.tensor([0, 1]),
        rollout().select(torch.tensor([0, 1])),
        logprobs,
    )
    assert old is logprobs and is_current
    assert not OnPolicy.ratios_move and not OnPolicy.snapshot_computes_old and not OnPolicy.snapshot_keeps_old


def test_recomputed_fills_only_the_rows_a_step_can_precede_with_a_gradient():
    asked = []

    def policy_logprobs(batch, rows):
        asked.append(rows.tolist())
        out = torch.zeros(N, T)
        out[rows] = -1.0 - rows[:, None].float()  # row r: −(1 + r)
        return out

    strategy, batch = RecomputedBeforeFirstStep(policy_logprobs), rollout()
    active = torch.tensor([True, True, False, True, True, False])
    order = torch.tensor(
        [5, 0, 3, 2, 1, 4]
    )  # minibatches of 2: [5, 0] is the first (its own forward), then [3, 2], [1, 4]
    update = state(batch, active=active)
    strategy.before_epoch(update, order)
    assert asked == [[3, 1, 4]]  # 2 has no gradient: never read
    assert batch.old_logprobs[[3, 1, 4], 0].tolist() == [-4.0, -2.0, -5.0]
    strategy.before_epoch(update, order.flip(0))  # a later epoch: nothing recomputed
    assert asked == [[3, 1, 4]]


def test_recomputed_takes_the_first_steps_forward_and_keeps_it_for_later_epochs():
    strategy, batch = RecomputedBeforeFirstStep(None), rollout(old=torch.zeros(N, T))
    rows = torch.tensor([4, 1])
    own = torch.tensor([[-0.5, -0.25, -2.0], [-1.0, -3.0, -0.125]])  # trimmed: 3 of T columns
    old, is_current = strategy.old_logprobs(state(batch, steps_done=0), minibatch(rows), rows, batch.select(rows), own)
    assert old is own and is_current
    assert torch.equal(batch.old_logprobs[rows, :3], own) and torch.equal(batch.old_logprobs[rows, 3], torch.zeros(2))
    # after a step: the kept π_old, not the forward; a placeholder (loss 0) still reads its own
    later = batch.select(rows)
    old, is_current = strategy.old_logprobs(state(batch, steps_done=1), minibatch(rows), rows, later, own - 1)
    assert torch.equal(old, later.old_logprobs) and not is_current
    old, is_current = strategy.old_logprobs(
        state(batch, steps_done=1), minibatch(rows, placeholder=True), rows, later, own - 1
    )
    assert torch.equal(old, own - 1) and is_current


def test_given_old_logprobs_are_read_from_the_first_step_on():
    given = -torch.rand(N, T)
    batch, rows = rollout(old=given.clone()), torch.tensor([0, 2])
    old, is_current = GivenOldLogprobs().old_logprobs(
        state(batch), minibatch(rows), rows, batch.select(rows), -torch.rand(2, T)
    )
    assert torch.equal(old, given[rows]) and not is_current
    assert torch.equal(batch.old_logprobs, given)  # never overwritten
    with pytest.raises(ValueError, match="has none"):
        GivenOldLogprobs().before_epoch(state(rollout()), torch.arange(N))


def test_the_settings_choose_the_strategy_once():
    def choose(update, mismatch=None):
        return old_policy_for(update, mismatch, None)

    off = Update(epochs=2, num_minibatches=2)
    assert type(choose(Update())) is OnPolicy
    assert type(choose(off)) is RecomputedBeforeFirstStep
    assert type(choose(Update(), Mismatch(old_logprobs="sampler"))) is GivenOldLogprobs
    assert type(choose(off, Mismatch([OPSM()], old_logprobs="sampler"))) is GivenOldLogprobs
    on, several = choose(Update(), Mismatch([TIS()])), choose(off, Mismatch())
    assert type(on) is type(several) is TrainerPassOverEveryRow and on.snapshot_computes_old
    assert not on.ratios_move and several.ratios_move  # one step: every ratio is 1


def test_sampler_logprobs_equal_to_the_trainers_make_given_and_recomputed_take_the_same_steps():
    """π_old handed in as π_θ0 (``GivenOldLogprobs``) and π_old recomputed before the first step are the same
    numbers up to float rounding: the two updates end on the same weights."""
    from test_learner import learn, make_learner, sample_rollout, with_rewards

    update = Update(epochs=2, num_minibatches=2, micro_batch_size=3, share_prompt_forward=False)
    base = make_learner(update)
    batch = with_rewards(base, sample_rollout(base.policy), [0.0, 1.0, 3.0] * 4)
    recomputed = copy.deepcopy(base)
    given = Learner(
        copy.deepcopy(base.policy),
        base.objective,
        update,
        max_len=base.max_len,
        group_size=base.group_size,
        old_policy=GivenOldLogprobs(),
    )
    given_batch = copy.deepcopy(batch)
    given_batch.old_logprobs = base.old_logprobs(batch, torch.arange(len(batch)))
    metrics = [learn(recomputed, copy.deepcopy(batch), momentum_sgd=True), learn(given, given_batch, momentum_sgd=True)]
    for p, q in zip(recomputed.policy.parameters(), given.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert metrics[0]["clip_frac"] == pytest.approx(metrics[1]["clip_frac"], abs=1e-6) and metrics[0]["clip_frac"] > 0
    assert set(metrics[0]) == set(metrics[1])  # both log the ratio diagnostics
