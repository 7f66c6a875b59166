"""The stats of several sets of samples (a step's sampling rounds, its ranks, ``eval``'s batches) merged are the stats of
their union: each reward function's mean and std over every sample it scored, rates over the episodes they are rates
of, counts summed. Before, a step kept its first sampling round's stats only, and ranks averaged their means."""

from __future__ import annotations

import math

import pytest
import torch
from test_learner import ROWS, G, make_collector

from lit_gspo.models import load_policy
from lit_gspo.rl.collect.collector import per_function_stats
from lit_gspo.rl.evaluate import _aggregate_stats
from lit_gspo.runtime.sample_stats import WEIGHT, merge_stats, weighted, without_weights


def scores_with_unscored(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=generator, dtype=torch.float64) * 2 + 1
    values[torch.rand(n, generator=generator) < 0.3] = math.nan  # not scored by the function
    return values


def sample_stats(scores: torch.Tensor, failed: int = 0) -> dict[str, float]:
    """A scoring call's stats, as ``Collector.sample`` returns them."""
    stats = {"reward_failed": float(failed), **per_function_stats({"f": scores})}
    return weighted(stats, len(scores))


@pytest.mark.parametrize("sizes", [(7, 5, 12), (1, 9), (3, 1, 1, 8), (0, 6)], ids=str)
def test_merged_function_stats_are_the_unions_mean_and_bessel_std(sizes):
    scores = scores_with_unscored(sum(sizes), seed=len(sizes))
    scores[:1] = math.nan
    parts = list(torch.split(scores, list(sizes)))
    merged = merge_stats([sample_stats(part) for part in parts])
    scored = scores[torch.isfinite(scores)]
    assert merged["rewards/f/mean"] == pytest.approx(float(scored.mean()), abs=1e-12)
    assert merged["rewards/f/std"] == pytest.approx(float(scored.std()), abs=1e-12)
    assert merged[WEIGHT + "rewards/f/mean"] == len(scored)
    # rounds, then ranks: merging merged stats again is the same union
    halves = [merge_stats([sample_stats(p) for p in parts[:1]]), merge_stats([sample_stats(p) for p in parts[1:]])]
    again = merge_stats(halves)
    assert again["rewards/f/mean"] == pytest.approx(merged["rewards/f/mean"], abs=1e-12)
    assert again["rewards/f/std"] == pytest.approx(merged["rewards/f/std"], abs=1e-12)


def test_a_function_that_scored_fewer_than_two_samples_has_no_std_and_none_no_mean():
    one = merge_stats([sample_stats(torch.tensor([math.nan, 2.0])), sample_stats(torch.tensor([math.nan]))])
    assert one["rewards/f/mean"] == 2.0 and math.isnan(one["rewards/f/std"])
    none = merge_stats([sample_stats(torch.tensor([math.nan])), sample_stats(torch.tensor([math.nan, math.nan]))])
    assert math.isnan(none["rewards/f/mean"]) and math.isnan(none["rewards/f/std"])


def test_dropped_samples_of_every_rank_add_up():
    ranks = [{"async/dropped": 8.0, "async/dropped_total": 16.0}, {"async/dropped": 0.0, "async/dropped_total": 8.0}]
    assert merge_stats(ranks) == {"async/dropped": 8.0, "async/dropped_total": 24.0}


def test_counts_add_rates_weigh_by_their_episodes_timings_take_the_longest():
    first = {"reward_failed": 1.0, "turns": 2.0, "success_turn2": 0.5, WEIGHT + "success_turn2": 2.0, "time/x": 3.0}
    second = {"reward_failed": 2.0, "turns": 1.0, "success_turn2": 1.0, WEIGHT + "success_turn2": 2.0, "time/x": 1.0}
    merged = merge_stats([weighted(first, 4, ["turns"]), weighted(second, 2, ["turns"])])
    assert merged["reward_failed"] == 3.0 and merged["time/x"] == 3.0
    assert merged["turns"] == pytest.approx((4 * 2 + 2 * 1) / 6)
    assert merged["success_turn2"] == pytest.approx((2 * 0.5 + 2 * 1.0) / 4)  # of the episodes that reached turn 2
    assert without_weights(merged).keys() == {"reward_failed", "turns", "success_turn2", "time/x"}


def test_evals_batches_report_the_pooled_std_and_no_weights():
    parts = [scores_with_unscored(5, seed=1), scores_with_unscored(8, seed=2)]
    out = _aggregate_stats([sample_stats(part, failed=1) for part in parts])
    scored = torch.cat(parts)[torch.isfinite(torch.cat(parts))]
    assert out == pytest.approx(
        {"reward_failed": 2.0, "rewards/f/mean": float(scored.mean()), "rewards/f/std": float(scored.std())}
    )


def test_a_steps_stats_are_over_every_sampling_round():
    """Dynamic sampling: the first round's groups are all flat (dropped, refilled), the second round's are not and one
    sample fails. ``rewards/<f>/mean`` is over both rounds' scored samples (the same set as ``reward_all_groups``, a
    failed sample aside), ``reward_failed`` counts the second round's failure."""
    calls = []

    def flat_then_spread(prompts, completions, **columns):
        calls.append(len(completions))
        if len(calls) == 1:
            return [1.0] * len(completions)
        return [None if i == 0 else float(i % 2) for i in range(len(completions))]

    collector = make_collector(reward=flat_then_spread, dynamic_sampling=True, max_sampling_rounds=2)
    torch.manual_seed(0)
    _, stats = collector.collect(load_policy("tiny-llama", seed=0)[0], ROWS, refill=lambda n: ROWS[:n])
    n = len(ROWS) * G
    assert calls == [n, n] and stats["sampling_rounds"] == 2.0
    second = [float(i % 2) for i in range(1, n)]  # the failed sample 0 unscored
    expected = torch.tensor([1.0] * n + second, dtype=torch.float64)
    assert stats["rewards/flat_then_spread/mean"] == pytest.approx(float(expected.mean()), abs=1e-6)  # (fp32 scores)
    assert stats["rewards/flat_then_spread/std"] == pytest.approx(float(expected.std()), abs=1e-6)
    assert stats["reward_failed"] == 1.0
