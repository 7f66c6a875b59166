"""The trainer end to end, in-process through LightningCLI: learning, metrics, saving, plug-ins, bad input."""

import csv
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_gspo.rl.engines import HFGenerate
from lit_gspo.rl.objectives import GSPO
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_COLUMNS = {
    "step",
    "train/reward",
    "train/clip_frac",
    "train/kl",
    "train/entropy",
    "train/response_length",
    "val/reward",
}


class HalvedGSPO(GSPO, register=False):
    """A user's objective defined outside the package: GSPO at half the loss."""

    def policy_loss(self, *args, **kwargs):
        out = super().policy_loss(*args, **kwargs)
        out.loss = 0.5 * out.loss
        out.metrics["halved"] = torch.tensor(1.0)
        return out


class FlakyReward:
    """Raises on the first training batch (16 samples) and returns None for every third sample afterwards."""

    def __init__(self):
        self.raised = False

    def __call__(self, prompts, completions, **columns):
        if len(completions) == 16 and not self.raised:
            self.raised = True
            raise RuntimeError("reward server down")
        return [None if i % 3 == 0 else float(c.startswith("7")) for i, c in enumerate(completions)]


def tiny_args(tmp_path, *extra):
    """A seconds-long run: 2-layer model, 8 prompts × 4 completions, 4 new tokens."""
    return [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "3",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "2",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        *extra,
    ]


def read_metrics(root: Path) -> list[dict]:
    files = sorted(root.glob("**/metrics.csv"))
    assert files, f"no metrics.csv under {root}"
    with open(files[-1]) as f:
        return list(csv.DictReader(f))


def column(rows, key):
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def test_fit_updates_the_policy_logs_the_contract_columns_and_saves_an_hf_model(tmp_path):
    cli = cli_main(tiny_args(tmp_path), run=False)
    before = {k: v.clone() for k, v in cli.model.policy.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # as `lit-gspo fit`
    after = cli.model.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    rows = read_metrics(tmp_path)
    assert CONTRACT_COLUMNS <= set(rows[0]), f"missing {CONTRACT_COLUMNS - set(rows[0])}"
    assert len(column(rows, "train/reward")) == 3
    # validation before the first update (step 0), every 2 steps, and at the end
    assert len(column(rows, "val/reward")) >= 3
    assert min(int(r["step"]) for r in rows if r.get("val/reward")) == 0
    assert len(column(rows, "time/val_s")) == len(column(rows, "val/reward")) and min(column(rows, "time/val_s")) > 0
    clip_frac = column(rows, "train/clip_frac")
    assert len(clip_frac) == 3 and all(0 <= v <= 1 for v in clip_frac)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf_model")
    ids = tokenizer("rev 123=", return_tensors="pt").input_ids
    torch.testing.assert_close(reloaded(ids).logits, cli.model.policy.eval()(ids).logits)


def test_rl_learns_a_reward_it_can_reach(tmp_path):
    """Reward 1 for completions starting with '7': from ~chance, GSPO must push the sampled reward up."""
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "25",
            "--model.optimizer.lr",
            "0.01",
            "--model.rewards",
            '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: "7.*"}}]',
            "--model.policy.kl_to_ref",
            "false",
            "--model.validation.every_n_steps",
            "0",
        ),
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rewards = column(read_metrics(tmp_path), "train/reward")
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards


def test_a_users_objective_plugs_in_by_class_path(tmp_path):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "1",
            "--model.objective",
            f"{__name__}.HalvedGSPO",
            "--model.objective.clip_high",
            "5e-4",
        ),
        run=False,
    )
    assert type(cli.model.objective) is HalvedGSPO and cli.model.objective.clip_high == 5e-4
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert column(read_metrics(tmp_path), "train/halved") == [1.0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "GRPO",
        "DAPO",
        "GSPOToken",
        "PPO",
        "DrGRPO",
        "CISPO",
        "GMPO",
        "SAPO",
        "DPPO",
        "ClipCov",
        "KLCov",
        "VESPO",
        "LUSPO",
    ],
)
def test_every_objective_runs_by_class_name(tmp_path, name):
    cli = cli_main(
        tiny_args(
            tmp_path, "--trainer.max_steps", "2", "--model.objective", name, "--model.update.num_minibatches", "2"
        ),
        run=False,
    )
    assert type(cli.model.objective).__name__ == name
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = read_metrics(tmp_path)
    loss = column(rows, "train/loss")
    assert loss and all(torch.isfinite(torch.tensor(loss)))  # (a step without signal logs no loss)
    if name == "PPO":
        assert column(rows, "train/value_loss")


def test_a_failing_reward_is_masked_and_counted_not_fatal(tmp_path):
    cli = cli_main(tiny_args(tmp_path, "--trainer.max_steps", "2", "--model.validation.every_n_steps", "0"), run=False)
    cli.model.collector.rewards.functions[0] = FlakyReward()  # a plain callable, as a user may pass in Python
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    failed = column(read_metrics(tmp_path), "train/reward_failed")
    assert failed[0] == 16  # first call raised: every sample of the step masked
    assert 0 < failed[1] < 16  # then every third sample returned None


