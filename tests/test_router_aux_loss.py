"""update.router_aux_loss_coef (TRL's): an MoE policy's load-balancing loss joins the update's loss, each micro-batch's
weighted by its share of the minibatch's tokens; refused for a dense model."""

from __future__ import annotations

import pytest
import torch
from test_learner import MAX_NEW, G, sample_rollout, with_rewards

from lit_gspo.models import load_policy
from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.objectives import GSPO, Counts
from lit_gspo.rl.rollout import position_ids_of

REWARDS = [0.5, 0.5, 0.5, 1.0, 0.0, 0.2, 0.9, 0.1, 0.0, 1.0, 0.3, 0.6]  # the first group flat: Â = 0 there
LR, COEF = 0.5, 0.05


def moe_learner(update: Update) -> Learner:
    policy, _ = load_policy("tiny-qwen3-moe", seed=0)
    return Learner(policy, GSPO(), update, max_len=MAX_NEW, group_size=G)


def logprobs_and_router_loss(policy, rollout):
    """The completion tokens' log-probs and the load-balancing loss of ``rollout``'s rows, from the model's own forward."""
    P, T = rollout.prompt_length, rollout.completion_mask.shape[1]
    ids, attention = rollout.input_ids, rollout.attention_mask
    out = policy(
        input_ids=ids, attention_mask=attention, position_ids=position_ids_of(attention), output_router_logits=True
    )
    log_softmax = out.logits[:, P - 1 : P - 1 + T].float().log_softmax(-1)
    return log_softmax.gather(-1, ids[:, P : P + T, None]).squeeze(-1), out.aux_loss


@pytest.mark.parametrize("micro_batch_size", [None, 6], ids=["one micro-batch", "two micro-batches"])
def test_the_update_adds_c_times_each_micro_batchs_router_loss_weighted_by_its_tokens(micro_batch_size):
    """loss = GSPO(all rows) + c · Σ_m (n_m / N) L_aux(m), n_m the micro-batch's completion tokens; the flat group's
    rows run too (their router loss has a gradient)."""
    update = Update(router_aux_loss_coef=COEF, micro_batch_size=micro_batch_size, max_grad_norm=None)
    learner = moe_learner(update)
    assert not learner.packs and not learner.aligns
    rollout = with_rewards(learner, sample_rollout(load_policy("tiny-qwen3-moe", seed=0)[0]), REWARDS)
    metrics = learner.learn(rollout, torch.optim.SGD(learner.policy.parameters(), lr=LR))
    assert metrics["rows_with_gradient"] == 1.0 and metrics["router_aux_loss"] > 0

    policy = load_policy("tiny-qwen3-moe", seed=0)[0].eval()
    mask = rollout.completion_mask
    logp, _ = logprobs_and_router_loss(policy, rollout)
    loss = GSPO()(logp, logp.detach(), rollout.advantages, mask, counts=Counts.of(mask, MAX_NEW)).loss
    size = micro_batch_size or len(rollout)
    for start in range(0, len(rollout), size):
        part = rollout.select(torch.arange(start, min(start + size, len(rollout))))
        _, router_loss = logprobs_and_router_loss(policy, part)
        loss = loss + COEF * router_loss * part.completion_mask.sum() / mask.sum()
    loss.backward()
    with torch.no_grad():
        for param in policy.parameters():
            param -= LR * param.grad
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(learner.policy.state_dict()[name], value, rtol=0, atol=2e-6, msg=name)


def test_null_is_the_model_configs_coefficient_and_a_dense_model_is_refused_by_name():
    assert moe_learner(Update(router_aux_loss_coef=None)).router_aux_coef == pytest.approx(0.001)  # Qwen3-MoE's
    dense, _ = load_policy("tiny-llama", seed=0)
    assert Learner(dense, GSPO(), Update(router_aux_loss_coef=None)).router_aux_coef == 0.0
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01: LlamaForCausalLM is not a Mixture-of-Experts"):
        Learner(dense, GSPO(), Update(router_aux_loss_coef=0.01))
    with pytest.raises(ValueError, match=r"router_aux_loss_coef must be >= 0 .*got -1"):
        Update(router_aux_loss_coef=-1)


def test_without_it_an_moe_update_is_the_plain_one_bit_for_bit():
    rollout = sample_rollout(load_policy("tiny-qwen3-moe", seed=0)[0])
    weights = []
    for update in (Update(), Update(router_aux_loss_coef=0.0)):
        learner = moe_learner(update)
        learner.learn(with_rewards(learner, rollout, REWARDS), torch.optim.SGD(learner.policy.parameters(), lr=LR))
        weights.append(learner.policy.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
