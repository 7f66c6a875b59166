"""Fits through the CLI with ``--model.engine VLLMEngine`` (issue 31): it learns as the default engine does, logs the
weight pushes, and its log-probs reach the mismatch layer. Needs vLLM (``pytest -m vllm``, .ci/run's second
environment); a separate module from test_vllm_engine.py, whose engine is closed at that module's end (one vLLM per
process at a time)."""

import csv
from pathlib import Path

import pytest
from lightning.pytorch import Callback

pytest.importorskip("vllm", reason="needs vLLM: pip install 'lit-gspo[vllm]' (its own environment, see .ci/run)")

from lit_gspo.rl.engines import VLLMEngine  # noqa: E402
from lit_gspo.tools.main import cli_main  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


def args(tmp_path, engine: str, *extra: str) -> list[str]:
    """The quickstart with the vLLM overlay's model (head size 32), seconds-long: 8 prompts × 4, ≤ 4 new tokens."""
    return [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--config",
        str(ROOT / "configs/engines/vllm.yaml"),
        "--model.engine",
        engine,
        "--trainer.default_root_dir",
        str(tmp_path),
        "--model.policy.warm_start.steps",
        "0",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "8",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        *extra,
    ]


def metrics(root: Path) -> list[dict]:
    (path,) = root.glob("**/metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def column(rows, key):
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def fit(argv):
    cli = cli_main(argv, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # its end frees the engine: the next test builds its own
    return cli


class FailsAtTheFirstStep(Callback):
    def on_train_batch_end(self, *args) -> None:
        raise RuntimeError("a fit that fails")


def test_fits_one_after_another_in_one_process_each_build_their_vllm(tmp_path):
    """`lit-gspo ablate` runs its arms in one process, a notebook fits twice: a fit's end, or its failure, frees its
    vLLM (one per process), so the next fit builds its own instead of failing at its first rollout."""
    quick = ("--trainer.max_steps", "1", "--model.validation.every_n_steps", "0")
    first = fit(args(tmp_path / "first", "VLLMEngine", *quick))
    assert isinstance(first.model.collector.engine, VLLMEngine) and first.model.collector.engine.llm is None
    failing = cli_main(args(tmp_path / "failing", "VLLMEngine", *quick), run=False)
    failing.trainer.callbacks.append(FailsAtTheFirstStep())
    with pytest.raises(RuntimeError, match="a fit that fails"):
        failing.trainer.fit(failing.model, datamodule=failing.datamodule)
    assert failing.model.collector.engine.llm is None
    third = fit(args(tmp_path / "third", "VLLMEngine", *quick))
    assert len(column(metrics(tmp_path / "third"), "train/reward")) == 1
    assert third.model.collector.engine.llm is None


@pytest.mark.parametrize("engine", ["HFGenerate", "VLLMEngine"])
def test_rl_learns_a_reward_it_can_reach_with_either_engine(tmp_path, engine):
    """tests/test_trainer.py's learning check, on both engines: reward 1 for completions starting with '7'."""
    fit(
        args(
            tmp_path,
            engine,
            "--trainer.max_steps",
            "25",
            "--model.optimizer.lr",
            "0.01",
            "--model.policy.kl_to_ref",
            "false",
            "--model.rewards",
            '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: "7.*"}}]',
            "--model.validation.every_n_steps",
            "0",
        )
    )
    rewards = column(metrics(tmp_path), "train/reward")
    assert len(rewards) == 25 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards


def test_a_vllm_fit_logs_its_weight_pushes_and_its_logprobs_are_measured_against_the_trainers(tmp_path):
    """Every step after an update pushes (time/weight_sync_s); the first, right after validation pushed the same
    weights, does not. ``model.update.mismatch`` gets the engine's log-probs: k3 against the trainer's fp32 π_old ≈ 0."""
    fit(
        args(
            tmp_path,
            "VLLMEngine",
            "--trainer.max_steps",
            "4",
            "--model.validation.every_n_steps",
            "0",
            "--model.update.mismatch",
            "{}",
        )
    )
    rows = [r for r in metrics(tmp_path) if r.get("train/reward")]
    sync = [float(r.get("time/weight_sync_s") or "nan") for r in rows]
    assert len(sync) == 4 and sync[0] != sync[0] and all(s > 0 for s in sync[1:]), sync  # NaN: nothing pushed
    k3 = column(rows, "train/mismatch/k3")
    assert len(k3) == 4 and max(k3) < 1e-9, k3


def test_vllms_logprobs_as_pi_old_leave_gspo_on_policy(tmp_path):
    """``old_logprobs: sampler``: no trainer pass, π_old = vLLM's. On-policy (one minibatch) GSPO's sequence ratios
    then sit within its ε of 3e-4 of 1, so nothing is clipped: vLLM's fp32 log-probs are the trainer's."""
    fit(
        args(
            tmp_path,
            "VLLMEngine",
            "--trainer.max_steps",
            "3",
            "--model.validation.every_n_steps",
            "0",
            "--model.update.mismatch",
            "{old_logprobs: sampler}",
        )
    )
    clip = column(metrics(tmp_path), "train/clip_frac")
    assert clip == [0.0, 0.0, 0.0], clip


def test_under_bf16_mixed_precision_vllm_samples_in_bfloat16(tmp_path):
    """``dtype: auto`` is the trainer's forward's: autocast's bfloat16 under ``bf16-mixed`` (the first rollout, in
    validation, runs under it). Then the log-probs differ from the trainer's a little (bf16 kernels), not 0."""
    cli = fit(
        args(
            tmp_path,
            "VLLMEngine",
            "--trainer.max_steps",
            "2",
            "--model.validation.every_n_steps",
            "0",
            "--trainer.precision",
            "bf16-mixed",
            "--model.update.mismatch",
            "{}",
        )
    )
    assert cli.model.collector.engine.resolved_dtype == "bfloat16"
    k3 = column(metrics(tmp_path), "train/mismatch/k3")
    assert len(k3) == 2 and all(1e-9 < v < 1e-2 for v in k3), k3


def test_on_the_updates_bf16_casts_vllm_samples_in_bfloat16_without_autocast(tmp_path):
    """``update.param_dtype: bf16`` under ``32-true``: the trainer computes in bf16 on its casts, and ``dtype: auto``
    builds vLLM in bfloat16 too (not the parameters' fp32)."""
    cli = fit(
        args(
            tmp_path,
            "VLLMEngine",
            "--trainer.max_steps",
            "1",
            "--model.validation.every_n_steps",
            "0",
            "--model.update.param_dtype",
            "bf16",
        )
    )
    assert cli.model.collector.engine.resolved_dtype == "bfloat16"
