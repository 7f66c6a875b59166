"""Advantage estimators: hand values, exact zeros for constant groups, GAE, overlong shaping."""

import math

import pytest
import torch

from lit_gspo.rl.advantages import (
    ADVANTAGES,
    GAE,
    RLOO,
    BatchNormalized,
    GroupMean,
    GroupNormalized,
    gae,
    get_advantage,
    group_advantages,
    rloo_advantages,
)
from lit_gspo.rl.rewards import overlong_penalty
from lit_gspo.rl.rollout import RolloutBatch


def test_group_advantages_hand_values():
    # group 0: R = [1, 0, 1, 0], mean 0.5, unbiased std √(4·0.25/3) = 0.5774 → ±0.5/0.5774 = ±0.8660
    # group 1: all equal → exactly 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3, 0.3]), group_size=4, eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([s, -s, s, -s, 0.0, 0.0, 0.0, 0.0]))
    assert adv.dtype == torch.float32


def test_groups_are_group_major():
    # prompt 0 has rewards [0, 1], prompt 1 has [5, 7]: baselines 0.5 and 6, not mixed across prompts
    adv = group_advantages(torch.tensor([0.0, 1.0, 5.0, 7.0]), 2, scale="none")
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]))


def test_batch_scale_uses_the_batch_std():
    r = torch.tensor([0.0, 1.0, 5.0, 7.0])
    adv = group_advantages(r, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]) / r.std())


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_groups_give_exact_zero_never_nan(scale):
    # 0.1 · 3 is not exactly representable: mean − R would be ~1e-17, and / (0 + eps) would blow it up
    r = torch.tensor([0.1, 0.1, 0.1, 1e8, 1e8, 1e8, 0.7, 0.2, 0.9], dtype=torch.float64)
    adv = group_advantages(r, 3, scale=scale)
    assert torch.isfinite(adv).all()
    assert (adv[:6] == 0).all()
    assert (adv[6:] != 0).all()
    single = group_advantages(torch.tensor([3.0, -1.0]), 1, scale=scale)  # G = 1: nothing to compare
    assert (single == 0).all()


def test_rloo_hand_values():
    # R = [1, 0, 0, 0]: baselines are the means of the other three: [0, 1/3, 1/3, 1/3]
    torch.testing.assert_close(
        rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3])
    )
    assert (rloo_advantages(torch.full((6,), 0.1), 3) == 0).all()
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.ones(4), 1)


def test_group_size_must_divide_n():
    with pytest.raises(ValueError, match=r"N=5.*group_size=2"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


def rollout_with(rewards: list[float], completion_mask=None, old_values=None) -> RolloutBatch:
    mask = completion_mask if completion_mask is not None else torch.ones(len(rewards), 1, dtype=torch.bool)
    return RolloutBatch(
        input_ids=torch.zeros(len(rewards), 1 + mask.shape[1], dtype=torch.long),
        attention_mask=torch.ones(len(rewards), 1 + mask.shape[1], dtype=torch.long),
        prompt_length=1,
        completion_mask=mask,
        rewards=torch.tensor(rewards),
        old_values=old_values,
    )


def test_estimators_by_class_and_by_name():
    batch = rollout_with([1.0, 0.0, 3.0, 3.0])
    r = batch.rewards
    torch.testing.assert_close(GroupNormalized()(batch, 2), group_advantages(r, 2))
    torch.testing.assert_close(GroupMean()(batch, 2), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    torch.testing.assert_close(BatchNormalized()(batch, 2), group_advantages(r, 2, scale="batch"))
    torch.testing.assert_close(RLOO()(batch, 2), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert set(ADVANTAGES) == {"group", "group_mean", "batch", "gdpo", "rloo", "gae", "turn_group"}
    assert type(get_advantage("rloo")) is RLOO and type(get_advantage("GroupMean")) is GroupMean
    with pytest.raises(ValueError, match="group, group_mean, batch, gdpo, rloo, gae"):
        get_advantage("grpo")
    with pytest.raises(ValueError, match="critic"):
        GAE()(batch, 2)  # no values to estimate from


def test_gae_estimator_puts_the_reward_on_the_last_token_whitens_and_fills_returns():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    values = torch.tensor([[0.5, 0.5, 0.5], [0.2, 9.0, 9.0]])
    batch = rollout_with([1.0, 0.0], completion_mask=mask, old_values=values)
    adv = GAE(gamma=1.0, lam=0.5)(batch, 1)
    # row 0 as in test_gae_hand_values: Â = [0.125, 0.25, 0.5]; row 1: one token, δ = 0 − 0.2
    raw = torch.tensor([0.125, 0.25, 0.5, -0.2])
    torch.testing.assert_close(adv[mask], (raw - raw.mean()) / (raw.std() + 1e-8))
    assert adv[~mask].eq(0).all()
    torch.testing.assert_close(batch.returns[mask], raw + values[mask])
    unwhitened = GAE(gamma=1.0, lam=0.5, whiten=False)(batch, 1)
    torch.testing.assert_close(unwhitened[mask], raw)


def test_gae_hand_values():
    # row 0: 3 valid tokens, reward 1 on the last, V = 0.5 everywhere, γ = 1, λ = 0.5
    #   δ = [0 + 0.5 − 0.5, 0 + 0.5 − 0.5, 1 + 0 − 0.5] = [0, 0, 0.5] (no bootstrap past the end)
    #   Â_2 = 0.5, Â_1 = 0 + 0.5·0.5 = 0.25, Â_0 = 0.125; returns = Â + V
    # row 1: all padding (values NaN there) → zeros
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0], [float("nan")] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.25, 0.5, 0.0], [0.0] * 4]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.75, 1.0, 0.0], [0.0] * 4]))


def test_gae_lambda_one_is_discounted_return_minus_value():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.arange(5)[None] < torch.tensor([[5], [2], [4]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    for i, n in enumerate([5, 2, 4]):
        for t in range(n):
            G = sum(0.9 ** (k - t) * rewards[i, k].item() for k in range(t, n))
            assert ret[i, t].item() == pytest.approx(G, abs=1e-5)
            assert adv[i, t].item() == pytest.approx(G - values[i, t].item(), abs=1e-5)
    with pytest.raises(ValueError, match=r"\(3, 5\).*\(3, 4\)"):
        gae(rewards, values[:, :4], mask)


def test_overlong_penalty():
    # L_max = 20, L_cache = 4: free up to 16, then linear −(L − 16)/4, −1 beyond 20
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    )
    torch.testing.assert_close(overlong_penalty(torch.tensor([20, 21]), 20, 0), torch.tensor([0.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len=30, max_len=20"):
        overlong_penalty(lengths, 20, 30)
