"""Sampled validation (``validation.num_generations``, TRL's ``num_generations_eval``): n completions per held-out
prompt at the validation's temperature; ``val/reward`` is their mean (mean@n), drawn from a seeded stream of its own,
and ``val/pass@k`` the share of prompts with a solved completion among k.
The generation's cuts (top-p, top-k, min-p) apply to it as to the rollouts."""

import csv
import math

import pytest
import torch
from test_trainer import read_metrics, tiny_args

from lit_gspo.lightning.seed import VALIDATION_STREAM, stream_seed
from lit_gspo.rl.evaluate import sampling
from lit_gspo.tools.main import cli_main


def replay(model, datamodule, n: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    """Every held-out sample's reward and length, and each prompt's replies, by ``Collector.sample`` called by hand
    from the validation's stream."""
    collector = model.collector
    torch.manual_seed(stream_seed(model.seed, rank=0, stream=VALIDATION_STREAM))
    rewards, lengths, replies = [], [], []
    budget = collector.generation.val_max_new_tokens or collector.generation.max_new_tokens
    with sampling(collector, n, temperature, budget):
        for rows in datamodule.val_dataloader():
            batch, texts, _ = collector.sample(model.policy, rows)
            rewards.append(batch.rewards.double())
            lengths.append(batch.completion_mask.sum(1).double())
            replies += [texts[i : i + n] for i in range(0, len(texts), n)]
    return torch.cat(rewards), torch.cat(lengths), replies


def test_val_reward_is_the_mean_of_n_samples_per_prompt_drawn_from_the_validations_own_stream(tmp_path):
    n, temperature = 3, 3.0
    args = ["--model.validation.num_generations", str(n), "--model.validation.temperature", str(temperature)]
    args += ["--model.validation.pass_at_k", "[1,3]", "--model.validation.pass_threshold", "0.5"]
    # the untrained policy's replies have no right characters: a reward for any digit gives some prompts solved samples
    args += ["--model.rewards+=lit_gspo.rl.rewards.FormatReward", "--model.rewards.pattern", ".*[0-9].*"]
    cli = cli_main(tiny_args(tmp_path, *args, "--seed_everything", "5", "--data.val_batch_size", "3"), run=False)
    model, datamodule = cli.model, cli.datamodule
    first = cli.trainer.validate(model, datamodule=datamodule, verbose=False)[0]
    torch.manual_seed(1234)  # whatever the run drew in between
    second = cli.trainer.validate(model, datamodule=datamodule, verbose=False)[0]
    for metrics in (first, second):
        del metrics["time/val_s"]
    assert first == second  # the same policy validates alike: the draws are the validation's own

    rewards, lengths, replies = replay(model, datamodule, n, temperature)
    assert rewards.numel() == 8 * n  # 8 held-out prompts (in batches of 3), n samples each
    assert first["val/reward"] == float(rewards.sum() / rewards.numel())  # over samples: a mean over prompts is n×
    assert first["val/response_length"] == float(lengths.sum() / lengths.numel())
    assert any(len(set(group)) > 1 for group in replies)  # sampled, not n copies of one greedy reply
    # pass@k by hand from the same samples: per prompt, c of its n solved (reward >= the threshold)
    counts = (rewards.view(8, n) >= 0.5).sum(1).tolist()
    assert 0 < sum(counts) < 8 * n and len(set(counts)) > 1  # the case tells pass@1 from pass@3 and from a constant
    for k in (1, 3):
        hand = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / 8
        assert first[f"val/pass@{k}"] == pytest.approx(hand, abs=1e-12)
    assert "val/pass@2" not in first  # only the k asked for


def test_the_logged_completions_of_a_sampled_validation_are_each_prompts_samples(tmp_path, capsys):
    n = 2
    args = tiny_args(tmp_path, "--model.validation.num_generations", str(n), "--trainer.max_steps", "1")
    args += ["--model.validation.num_logged_completions", "4", "--model.validation.print_completions", "true"]
    cli = cli_main([*args, "--trainer.enable_progress_bar", "false"], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    printed = capsys.readouterr().out
    assert "step 0: val completions, 2 sampled per prompt, the first 4" in printed
    with open(next(tmp_path.glob("**/completions.csv"))) as f:
        logged = list(csv.DictReader(f))
    first = [r for r in logged if r["step"] == "0"]
    assert len(first) == 4  # 4 samples: 2 prompts × n
    assert first[0]["prompt"] == first[1]["prompt"] != first[2]["prompt"] == first[3]["prompt"]
    rows = read_metrics(tmp_path)
    assert [float(r["step"]) for r in rows if r.get("val/reward")] == [0.0, 1.0]
    assert [float(r["step"]) for r in rows if r.get("val/pass@2")] == [0.0, 1.0]  # by default k = 1, 2, 4, ..., n
    assert {k for k in rows[0] if "pass@" in k} == {"val/pass@1", "val/pass@2"}


def test_min_p_and_the_repetition_penalty_reach_the_engine_in_training_and_in_a_sampled_validation(tmp_path):
    args = tiny_args(tmp_path, "--model.generation.min_p", "0.25", "--model.generation.repetition_penalty", "1.2")
    args += ["--model.validation.num_generations", "2", "--model.validation.every_n_steps", "0"]
    cli = cli_main([*args, "--trainer.max_steps", "1"], run=False)
    engine, seen = cli.model.collector.engine, []
    sample = engine.sample

    def recorded(*args, **kwargs):
        seen.append((kwargs["num_generations"], kwargs["greedy"], kwargs["min_p"], kwargs["repetition_penalty"]))
        return sample(*args, **kwargs)

    engine.sample = recorded
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert (4, False, 0.25, 1.2) in seen and (2, False, 0.25, 1.2) in seen  # a rollout's G = 4, validation's n = 2
