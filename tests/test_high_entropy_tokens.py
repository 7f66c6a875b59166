"""update.top_entropy_quantile ("Beyond the 80/20 rule", TRL's top_entropy_quantile): only the micro-batch's top-ρ
entropy tokens carry the policy gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from test_learner import make_learner, sample_rollout, with_rewards

from lit_gspo.models import load_policy
from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.hooks import HighEntropyTokens, MicroStep
from lit_gspo.rl.objectives import GRPO
from lit_gspo.rl.rollout import RolloutBatch, token_logprobs

REWARDS = [1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.0, 1.0, 0.3, 0.6, 0.4, 0.8]


def test_the_hook_keeps_the_advantage_of_the_top_quantile_of_valid_tokens():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    entropy = torch.tensor([[0.1, 0.9, 0.3, 0.5], [0.7, 0.2, 0.8, 9.0]])  # 9.0: padding, never counted
    batch = RolloutBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long), 1, mask)
    step = MicroStep(
        batch, False, torch.zeros(2, 4), torch.zeros(2, 4), True, torch.tensor([2.0, -1.0]), entropy=entropy
    )
    HighEntropyTokens(3 / 7).before_loss(None, step)  # 7 valid tokens: the 3 of highest entropy (0.9, 0.8, 0.7)
    assert step.advantages.tolist() == [[0.0, 2.0, 0.0, 0.0], [-1.0, 0.0, -1.0, 0.0]]
    assert float(step.metrics["high_entropy_token_frac"]) == pytest.approx(3 / 7)


def learned(update: Update, rollout):
    learner = make_learner(update, GRPO())
    rollout = with_rewards(learner, rollout, REWARDS)
    metrics = learner.learn(rollout, torch.optim.SGD(learner.policy.parameters(), lr=0.5))
    return learner.policy.state_dict(), metrics, rollout


def test_an_update_trains_as_on_advantages_zeroed_below_the_quantile_and_matches_trls_loss():
    """One micro-batch (the whole rollout), on-policy GRPO: the same weights as the plain update given per-token
    advantages zeroed below the quantile of π_θ's entropies, and TRL's loss −(1/N) Σ_i Σ_t Â_i keep_{i,t} / |y_i|."""
    policy = load_policy("tiny-llama", seed=0)[0]
    rollout = sample_rollout(policy)
    top, metrics, trained = learned(Update(top_entropy_quantile=0.2, skip_zero_advantage_rows=False), rollout)
    with torch.no_grad():
        entropy = token_logprobs(load_policy("tiny-llama", seed=0)[0].eval(), rollout, with_entropy=True).entropy
    mask = rollout.completion_mask
    keep = (entropy >= torch.quantile(entropy[mask], 0.8)) & mask
    assert 0 < int(keep.sum()) < int(mask.sum())
    by_hand = copy.deepcopy(rollout)
    learner = make_learner(Update(skip_zero_advantage_rows=False), GRPO())
    by_hand = with_rewards(learner, by_hand, REWARDS)
    by_hand.advantages = torch.where(keep, by_hand.advantages[:, None].expand_as(mask), 0.0)
    learner.learn(by_hand, torch.optim.SGD(learner.policy.parameters(), lr=0.5))
    for name, value in learner.policy.state_dict().items():
        torch.testing.assert_close(top[name], value, rtol=0, atol=1e-6)
    per_row = (trained.advantages[:, None] * keep).sum(1) / mask.sum(1)
    assert metrics["loss"] == pytest.approx(-float(per_row.mean()), abs=1e-6)
    assert metrics["high_entropy_token_frac"] == pytest.approx(float(keep.sum() / mask.sum()), abs=1e-6)


def test_quantile_one_is_the_plain_update_bit_for_bit_and_bad_values_name_what_is_valid():
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    every, _, _ = learned(Update(top_entropy_quantile=1.0), rollout)
    plain, _, _ = learned(Update(), rollout)
    assert all(torch.equal(every[k], plain[k]) for k in every)
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \(0, 1\] .*got 0"):
        Update(top_entropy_quantile=0)