class SignalOnOddCalls:
    """Rewards that vary within groups on calls 1, 3, ... and are all 0 (no signal) on calls 2, 4, ..."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions, **columns):
        self.calls += 1
        return [float(i % 2) * (self.calls % 2) for i in range(len(completions))]


def test_a_step_without_signal_logs_zero_clipping_and_no_stale_ratio_statistics(tmp_path):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "4",
            "--model.validation.every_n_steps",
            "0",
            "--model.update.num_minibatches",
            "2",
        ),
        run=False,
    )
    cli.model.collector.rewards.functions[0] = SignalOnOddCalls()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = [r for r in read_metrics(tmp_path) if r.get("train/frac_zero_std_groups")]
    no_signal = [float(r["train/frac_zero_std_groups"]) == 1.0 for r in rows]
    assert len(rows) == 4 and 0 < sum(no_signal) < 4  # (validation calls the reward too)
    for row, empty in zip(rows, no_signal):
        assert 0 <= float(row["train/clip_frac"]) <= 1 and float(row["train/entropy"]) > 0  # contract columns
        ratio = float(row["train/ratio_mean"] or "nan")
        if empty:  # nothing was clipped, and no ratio was measured: not the previous step's value
            assert float(row["train/clip_frac"]) == 0 and ratio != ratio
        else:
            assert ratio == ratio


def test_unknown_objective_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(tiny_args(tmp_path, "--model.objective", "NotAnObjective"), run=False)
    err = capsys.readouterr().err
    assert "NotAnObjective" in err


def test_validation_can_decode_longer_than_the_rollouts(tmp_path):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "2",
            "--model.generation.max_new_tokens",
            "2",
            "--model.generation.val_max_new_tokens",
            "6",
        ),
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = read_metrics(tmp_path)
    assert max(column(rows, "train/response_length")) <= 2
    assert max(column(rows, "val/response_length")) > 2


def test_prompt_longer_than_the_context_is_refused(tmp_path):
    cli = cli_main(tiny_args(tmp_path, "--model.policy.config", "{max_position_embeddings: 8}"), run=False)
    with pytest.raises(ValueError, match="max_prompt_length"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def test_dynamic_sampling_drops_all_equal_groups_and_a_signal_free_run_stops_with_a_clear_error(tmp_path):
    """A reward of 1 for everything makes every group all-equal: DAPO refills up to its cap, skips the
    update, and after max_skipped_steps such steps stops instead of looping forever."""
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "2",
            "--model.objective",
            "DAPO",
            "--model.generation.max_sampling_rounds",
            "3",
            "--model.generation.max_skipped_steps",
            "3",
            "--model.validation.every_n_steps",
            "0",
            "--model.rewards",
            '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: ".*"}}]',
        ),
        run=False,
    )
    before = {k: v.clone() for k, v in cli.model.policy.state_dict().items()}
    assert before
    calls = []

    class CountingEngine(HFGenerate):
        def sample(self, policy, prompt_ids, **kwargs):
            if not kwargs.get("greedy"):
                calls.append(len(prompt_ids))
            return super().sample(policy, prompt_ids, **kwargs)

    cli.model.collector.engine = CountingEngine()
    with pytest.raises(RuntimeError, match="3 RL steps in a row had nothing to learn from"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert calls == [4, 4, 4] * 3  # each step: 3 rounds, every round refilling all 4 dropped groups
    after = cli.model.policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "an update ran on a batch with no signal"


def test_lora_trains_adapters_only_and_saves_a_merged_hf_model_and_the_adapter_alone(tmp_path):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "3",
            "--model.policy.lora",
            "{r: 4, alpha: 8}",
            "--model.optimizer.lr",
            "0.01",  # kl measured on every row, signal or not:
            "--model.update.skip_zero_advantage_rows",
            "false",
        ),
        run=False,
    )
    base = {k: v.clone() for k, v in cli.model.policy.state_dict().items() if "lora_" not in k}
    assert base and len(base) < len(cli.model.policy.state_dict())  # base weights, and adapters beside them
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # as `lit-gspo fit`
    after = cli.model.policy.state_dict()
    assert all(torch.equal(base[k], after[k]) for k in base), "a frozen base weight changed"
    assert cli.model.ref_policy is None  # the reference is the base model with adapters off
    kl = column(read_metrics(tmp_path), "train/kl")
    assert kl[0] == 0 and max(kl) > 0  # adapters start as the identity (lora_B = 0), then move away
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model")
    assert not any("lora" in k for k in reloaded.state_dict())
    ids = torch.tensor([[1, 31, 18, 35, 66, 11]])
    torch.testing.assert_close(reloaded(ids).logits, cli.model.policy.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    # the adapter alone, written beside the merged model, reloads onto the base and reproduces it
    from peft import PeftModel

    from lit_gspo.models import load_policy

    adapter = tmp_path / "hf_adapter"
    assert (adapter / "adapter_config.json").is_file() and not list(adapter.glob("model*.safetensors"))
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    base, _ = load_policy(cli.model.settings.name, config_overrides=cli.model.settings.config, seed=cli.model.seed)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    torch.testing.assert_close(with_adapter(ids).logits, reloaded(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("samples", ["0", "2"], ids=["greedy", "sampled"])
def test_how_often_one_validates_does_not_change_the_training_run(tmp_path, samples):
    """Validation runs on a fork of the RNG: the sampled rollouts, hence the weights, are the same (also when the
    validation samples, from its own stream)."""
    weights, rewards = [], []
    for every in ("1", "0"):
        root = tmp_path / f"val_every_{every}"
        args = tiny_args(root, "--model.validation.every_n_steps", every, "--model.validation.num_generations", samples)
        cli = cli_main([*args, "--seed_everything", "3"], run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        weights.append({k: v.clone() for k, v in cli.model.policy.state_dict().items()})
        rewards.append(column(read_metrics(root), "train/reward"))
    assert len(rewards[0]) == 3 and rewards[0] == rewards[1]
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
