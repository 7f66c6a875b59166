"""DAPO's overlong filtering (``update.mask_truncated_completions``, TRL's ``mask_truncated_completions``): a sample
whose last reply the token budget cut trains on none of its tokens, keeps its reward in its group's advantages, and
counts as a sequence in seq-mean normalisers, as in TRL."""

from __future__ import annotations

import copy

import pytest
import torch
from test_learner import ROWS, make_collector, make_learner, sample_rollout, with_rewards

from lit_gspo.models import load_policy
from lit_gspo.rl.config import Generation, Update
from lit_gspo.rl.engines import LeanSampler
from lit_gspo.rl.objectives import GRPO

REWARDS = [1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.0, 1.0, 0.3, 0.6, 0.4, 0.8]
TRUNCATED = torch.tensor([True, False, False, False, True, False, True, False, False, False, False, True])


def test_the_collector_flags_the_replies_the_budget_cut():
    policy, _ = load_policy("tiny-llama", seed=0)
    collector = make_collector(LeanSampler(), generation=Generation(num_generations=8, max_new_tokens=3))
    torch.manual_seed(0)
    batch, _, stats = collector.sample(policy, ROWS)
    lengths = batch.completion_mask.sum(1)
    last = batch.input_ids[:, batch.prompt_length :].gather(1, (lengths - 1)[:, None]).squeeze(1)
    ended = torch.isin(last, torch.tensor(collector.stop_ids))
    assert torch.equal(batch.truncated, ~ended) and 0 < int(ended.sum()) < len(batch)
    assert stats["clipped_ratio"] == float(batch.truncated.float().mean())
    assert torch.equal(batch.select(torch.tensor([3, 1])).truncated, batch.truncated[[3, 1]])


def learned(update: Update, rollout, objective=None):
    learner = make_learner(update, objective)
    rollout = with_rewards(learner, rollout, REWARDS)
    metrics = learner.learn(rollout, torch.optim.SGD(learner.policy.parameters(), lr=0.5))
    return learner.policy.state_dict(), metrics, rollout


def test_masked_rows_train_as_rows_with_an_empty_loss_mask_and_keep_their_advantage():
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    rollout.truncated = TRUNCATED
    masked, metrics, trained = learned(Update(mask_truncated_completions=True), rollout)
    by_hand = copy.deepcopy(rollout)
    by_hand.completion_mask = by_hand.completion_mask & ~TRUNCATED[:, None]
    emptied, _, _ = learned(Update(), by_hand)
    plain, _, _ = learned(Update(), rollout)
    assert all(torch.equal(masked[k], emptied[k]) for k in masked)
    assert any(not torch.equal(masked[k], plain[k]) for k in masked)
    assert trained.advantages[TRUNCATED].abs().sum() > 0  # their rewards still shape their groups' advantages
    carried = ~TRUNCATED & (trained.advantages != 0)  # a row of Â = 0 carries none either (skip_zero_advantage_rows)
    assert metrics["rows_with_gradient"] == pytest.approx(float(carried.float().mean()))


def test_a_masked_row_counts_as_a_sequence_in_a_seq_mean_loss_as_in_trl():
    """GRPO (seq-mean-token-mean), on-policy: ℓ_{i,t} = −Â_i, so loss = −(1/N) Σ_{i not truncated} Â_i — TRL's
    ``((ℓ · m).sum(-1) / m.sum(-1).clamp(min=1)).mean()`` over every row, the masked ones adding 0."""
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    rollout.truncated = TRUNCATED
    _, metrics, trained = learned(Update(mask_truncated_completions=True), rollout, GRPO())
    expected = -float(trained.advantages[~TRUNCATED].sum()) / len(TRUNCATED)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-6)


def test_a_rollout_that_does_not_say_which_rows_were_cut_is_refused_in_one_line():
    rollout = sample_rollout(load_policy("tiny-llama", seed=0)[0])
    rollout.truncated = None
    with pytest.raises(ValueError, match="mask_truncated_completions needs to know which rows the token budget cut"):
        learned(Update(mask_truncated_completions=True), rollout)


def test_a_fit_trains_on_no_token_of_a_truncated_sample(tmp_path):
    """As a user runs it: at every RL step the update's loss mask is empty on exactly the rows the collector flagged,
    and those are the share train/clipped_ratio logs."""
    import csv

    from test_trainer import tiny_args

    from lit_gspo.rl.learn.hooks import UpdateHook
    from lit_gspo.tools.main import cli_main

    class Spy(UpdateHook):
        def __init__(self):
            self.seen = []

        def before_update(self, update):
            self.seen.append((update.rollout.truncated.clone(), update.rollout.completion_mask.any(1)))

    args = tiny_args(
        tmp_path, "--model.update.mask_truncated_completions", "true", "--model.generation.max_new_tokens", "8"
    )
    cli = cli_main([*args, "--model.policy.warm_start.steps", "20"], run=False)
    spy = Spy()
    cli.model.learner.hooks.hooks.append(spy)  # after the built-in hooks: sees the rollout the update trains on
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("train/clipped_ratio")]
    assert len(spy.seen) == len(rows) == 3
    for (truncated, trains), row in zip(spy.seen, rows):
        assert torch.equal(trains, ~truncated)
        assert float(row["train/clipped_ratio"]) == pytest.approx(float(truncated.float().mean()))
    assert any(0 < float(t.float().mean()) < 1 for t, _ in spy.seen)
