"""``lit-gspo eval``: the pass@k estimator against hand-computed values, and the command on a tiny run
(greedy reward = the run's last val/reward = ``Collector.sample``'s, pass@k and mean@n recomputed from
the per-prompt counts it writes, a .ckpt and the saved hf_model give the same numbers)."""

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_gspo.rl.evaluate import PassAtK, default_ks, evaluate, pass_at_k, shares
from lit_gspo.tools import eval as eval_cli
from lit_gspo.tools.eval import load, run, run_config
from lit_gspo.tools.main import cli_main, main

ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 − C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 − C(3,2)/C(5,2)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    # the Codex paper's numerically stable form: 1 − Π_{i=n−c+1}^{n} (1 − k/i)
    for n, c, k in [(64, 5, 8), (20, 3, 1), (10, 7, 4)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1)))
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]


def tiny_run(root: Path, *extra: str) -> list[str]:
    """A seconds-long quickstart fit's arguments: 2 RL steps after a short warm start (so greedy rewards are not all
    0), validated before and after, 6 held-out prompts; ``extra`` overrides."""
    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.default_root_dir", str(root)]
    args += ["--trainer.max_steps", "2", "--model.policy.warm_start.steps", "20"]
    args += ["--model.validation.every_n_steps", "0"]
    args += ["--data.num_train", "64", "--data.num_val", "6", "--data.prompts_per_step", "4"]
    args += ["--model.generation.num_generations", "4", "--model.generation.max_new_tokens", "4"]
    return [*args, "--trainer.enable_progress_bar", "false", *extra]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The tiny fit, with a checkpoint at every step."""
    root = tmp_path_factory.mktemp("run")
    args = tiny_run(root, "--trainer.enable_checkpointing", "true", "--checkpoint_every_n_steps", "1")
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return root


def last_val_reward(root: Path) -> float:
    with open(next(root.glob("**/metrics.csv"))) as f:
        return [float(r["val/reward"]) for r in csv.DictReader(f) if r.get("val/reward")][-1]


def test_pass_at_k_tally_by_hand_over_batches_and_ranks():
    """Two prompts of n = 4 samples, c = 1 and c = 3 solved (one solved-looking sample's reward failed: its completion
    is masked whole); pass@2 = ((1 − C(3,2)/C(4,2)) + 1) / 2 = 0.75. Summed over a second tally (another rank or batch),
    the mean is over all prompts."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.9, 1.0, 1.0, 1.0, 2.0])  # group-major: prompt 0's 4, then prompt 1's
    mask = torch.ones(8, 3, dtype=torch.bool)
    mask[7] = False  # prompt 1's last sample: reward failed
    tally = PassAtK(4, [1, 2, 4], threshold=0.95)
    solved = tally.add(SimpleNamespace(rewards=rewards, completion_mask=mask))
    assert solved.tolist() == [[True, False, False, False], [True, True, True, False]]
    assert tally.reduce(prefix="val") == pytest.approx({"val/pass@1": 0.5, "val/pass@2": 0.75, "val/pass@4": 1.0})
    other = PassAtK(4, [1, 2, 4], threshold=0.95)
    other.add(SimpleNamespace(rewards=torch.zeros(4), completion_mask=torch.ones(4, 3, dtype=torch.bool)))
    summed = tally.reduce(lambda sums: sums + other.sums, prefix="")
    assert summed == pytest.approx({"pass@1": 1 / 3, "pass@2": 0.5, "pass@4": 2 / 3})  # 3 prompts, the third unsolved
    with pytest.raises(ValueError, match=r"every k of pass@k must be in \[1, n=4\], got \[5\]"):
        PassAtK(4, [5], threshold=1.0)


def test_eval_of_the_saved_model_prints_greedy_and_pass_at_k_and_writes_checked_json(run_dir, capsys):
    assert run_config(str(run_dir / "hf_model")) is not None  # the config.yaml fit saved in the run is found
    assert main(["eval", "--ckpt", str(run_dir / "hf_model"), "--samples", "4"]) is None  # the console entry point
    out = capsys.readouterr().out
    assert "reading the run's config" in out
    for text in ("greedy", "accuracy", "mean@4", "pass@1", "pass@2", "pass@4"):
        assert text in out
    output = run_dir / "hf_model.eval.json"  # next to the model
    written = json.loads(output.read_text())
    assert written["prompts"] == 6 and written["rewards"] == ["char_accuracy"] and written["split"] == "validation"
    per = written["per_prompt"]
    # greedy: the run's own last val/reward (same held-out rows, same decoding, same reward)
    greedy = written["greedy"]
    assert greedy["reward"] == pytest.approx(last_val_reward(run_dir), abs=1e-6)
    assert greedy["reward"] > 0, "the warm start should give some partial credit"
    assert greedy["reward"] == pytest.approx(sum(p["greedy_reward"] for p in per) / 6)
    assert greedy["accuracy"] == pytest.approx(sum(p["greedy_reward"] >= 1.0 for p in per) / 6)
    # sampled: mean@4 and pass@k recomputed by hand from the per-prompt rewards
    sampled = written["sampled"]
    rewards = [p["sample_rewards"] for p in per]
    assert all(len(r) == 4 for r in rewards)
    assert sampled["mean@4"] == pytest.approx(sum(map(sum, rewards)) / 24)
    counts = [sum(x >= 1.0 for x in r) for r in rewards]
    assert counts == [p["samples_solved"] for p in per]
    for k in (1, 2, 4):
        hand = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / 6
        assert sampled[f"pass@{k}"] == pytest.approx(hand)
    assert sampled["pass@1"] == pytest.approx(sum(counts) / 24)


