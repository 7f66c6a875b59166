"""Liveness (issue 20): a reward function that stops answering is given up after its ``timeout_s`` (the batch counts
as failed), instead of hanging the run — under DDP, every other rank waiting in a collective behind it."""

from __future__ import annotations

import time

import pytest

from lit_gspo.rl.rewards import RewardSet, RewardTimeout, RewardWarning
from lit_gspo.runtime.user_errors import option_value


class Stuck:
    timeout_s = 0.5

    def __call__(self, prompts, completions, **columns):
        time.sleep(30)
        return [1.0] * len(completions)


class Quick:
    timeout_s = 5

    def __call__(self, prompts, completions, **columns):
        return [float(len(c)) for c in completions]


def test_a_reward_that_does_not_answer_is_given_up_after_its_timeout():
    rewards = RewardSet([Stuck(), Quick()])
    start = time.perf_counter()
    with pytest.warns(RewardWarning, match=r"'stuck' raised RewardTimeout: no result within timeout_s=0.5 s"):
        scores = rewards.score(["p", "q"], ["a", "bb"])
    assert time.perf_counter() - start < 5
    assert not scores.valid.any() and scores.num_failed == 2
    assert scores.per_function["quick"].tolist() == [1.0, 2.0]  # the others still ran


def test_a_timed_reward_that_answers_scores_as_without_a_timeout():
    assert RewardSet([Quick()]).score(["p"], ["abc"]).total.tolist() == [3.0]


@pytest.mark.parametrize("bad", [0, -1, "10"])
def test_a_bad_timeout_is_refused_naming_the_function(bad):
    reward = Quick()
    reward.timeout_s = bad
    with pytest.raises(
        ValueError,
        match=rf"reward function 'quick' of --model.rewards has timeout_s {option_value(bad)}: give seconds > 0",
    ):
        RewardSet([reward])


def test_reward_timeout_is_a_timeout_error():
    assert issubclass(RewardTimeout, TimeoutError)
