"""update.entropy_coef (TRL's entropy bonus) and entropy_target (Skywork-OR1's adaptive control): the loss gets −c · H̄,
H̄ π_θ's mean entropy per trained token of the minibatch, whatever the objective, the micro-batch split or the rows'
advantages."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_learner import G, make_learner, sample_rollout, with_rewards

from lit_gspo.models import load_policy
from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.entropy_bonus import EntropyBonus
from lit_gspo.rl.lm_head import target_logprobs_and_entropy
from lit_gspo.rl.objectives import GRPO, GSPO, Counts
from lit_gspo.rl.rollout import position_ids_of, token_logprobs

# 4 groups of G = 3; the first is flat: its rows' Â is 0, and with a bonus they still have a gradient
REWARDS = [0.5, 0.5, 0.5, 1.0, 0.0, 0.2, 0.9, 0.1, 0.0, 1.0, 0.3, 0.6]
LR = 0.5


def test_the_entropys_gradient_is_autograds_of_minus_p_log_p():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 3, 11, dtype=torch.float64) * 3, torch.randint(0, 11, (2, 3))
    weights = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    ours = logits.clone().requires_grad_()
    logp, entropy = target_logprobs_and_entropy(ours, targets, entropy_grad=True)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    naive = logits.clone().requires_grad_()
    log_softmax = naive.log_softmax(-1)
    naive_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    naive_logp = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    ((naive_logp * weights[0]).sum() + (naive_entropy * weights[1]).sum()).backward()
    torch.testing.assert_close(entropy, naive_entropy.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.grad, naive.grad, rtol=0, atol=1e-12)
    _, diagnostic = target_logprobs_and_entropy(logits.clone().requires_grad_(), targets, with_entropy=True)
    assert not diagnostic.requires_grad  # without the bonus it stays a detached diagnostic


def test_the_entropys_gradient_through_the_recomputed_chunks_of_the_head_is_the_whole_heads():
    """``token_logprobs`` in chunks of one position (each recomputed in backward) gives the one-chunk gradient."""
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    grads = []
    for max_chunk_elements in (2**26, 1):
        policy = load_policy("tiny-llama", seed=0)[0].eval()
        fwd = token_logprobs(policy, rollout, entropy_grad=True, max_chunk_elements=max_chunk_elements)
        (fwd.entropy * rollout.completion_mask).sum().backward()
        grads.append({name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6, msg=name)


def naive_logprobs_and_entropy(policy, rollout):
    """log π(y_t) and H_t of every completion token from the model's own full logits (log-softmax over V)."""
    P, T = rollout.prompt_length, rollout.completion_mask.shape[1]
    ids, attention = rollout.input_ids, rollout.attention_mask
    logits = policy(input_ids=ids, attention_mask=attention, position_ids=position_ids_of(attention)).logits
    log_softmax = logits[:, P - 1 : P - 1 + T].float().log_softmax(-1)
    logp = log_softmax.gather(-1, ids[:, P : P + T, None]).squeeze(-1)
    return logp, -(log_softmax.exp() * log_softmax).sum(-1)


def trained_weights(update: Update, objective, rollout):
    learner = make_learner(update, objective)
    rollout = with_rewards(learner, rollout, REWARDS)
    metrics = learner.learn(rollout, torch.optim.SGD(learner.policy.parameters(), lr=LR))
    return learner.policy.state_dict(), metrics, rollout


def by_hand(rollout, objective, coef: float, trained=None, share: float = 1.0):
    """The weights after one SGD step on objective(…) − c · Σ_trained H / (share · N), from the naive forward."""
    policy = load_policy("tiny-llama", seed=0)[0].eval()  # (eval: no dropout, as the update runs)
    logp, entropy = naive_logprobs_and_entropy(policy, rollout)
    mask = rollout.completion_mask
    advantages = rollout.advantages
    if trained is not None:
        advantages = torch.where(trained, advantages[:, None].expand_as(mask), 0.0)
    else:
        trained = mask
    loss = objective(logp, logp.detach(), advantages, mask, counts=Counts.of(mask)).loss
    loss = loss - coef * (entropy * trained).sum() / (share * mask.sum())
    loss.backward()
    with torch.no_grad():
        for param in policy.parameters():
            param -= LR * param.grad
    return policy.state_dict()