def test_a_lightning_checkpoint_and_the_hf_model_give_the_same_numbers_as_collector_sample(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False, map_location="cpu")["rl_step"] == 2  # the final weights
    out = tmp_path / "ckpt.json"
    cli = load(["--ckpt", str(ckpt), "--samples", "4", "--output", str(out)])
    result = run(cli)
    assert json.loads(out.read_text())["sampled"] == result["sampled"]
    from_hf = eval_cli.main(
        ["--ckpt", str(run_dir / "hf_model"), "--samples", "4", "--output", str(tmp_path / "hf.json")]
    )
    assert result["greedy"]["reward"] == pytest.approx(from_hf["greedy"]["reward"])
    assert result["sampled"] == pytest.approx(from_hf["sampled"])  # same weights, same seed: same samples
    # the trainer's own greedy scoring of the same rows
    cli.datamodule.setup()
    batch, replies, _ = cli.model.collector.sample(cli.model.policy, cli.datamodule.val_rows, greedy=True)
    assert result["greedy"]["reward"] == pytest.approx(float(batch.rewards.mean()))
    assert [p["greedy_completion"] for p in result["per_prompt"]] == replies


def test_shares_split_every_batch_over_the_processes_by_hand():
    """As W processes validate: rank r takes rows r, r + W, ... of every batch; all of rank 0's shares come first (each
    rank draws from its own stream, in order); a rank with no row of a batch gets no share."""
    assert list(shares(7, 4, 2)) == [(0, [0, 2]), (0, [4, 6]), (1, [1, 3]), (1, [5])]
    assert list(shares(3, 4, 4)) == [(0, [0]), (1, [1]), (2, [2])]
    assert list(shares(5, 2)) == [(0, [0, 1]), (0, [2, 3]), (0, [4])]


def test_evaluating_as_two_processes_is_each_processs_share_evaluated_from_its_own_stream(run_dir):
    """``evaluate(world_size=2, seed=[a, b])`` on 6 rows in batches of 4 is, prompt for prompt, rank 0's rows (0, 2 | 4)
    evaluated alone in batches of 2 from seed a, and rank 1's (1, 3 | 5) from seed b; its means are over all 6 prompts.
    The case tells the streams apart: one process drawing all rows from seed a samples other rewards."""
    cli = load(["--ckpt", str(run_dir / "hf_model")])
    cli.datamodule.setup()
    rows, module = cli.datamodule.val_rows, cli.model
    assert len(rows) == 6

    def evaluated(rows, **kwargs):
        settings = dict(samples=3, temperature=1.2, threshold=0.5, ks=[1, 3], greedy_batch_size=4)
        return evaluate(module.policy, module.collector, rows, **{**settings, **kwargs})

    both = evaluated(rows, sample_batch_size=4, world_size=2, seed=[11, 12])
    alone = [evaluated(rows[r::2], sample_batch_size=2, greedy_batch_size=2, seed=s) for r, s in ((0, 11), (1, 12))]
    for r in (0, 1):
        assert both["per_prompt"][r::2] == alone[r]["per_prompt"]
    rewards = [p["sample_rewards"] for p in both["per_prompt"]]
    assert both["sampled"]["mean@3"] == pytest.approx(sum(map(sum, rewards)) / 18)  # fp32 rewards
    counts = [p["samples_solved"] for p in both["per_prompt"]]
    assert both["sampled"]["pass@3"] == pytest.approx(sum(c > 0 for c in counts) / 6, abs=1e-12)
    assert both["greedy"]["reward"] == pytest.approx(sum(p["greedy_reward"] for p in both["per_prompt"]) / 6)
    one = evaluated(rows, sample_batch_size=4, seed=11)
    assert [p["sample_rewards"] for p in one["per_prompt"]] != rewards
    with pytest.raises(ValueError, match=r"seed one int, or one per process .* world_size=2, seed=11"):
        evaluated(rows, world_size=2, seed=11)


