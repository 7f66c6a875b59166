"""GDPO (group reward-decoupled normalisation; TRL's multi_objective_aggregation: normalize_then_sum): each reward
function normalised within the group before the weighted sum, then whitened over the batch (``--model.advantage GDPO``)."""

from __future__ import annotations

import math

import pytest
import torch
from test_trainer import column, read_metrics, tiny_args

from lit_gspo.rl.advantages import GDPO, group_advantages
from lit_gspo.rl.rewards.decoupled import group_decoupled_sum
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.tools.main import cli_main


def test_one_function_is_grpos_group_normalised_reward():
    torch.manual_seed(0)
    scores = torch.randn(12)
    scores[4:8] = 0.5  # a constant group: 0
    decoupled = group_decoupled_sum(scores[:, None], torch.tensor([1.0]), 4, eps=1e-6)
    torch.testing.assert_close(decoupled, group_advantages(scores, 4, eps=1e-6))


def test_a_hand_example_with_a_function_that_did_not_score_a_sample():
    nan = float("nan")
    scores = torch.tensor([[1.0, 2.0], [nan, 2.0], [0.0, 5.0]])  # A's None on the second sample
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # A: mean 0.5, Bessel std √0.5 over its two scores
    b = 1 / (math.sqrt(3.0) + 1e-4)  # B: mean 3, Bessel std √3
    expected = torch.tensor([a - 2 * b, -2 * b, -a + 2 * 2 * b])  # weights 1, 2
    torch.testing.assert_close(group_decoupled_sum(scores, torch.tensor([1.0, 2.0]), 3), expected)


def test_a_functions_scale_no_longer_drowns_the_others():
    """Scaling and shifting one function moves GDPO's sum by no more than its ε does; it moves the plain weighted sum's
    group-normalised advantage a lot."""
    torch.manual_seed(1)
    scores = torch.rand(16, 2)
    scaled = scores * torch.tensor([1.0, 100.0]) + torch.tensor([0.0, 7.0])
    weights = torch.tensor([1.0, 1.0])
    torch.testing.assert_close(
        group_decoupled_sum(scaled, weights, 4), group_decoupled_sum(scores, weights, 4), rtol=0, atol=5e-3
    )
    plain, plain_scaled = (group_advantages(s.sum(1), 4) for s in (scores, scaled))
    assert (plain - plain_scaled).abs().max() > 0.5


def test_the_estimator_whitens_the_decoupled_sum_over_the_batch_and_needs_it():
    decoupled = torch.tensor([1.0, -1.0, 0.0, 0.0, 2.0, 0.0])
    mask = torch.ones(6, 2, dtype=torch.bool)
    rollout = RolloutBatch(torch.zeros(6, 3, dtype=torch.long), torch.ones(6, 3, dtype=torch.long), 1, mask)
    rollout.rewards, rollout.decoupled_rewards = torch.zeros(6), decoupled
    expected = (decoupled - decoupled.mean()) / (decoupled.std() + 1e-4)
    expected[2:4] = 0.0  # the constant group: exactly 0
    torch.testing.assert_close(GDPO()(rollout, 2), expected)
    rollout.decoupled_rewards = None
    with pytest.raises(ValueError, match="GDPO reads each reward function's scores normalised within the group"):
        GDPO()(rollout, 2)


def test_a_fit_with_gdpo_logs_the_raw_reward_and_learns_on_the_decoupled_one(tmp_path):
    rewards = "[lit_gspo.rl.rewards.CharAccuracy, {class_path: lit_gspo.rl.rewards.ExactMatch, init_args: {weight: 3}}]"
    args = tiny_args(tmp_path, "--model.advantage", "GDPO", "--model.rewards", rewards)
    cli = cli_main(args, run=False)
    seen = []
    advantage = cli.model.advantage
    cli.model.advantage = lambda rollout, g: seen.append(rollout) or advantage(rollout, g)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert isinstance(advantage, GDPO) and len(seen) == 3
    logged = column(read_metrics(tmp_path), "train/reward")
    for rollout, value in zip(seen, logged):
        assert value == pytest.approx(float(rollout.rewards.mean()), abs=1e-5)  # the weighted sum, as without GDPO
        group_means = rollout.decoupled_rewards.view(-1, 4).mean(1)
        assert group_means.abs().max() < 1e-4  # each group's decoupled sum is centred
