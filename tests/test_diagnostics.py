"""Ratio diagnostics: Σ log r per sequence, length buckets, correlation with length, token-ratio variance."""

import math

import torch

from lit_gspo.rl.learn.diagnostics import RatioStats, buckets, pearson, ratio_diagnostics, sequence_log_ratio


def test_sequence_log_ratio_sums_valid_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, float("nan"), float("inf")]])
    old = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    sums, lengths = sequence_log_ratio(logp, old, mask)
    assert sums.tolist() == [0.5 + 0.0 - 1.0, -0.5]
    assert lengths.tolist() == [3.0, 1.0]
    # log of the product of token ratios
    assert math.isclose(math.exp(sums[0]), math.prod((logp[0] - old[0]).exp().tolist()), rel_tol=1e-6)


def test_buckets_cover_the_range_contiguously():
    assert buckets(6, 3) == [(1, 2), (3, 4), (5, 6)]
    assert buckets(6, 3, start=0) == [(0, 1), (2, 3), (4, 5)]
    assert buckets(2, 3) == [(1, 1), (2, 2)]  # never more buckets than lengths
    b = buckets(16, 3)
    assert b[0][0] == 1 and b[-1][1] == 16 and all(b[i][1] + 1 == b[i + 1][0] for i in range(len(b) - 1))


def test_pearson_hand_values_and_degenerate_cases():
    assert math.isclose(pearson(torch.tensor([1.0, 2, 3]), torch.tensor([2.0, 4, 6])), 1.0)
    assert math.isclose(pearson(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])), -1.0)
    assert math.isnan(pearson(torch.tensor([1.0, 2]), torch.tensor([5.0, 5.0])))
    assert math.isnan(pearson(torch.tensor([1.0]), torch.tensor([1.0])))


def test_ratio_diagnostics_hand_computed():
    # three sequences: lengths 1, 2, 4 (max_len 4, 2 buckets: lengths 1-2 and 3-4; positions 0-1 and 2-3)
    s = torch.tensor([0.1, -0.4, 0.8], dtype=torch.float64)
    L = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    tok = torch.tensor([0.1, -0.2, -0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    pos = torch.tensor([0, 0, 1, 0, 1, 2, 3])
    out = ratio_diagnostics(s, L, tok, pos, max_len=4, num_buckets=2)
    assert math.isclose(out["seq_logratio_absmax"], 0.8)
    assert math.isclose(out["seq_logratio_std"], float(s.std(unbiased=False)))
    assert math.isclose(
        out["seq_geo_logratio_std"], float(torch.tensor([0.1, -0.2, 0.2], dtype=torch.float64).std(unbiased=False))
    )
    assert math.isclose(out["seq_logratio_len_corr"], pearson(s.abs(), L))
    assert math.isclose(out["seq_logratio_absmax_len1-2"], 0.4)
    assert math.isclose(out["seq_logratio_std_len1-2"], 0.25)  # values 0.1, -0.4
    assert math.isclose(out["seq_logratio_absmax_len3-4"], 0.8)
    assert math.isnan(out["seq_logratio_std_len3-4"])  # one sequence: undefined, but the key is there
    early = torch.tensor([0.1, -0.2, -0.2, 0.2, 0.2], dtype=torch.float64).exp()
    assert math.isclose(out["token_ratio_var_pos0-1"], float(early.var(unbiased=False)))
    assert math.isclose(out["token_ratio_var_pos2-3"], 0.0, abs_tol=1e-15)


def test_keys_do_not_depend_on_the_data():
    empty = RatioStats().compute(max_len=6)
    stats = RatioStats()
    stats.add(torch.randn(4, 6), torch.randn(4, 6), torch.ones(4, 6, dtype=torch.bool))
    full = stats.compute(max_len=6)
    assert set(empty) == set(full) and all(math.isnan(v) for v in empty.values())
    assert math.isnan(full["seq_logratio_len_corr"])  # all lengths equal


def test_ratio_stats_joins_micro_batches_like_one_batch():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.arange(5)[None, :] < torch.tensor([1, 2, 3, 4, 5, 5])[:, None]
    whole, parts = RatioStats(), RatioStats()
    whole.add(logp, old, mask)
    parts.add(logp[:2, :2], old[:2, :2], mask[:2, :2])  # a trimmed micro-batch
    parts.add(logp[2:], old[2:], mask[2:])
    a, b = whole.compute(max_len=5), parts.compute(max_len=5)
    assert a.keys() == b.keys()
    for k in a:
        assert (math.isnan(a[k]) and math.isnan(b[k])) or math.isclose(a[k], b[k], rel_tol=1e-12), k


def test_token_level_drift_grows_with_length():
    """Independent per-token drifts: the std of Σ log r grows like sqrt(length); the geometric mean's shrinks."""
    g = torch.Generator().manual_seed(0)
    n, T = 4000, 16
    logp = 0.05 * torch.randn(n, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    stats = RatioStats()
    stats.add(logp, torch.zeros_like(logp), mask)
    out = stats.compute(max_len=T, num_buckets=2)
    short, long = out["seq_logratio_std_len1-8"], out["seq_logratio_std_len9-16"]
    assert long > 1.5 * short
    assert out["seq_logratio_len_corr"] > 0.3