def test_a_run_says_how_many_processes_it_ran_on_and_eval_refuses_fewer_than_one(run_dir, tmp_path):
    """The checkpoint (one RNG state per process) and the export (``lit_gspo_processes.json``) of a one-process run
    say 1; a model of no run says nothing (eval samples as one process). ``--world_size 0`` names the value."""
    from lit_gspo.lightning.run_dir import EXPORT_PROCESSES, world_size_of
    from lit_gspo.runtime.user_errors import SettingsError

    assert world_size_of(str(run_dir / "checkpoints" / "last.ckpt")) == 1
    assert json.loads((run_dir / "hf_model" / EXPORT_PROCESSES).read_text()) == {"world_size": 1}
    assert world_size_of(str(run_dir / "hf_model")) == 1
    assert world_size_of(str(tmp_path)) is None and world_size_of("HuggingFaceTB/SmolLM2-135M") is None
    with pytest.raises(SettingsError, match=r"--world_size 0: the processes to sample as must be >= 1"):
        eval_cli.main(["--ckpt", str(run_dir / "hf_model"), "--world_size", "0", "--output", str(tmp_path / "e.json")])


def test_a_users_jsonl_with_the_runs_rewards(run_dir, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"rev {n}=", "answer": n[::-1]}) + "\n" for n in ("123", "450", "907"))
    )
    out = tmp_path / "mine.json"
    result = eval_cli.main(
        [
            "--ckpt",
            str(run_dir / "hf_model"),
            "--data.val_source",
            str(data),
            "--samples",
            "0",
            "--output",
            str(out),
            "--threshold",
            "0.5",
        ]
    )
    assert result["prompts"] == 3 and "sampled" not in result and result["data"] == str(data)
    assert [p["prompt"] for p in result["per_prompt"]] == ["rev 123=", "rev 450=", "rev 907="]
    assert result["greedy"]["accuracy"] == pytest.approx(
        sum(p["greedy_reward"] >= 0.5 for p in result["per_prompt"]) / 3
    )
    assert json.loads(out.read_text())["greedy"] == result["greedy"]


def test_eval_of_a_checkpoint_reproduces_the_sampled_validation_its_run_logged(tmp_path):
    """A run that validates sampled (n = 3 at T = 1.2, pass@1 and pass@3 at threshold 0.3, batches of 4 prompts, a
    validation budget of its own): ``eval`` of its last checkpoint, with no sampling option, draws the same samples
    (the validation's seeded stream, batches and budget) and reports its last ``val/reward`` as mean@3 and its
    ``val/pass@k``, the same numbers."""
    args = tiny_run(tmp_path / "run", "--data.val_batch_size", "4", "--model.generation.max_new_tokens", "3")
    args += ["--model.generation.val_max_new_tokens", "4", "--model.validation.num_generations", "3"]
    args += ["--model.validation.temperature", "1.2", "--model.validation.pass_at_k", "[1,3]"]
    args += ["--model.validation.pass_threshold", "0.3"]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    with open(next((tmp_path / "run").glob("**/metrics.csv"))) as f:
        logged = [r for r in csv.DictReader(f) if r.get("val/reward")][-1]
    assert float(logged["step"]) == 2

    ckpt = next((tmp_path / "run").glob("**/checkpoints/last.ckpt"))
    result = eval_cli.main(["--ckpt", str(ckpt), "--output", str(tmp_path / "eval.json")])
    sampled = result["sampled"]
    settings = (sampled["samples"], sampled["temperature"], sampled["max_new_tokens"], result["threshold"])
    assert settings == (3, 1.2, 4, 0.3)  # the validation's n, temperature, budget and threshold
    assert sorted(k for k in sampled if k.startswith("pass@")) == ["pass@1", "pass@3"]
    assert 0 < sampled["pass@1"] < sampled["pass@3"]  # the case tells the draws apart
    assert sampled["mean@3"] == float(logged["val/reward"])
    assert sampled["response_length"] == float(logged["val/response_length"])
    for k in (1, 3):
        assert sampled[f"pass@{k}"] == pytest.approx(float(logged[f"val/pass@{k}"]), abs=1e-12)
    # an option still overrides the run's: other draws, other numbers
    other = eval_cli.main(["--ckpt", str(ckpt), "--samples", "3", "--temperature", "0.7", "--greedy", "false"])
    assert other["sampled"]["temperature"] == 0.7 and other["sampled"]["mean@3"] != sampled["mean@3"]