@pytest.mark.parametrize("objective", [GRPO(), GSPO()], ids=["GRPO", "GSPO"])
def test_an_update_steps_on_the_objective_minus_c_times_the_mean_token_entropy(objective):
    """One micro-batch, on-policy, skip_zero_advantage_rows at its default: the flat group's rows still run (their
    entropy has a gradient) and the weights are those of the hand loss; the same normaliser for both objectives."""
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    ours, metrics, trained = trained_weights(Update(entropy_coef=0.3, max_grad_norm=None), objective, rollout)
    assert metrics["rows_with_gradient"] == 1.0  # the flat group included
    expected = by_hand(trained, objective, 0.3)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=2e-6, msg=name)
    without, _, _ = trained_weights(Update(max_grad_norm=None), objective, rollout)
    assert any((without[k] - ours[k]).abs().max() > 1e-4 for k in ours)  # the bonus moved the weights
    assert metrics["entropy_coef"] == metrics["entropy_coef_applied"] == 0.3


def test_with_top_entropy_quantile_the_bonus_acts_on_the_kept_tokens_over_rho_n():
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    update = Update(entropy_coef=0.3, top_entropy_quantile=0.25, max_grad_norm=None)
    ours, _, trained = trained_weights(update, GRPO(), rollout)
    with torch.no_grad():
        entropy = token_logprobs(load_policy("tiny-llama", seed=0)[0].eval(), rollout, with_entropy=True).entropy
    mask = rollout.completion_mask
    keep = (entropy >= torch.quantile(entropy[mask], 0.75)) & mask
    assert 0 < int(keep.sum()) < int(mask.sum())
    expected = by_hand(trained, GRPO(), 0.3, trained=keep, share=0.25)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=2e-6, msg=name)


def test_micro_batches_and_minibatches_split_the_bonus_as_the_whole_batch():
    """micro_batch_size 1 (12 micro-batches) is the whole batch's step; a bonus with zero advantages everywhere moves
    the policy towards higher entropy (c > 0) or lower (c < 0)."""
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    whole, _, _ = trained_weights(Update(entropy_coef=0.3), GSPO(), rollout)
    split, _, _ = trained_weights(Update(entropy_coef=0.3, micro_batch_size=1), GSPO(), rollout)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=2e-6, msg=name)

    def mean_entropy_after(coef: float) -> float:
        learner = make_learner(Update(entropy_coef=coef), GRPO())
        flat = with_rewards(learner, rollout, [0.5] * len(REWARDS))
        assert not flat.advantages.any()
        learner.learn(flat, torch.optim.SGD(learner.policy.parameters(), lr=0.05))  # a small step: first order
        with torch.no_grad():
            entropy = token_logprobs(learner.policy, flat, with_entropy=True).entropy
        return float(entropy[flat.completion_mask].mean())

    before = mean_entropy_after(0.0)  # Â = 0 and no bonus: no gradient, the start's entropy
    assert mean_entropy_after(1.0) > before + 1e-3 and mean_entropy_after(-1.0) < before - 1e-3


