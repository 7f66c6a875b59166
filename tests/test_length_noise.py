"""benchmarks/length_noise.py: the noise estimator and the on-policy identity GRPO = GSPO on every minibatch."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from length_noise import gradient_noise, length_buckets, main  # noqa: E402
from test_compare import G, make_rollout  # noqa: E402

from lit_gspo.models import load_policy  # noqa: E402
from lit_gspo.rl.rollout_io import policy_dir, save_rollout  # noqa: E402


def test_the_noise_of_a_constant_gradient_is_zero_and_scales_out():
    g = torch.randn(50, dtype=torch.float64)
    constant = gradient_noise([g.clone() for _ in range(5)], g)
    assert constant["msd"] == 0.0 and constant["rel_trace_cov"] < 1e-25  # (the mean of 5 copies rounds)
    draws = [torch.randn(50, dtype=torch.float64) for _ in range(7)]
    mean = torch.stack(draws).double().mean(0)
    one, scaled = gradient_noise(draws, mean), gradient_noise([3 * d for d in draws], 3 * mean)
    assert one["rel_trace_cov"] > 0 and scaled["rel_trace_cov"] == pytest.approx(one["rel_trace_cov"], rel=1e-12)
    assert one["msd"] == pytest.approx(one["trace_cov"] * 6 / 7, rel=1e-12)  # around their own mean: (D−1)/D of it


def test_length_buckets_never_split_a_length():
    buckets = length_buckets(torch.tensor([3, 0, 5, 5, 5, 5, 2, 9, 9, 1]), 3)
    assert [b.tolist() for b in buckets] == [[9, 6, 0], [2, 3, 4, 5], [7, 8]]  # row 1 is empty: in none


def test_on_policy_grpo_and_gspo_have_the_same_minibatch_noise(tmp_path):
    policy, tokenizer = load_policy(
        "tiny-llama", config_overrides={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}, seed=0
    )
    path = tmp_path / "rollouts" / "step_1.pt"
    meta = {
        "temperature": 1.0,
        "max_len": 7,
        "group_size": G,
        "update": {},
        "optimizer": "AdamW",
        "optimizer_hparams": {"lr": 1e-2},
        "model": "tiny-llama",
    }
    save_rollout(path, make_rollout(policy), step=1, meta=meta)  # rows of lengths 1..7
    policy.save_pretrained(policy_dir(path))
    tokenizer.save_pretrained(policy_dir(path))
    out = tmp_path / "out"
    report = main(
        [
            "--rollout",
            str(path),
            "--objectives",
            "grpo",
            "gspo",
            "--steps",
            "1",
            "--buckets",
            "2",
            "--minibatch_size",
            "3",
            "--draws",
            "4",
            "--out",
            str(out),
        ]
    )
    assert (out / "length_noise.json").is_file() and (out / "length_noise.png").is_file()
    k0 = [e for e in report["results"] if e["k"] == 0]
    k1 = [e for e in report["results"] if e["k"] == 1]
    assert len(k0) == len(k1) == 2 and k0[0]["max_length"] < k0[1]["min_length"]
    for e in k0:  # ratio 1: both are (1/B) Σ_i Â_i mean_t ∇ log π(y_it), and equal to the on-policy baseline
        grpo, gspo, base = (e["objectives"][k] for k in ("grpo", "gspo", "on-policy at θk"))
        assert e["token_logr_std"] == 0.0 and grpo["rel_trace_cov"] > 0
        assert gspo["rel_trace_cov"] == pytest.approx(grpo["rel_trace_cov"], rel=1e-4)
        assert gspo["full_norm2"] == pytest.approx(grpo["full_norm2"], rel=1e-4)
        assert base["rel_trace_cov"] == pytest.approx(grpo["rel_trace_cov"], rel=1e-4)
    for e in k1:  # the weights moved (lr 1e-2): ratios ≠ 1 and GSPO's 3e-4 band clips, so the two differ
        assert e["token_logr_std"] > 1e-3
        assert e["objectives"]["gspo"]["rel_trace_cov"] != pytest.approx(
            e["objectives"]["grpo"]["rel_trace_cov"], rel=1e-3
        )