def test_the_adaptive_coefficient_follows_skywork_or1s_rule_by_hand():
    """c moves by δ after each step towards more bonus while H̄ ≤ H*, less above, within [c_min, c_max]; a step applies
    c only while the last H̄ ≤ H*, none before the first measure. H̄ is over the micro-batches' tokens together."""
    bonus = EntropyBonus(0.1, target=1.0, delta=0.05, coef_min=0.0, coef_max=0.2)
    bonus.before_update(None)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    counts = Counts(tokens=3.0, seqs=2.0, max_len=3.0)
    applied, coefs = [], []
    for values in ([0.5, 0.7, 9.0, 1.2, 9.0, 9.0], [2.0, 2.0, 0.0, 2.0, 0.0, 0.0], [0.0] * 6, [0.1] * 6, [0.1] * 6):
        entropy = torch.tensor(values).view(2, 3)
        half = [mask & (torch.arange(2)[:, None] == row) for row in (0, 1)]  # two micro-batches
        terms = [bonus.loss(entropy, part, counts) for part in half]
        applied.append(bonus.applied_coef)
        assert float(sum(terms)) == pytest.approx(-bonus.applied_coef * float(entropy[mask].sum()) / 3)
        bonus.after_backward(None, None)
        coefs.append(bonus.coef)
    # H̄: 0.8 (≤ 1: up), 2.0 (down), 0.0 (up), 0.1 (up, at the max), 0.1 (stays at the max)
    assert applied == pytest.approx([0.0, 0.15, 0.0, 0.15, 0.2])
    assert coefs == pytest.approx([0.15, 0.10, 0.15, 0.2, 0.2])
    assert bonus.metrics(None) == pytest.approx({"entropy_coef": 0.2, "entropy_coef_applied": 0.1})
    resumed = EntropyBonus(0.1, target=1.0, delta=0.05, coef_max=0.2)
    resumed.load_state_dict(copy.deepcopy(bonus.state_dict()))
    assert (resumed.coef, resumed.last_entropy, resumed.applied_coef) == (0.2, pytest.approx(0.1), 0.2)
    fixed = EntropyBonus(0.1)
    fixed.loss(torch.ones(2, 3), mask, counts)
    fixed.after_backward(None, None)
    assert (fixed.coef, fixed.applied_coef, fixed.last_entropy) == (0.1, 0.1, math.inf)


def test_no_bonus_is_no_hook_and_the_plain_update_bit_for_bit():
    assert EntropyBonus.of(Update()) is None
    assert EntropyBonus.of(Update(entropy_target=0.2)).applied_coef == 0.0  # adaptive from 0: on, nothing yet
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    zero, _, _ = trained_weights(Update(entropy_coef=0.0), GSPO(), rollout)
    plain, _, _ = trained_weights(Update(), GSPO(), rollout)
    assert all(torch.equal(zero[k], plain[k]) for k in zero)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"entropy_coef": float("nan")}, r"entropy_coef must be a finite number .*got nan"),
        ({"entropy_coef_delta": 0.01}, r"entropy_coef_delta=0.01 only act under adaptive entropy control"),
        ({"entropy_coef_max": 0.5, "entropy_coef_min": 0.1}, r"entropy_coef_min=0.1, entropy_coef_max=0.5 only act"),
        ({"entropy_target": -1.0}, r"entropy_target must be a number >= 0 .*got -1.0"),
        ({"entropy_target": 0.2, "entropy_coef_delta": 0.0}, r"entropy_coef_delta must be > 0 .*got 0.0"),
        ({"entropy_target": 0.2, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, r"0 <= min <= max, got 0.5 and"),
    ],
)
def test_settings_that_cannot_act_name_the_value_and_what_is_valid(settings, message):
    with pytest.raises(ValueError, match=message):
        Update(**settings)


def test_a_fit_logs_the_coefficient_each_step_as_the_rule_moves_it(tmp_path):
    """The quickstart at 2 minibatches per RL step (2 optimiser steps) with H* far above any entropy: c grows by δ per
    optimiser step, and the first step of the run applies none (no measure yet)."""
    from test_checkpoint import fit, rows_by_step

    adaptive = ("--model.update.entropy_coef", "0.01", "--model.update.entropy_target", "100")
    fit(tmp_path, 2, *adaptive, "--model.update.entropy_coef_delta", "0.02")
    logged = rows_by_step(sorted(tmp_path.glob("**/metrics.csv")))
    assert float(logged[0, "train/entropy_coef"]) == pytest.approx(0.05)
    assert float(logged[0, "train/entropy_coef_applied"]) == pytest.approx((0.0 + 0.03) / 2)
    assert float(logged[1, "train/entropy_coef"]) == pytest.approx(0.09)
    assert float(logged[1, "train/entropy_coef_applied"]) == pytest.approx((0.05 + 0.07) / 2)
    assert G == 3  # (the learner tests' groups, which REWARDS above is laid out for)
