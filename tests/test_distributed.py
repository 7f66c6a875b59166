"""Two CPU processes (gloo): DDP and FSDP2 (ModelParallelStrategy) give the single-process run of the same global batch.

Each run is ``tests/dist_run.py`` in a subprocess (Lightning's ``ddp`` / ``ModelParallelStrategy``
launchers re-run that script for rank 1). Sampling is seeded per prompt there, so one process with 4
prompts per step and two processes with 2 each roll out the same 16 completions per step; the update
then runs 2 epochs (the second off-policy, with clipping) in micro-batches of 4.

Tolerances. DDP/FSDP2 vs one process: the gradient is the same sum computed in a different order
(per-rank partial sums, then an all-reduce/reduce-scatter average ×world) and the per-rank batches
are left-padded to different widths, so values may differ by float32 rounding: 1e-5 absolute on
parameters after 4 AdamW steps at lr 1e-2 (one step moves a weight by up to ~1e-2; rounding in the
gradient moves Adam's update by ~lr·1e-6), 1e-5 relative on logged metrics. In practice they agree
to ~1e-7. 8-bit AdamW vs 32-bit AdamW: quantised moments change each update by up to a few percent,
so the total parameter change must agree to 10% (relative L2) with cosine > 0.99, and the logged loss
and KL to 1e-3.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_gspo.models import load_policy
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
FSDP2 = [
    "--trainer.strategy",
    "lightning.pytorch.strategies.ModelParallelStrategy",
    "--trainer.strategy.data_parallel_size",
    "2",
    "--trainer.strategy.tensor_parallel_size",
    "1",
]


def run_args(root: Path, *extra: str, prompts: int = 4, devices: int = 1, steps: int = 2) -> list[str]:
    """2 RL steps (×2 epochs = 4 optimiser steps): 4 prompts × 4 completions per step in total."""
    return [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--trainer.devices",
        str(devices),
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "1",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        str(prompts),
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        "--model.optimizer.lr",
        "0.01",
        "--model.rewards",
        '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: "[0-4].*"}}]',
        "--model.update.epochs",
        "2",
        "--model.update.micro_batch_size",
        "4",
        # every row runs, so entropy/kl/ratio means cover the same rows however they are split over ranks
        "--model.update.skip_zero_advantage_rows",
        "false",
        # FSDP2 runs every row's prompt (one root forward per backward): the single-process reference too,
        # so that the runs compare sharding alone (AdamW at lr 0.01 magnifies float-order differences)
        "--model.update.share_prompt_forward",
        "false",
        *extra,
    ]


def launch(
    out: Path, cli_args: list[str], *, ckpt_path: str | None = None, timeout: int = 240, count_syncs: bool = False
) -> dict:
    cmd = (
        [sys.executable, str(ROOT / "tests/dist_run.py")]
        + (["--ckpt_path", ckpt_path] if ckpt_path else [])
        + (["--count_syncs"] if count_syncs else [])
        + [str(out)]
    )
    with socket.socket() as s:  # a fresh rendezvous port per run (other jobs on the machine may hold the default)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    proc = subprocess.run(cmd + ["--", *cli_args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out / "result.pt", weights_only=False)


def metric(result: dict, key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in result["metrics"] if r.get(key) not in (None, "")]


def assert_same_run(a: dict, b: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    for key in (
        "train/loss",
        "train/reward",
        "train/reward_std",
        "train/kl",
        "train/entropy",
        "train/clip_frac",
        "train/grad_norm",
        "train/response_length",
        "val/reward",
    ):
        ma, mb = metric(a, key), metric(b, key)
        assert [s for s, _ in ma] == [s for s, _ in mb], key
        torch.testing.assert_close(
            torch.tensor([v for _, v in ma]), torch.tensor([v for _, v in mb]), atol=1e-6, rtol=rtol, msg=key
        )
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(a["weights"][name], b["weights"][name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The reference: one process, 4 prompts per step, torch AdamW."""
    root = tmp_path_factory.mktemp("single")
    return launch(root, run_args(root))


@pytest.mark.distributed
def test_ddp_two_processes_match_one_process_on_the_same_global_batch(tmp_path, single):
    result = launch(tmp_path, run_args(tmp_path, "--trainer.strategy", "ddp", prompts=2, devices=2))
    assert result["world_size"] == 2
    assert len(metric(result, "train/loss")) == 2 and any(v != 0 for _, v in metric(result, "train/loss"))
    assert any(v > 0 for _, v in metric(result, "train/clip_frac"))  # the off-policy epoch clips: not trivially equal
    assert_same_run(result, single)
    assert_every_metric_the_same(result, single)


def assert_every_metric_the_same(a: dict, b: dict) -> None:
    """Every train/* and val/* metric either run logs, the other logs too, with the same values: the reductions over
    ranks (token-weighted means, sums, the merged sample stats, gathered diagnostics) are one process's."""
    keys = {k for run in (a, b) for row in run["metrics"] for k in row if k.startswith(("train/", "val/"))}
    differ = {}
    for key in sorted(keys):
        ma, mb = metric(a, key), metric(b, key)
        close = [s for s, _ in ma] == [s for s, _ in mb] and all(
            (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-5 + 1e-4 * abs(y) for (_, x), (_, y) in zip(ma, mb)
        )
        if not close:
            differ[key] = (ma, mb)
    assert not differ, differ


@pytest.mark.distributed
def test_ddp_reduces_the_gradients_once_per_optimiser_step_not_once_per_micro_batch(tmp_path, single):
    """Each minibatch's micro-batches but the last run under Lightning's ``strategy.block_backward_sync`` (DDP's
    ``no_sync``): 2 RL steps × 2 epochs = 4 optimiser steps, each of 2 micro-batches of 4 rows, reduce 4 times (before:
    8, one all-reduce of every gradient per micro-batch), and the run is still one process's."""
    result = launch(tmp_path, run_args(tmp_path, "--trainer.strategy", "ddp", prompts=2, devices=2), count_syncs=True)
    assert result["syncs"] == 4
    assert_same_run(result, single)


@pytest.mark.distributed
def test_ddp_skipping_zero_advantage_rows_gives_the_same_weights_as_one_process_running_every_row(tmp_path, single):
    """Each rank skips its own rows with Â = 0 (one placeholder row if it has none): gradients stay exact."""
    skip = ["--model.update.skip_zero_advantage_rows", "true"]
    result = launch(tmp_path, run_args(tmp_path, "--trainer.strategy", "ddp", *skip, prompts=2, devices=2))
    for name in single["weights"]:
        torch.testing.assert_close(result["weights"][name], single["weights"][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.distributed
def test_ddp_on_bf16_casts_matches_one_process_on_bf16_casts(tmp_path):
    """``update.param_dtype``: the gradients reach the fp32 parameters through the casts, where DDP's hooks average them
    over ranks as without the casts."""
    casts = ["--model.update.param_dtype", "bf16"]
    single = launch(tmp_path / "single", run_args(tmp_path / "single", *casts))
    ddp = run_args(tmp_path / "ddp", "--trainer.strategy", "ddp", *casts, prompts=2, devices=2)
    result = launch(tmp_path / "ddp", ddp)
    assert any(v > 0 for _, v in metric(result, "train/clip_frac"))
    assert_same_run(result, single)


@pytest.mark.distributed
def test_fsdp2_on_bf16_casts_matches_one_process_on_bf16_casts(tmp_path):
    """``update.param_dtype`` under FSDP2: its mixed precision gathers bf16 parameters and reduces gradients in fp32,
    the update of one process on the casts."""
    casts = ["--model.update.param_dtype", "bf16"]
    single = launch(tmp_path / "single", run_args(tmp_path / "single", *casts))
    result = launch(tmp_path / "fsdp2", run_args(tmp_path / "fsdp2", *FSDP2, *casts, prompts=2, devices=2))
    assert any(v > 0 for _, v in metric(result, "train/clip_frac"))
    assert_same_run(result, single)


@pytest.mark.distributed
def test_fsdp2_two_processes_match_one_process_and_save_a_loadable_hf_model(tmp_path, single):
    from transformers import AutoModelForCausalLM

    result = launch(tmp_path, run_args(tmp_path, *FSDP2, prompts=2, devices=2))
    assert result["world_size"] == 2
    assert_same_run(result, single)
    assert_every_metric_the_same(result, single)
    # sharded optimiser state: each rank holds about half of AdamW's 8 bytes/parameter
    assert result["state_bytes"] < 0.6 * single["state_bytes"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model")
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, result["weights"][name], atol=0, rtol=0)


@pytest.mark.distributed
def test_fsdp2_with_lora_exports_the_merged_model_and_the_adapter_one_process_exports(tmp_path):
    """A sharded policy cannot be copied to merge its adapters (FSDP2 refuses ``deepcopy``: the export failed after
    training); its merged model is written from the gathered weights, and equals the one process's merged copy."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = ("--model.policy.lora", "{r: 4, alpha: 8}")
    one, two = tmp_path / "one", tmp_path / "two"
    launch(one, run_args(one, *lora))
    sharded = launch(two, run_args(two, *lora, *FSDP2, prompts=2, devices=2))
    merged_one = AutoModelForCausalLM.from_pretrained(one / "hf_model").state_dict()
    merged_two = AutoModelForCausalLM.from_pretrained(two / "hf_model")
    assert type(merged_two).__name__ == "LlamaForCausalLM"
    merged_two = merged_two.state_dict()
    assert merged_one.keys() == merged_two.keys()
    for name in merged_one:
        torch.testing.assert_close(merged_two[name], merged_one[name], atol=1e-5, rtol=0, msg=name)
    base = sharded["weights"]["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert (merged_two["model.layers.0.self_attn.q_proj.weight"] - base).abs().max() > 1e-4  # the adapter moved it
    torch.testing.assert_close(
        merged_two["model.layers.0.mlp.up_proj.weight"],
        sharded["weights"]["base_model.model.model.layers.0.mlp.up_proj.weight"],
        atol=0,
        rtol=0,
    )
    adapters = [load_file(root / "hf_adapter" / "adapter_model.safetensors") for root in (one, two)]
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) == 2 * 4 * 2  # A, B × 4 modules × 2 layers
    for name in adapters[0]:
        torch.testing.assert_close(adapters[1][name], adapters[0][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.distributed
def test_fsdp2_cpu_config_alone_shards_over_both_processes(tmp_path, single):
    """configs/scale/fsdp2_cpu.yaml (a class path, no mesh sizes) is FSDP2 over 2 processes (issue 19, finding 7)."""
    args = run_args(tmp_path, prompts=2, devices=2)
    args[2:2] = ["--config", str(ROOT / "configs/scale/fsdp2_cpu.yaml")]  # right after the quickstart: the rest wins
    result = launch(tmp_path, args)
    assert result["world_size"] == 2 and result["state_bytes"] < 0.6 * single["state_bytes"]  # sharded state
    assert_same_run(result, single)


@pytest.mark.parametrize(
    "strategy",
    [
        ("--config", str(ROOT / "configs/scale/fsdp2_cpu.yaml")),
        ("--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy"),
    ],
    ids=["config", "class_path"],
)
def test_fsdp2_by_class_path_alone_builds_a_strategy_whose_mesh_is_data_parallel(tmp_path, strategy, monkeypatch):
    """Before: "invalid strategy name: lightning.pytorch.strategies.modelparallelstrategy" for the class path alone,
    and Lightning's "auto" sizes made a tensor-parallel mesh, which lit_gspo refuses."""
    from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy

    args = run_args(tmp_path, devices=2)
    args[2:2] = list(strategy)
    cli = cli_main(args, run=False)
    trainer = cli.trainer
    assert isinstance(trainer.strategy, ModelParallelStrategy)
    monkeypatch.setattr(ParallelStrategy, "setup_environment", lambda self: None)  # no process group here
    monkeypatch.setattr(ModelParallelStrategy, "_setup_distributed", lambda self: None)
    monkeypatch.setattr("lightning.pytorch.strategies.model_parallel._setup_device_mesh", lambda *a: a[:3])
    trainer.strategy._lightning_module = cli.model
    trainer.strategy.setup_environment()
    assert trainer.strategy._device_mesh == (2, 1, 2)  # data_parallel_size 2, tensor_parallel_size 1, world 2


def ddp_env() -> dict:
    """A CLI fit's environment for 2 DDP processes on a free loopback port, with tests/ importable (fault_helpers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    }


@pytest.mark.distributed
def test_ddp_ranks_sample_with_draws_of_their_own(tmp_path):
    """Before: ``seed_everything`` seeded both ranks alike and each sampled its prompts with the other's uniforms; the
    tiny policy, hardly reading its prompt before training, sampled the same completions on both (half the global
    batch a copy). Now every rank but rank 0 reseeds its default streams after the warm start."""
    records = tmp_path / "records"
    records.mkdir()
    reward = f"[{{class_path: fault_helpers.RecordsSamples, init_args: {{directory: {records}}}}}]"
    fit = [sys.executable, "-m", "lit_gspo.tools.main", "fit"]
    fit += run_args(tmp_path / "run", "--trainer.strategy", "ddp", "--model.rewards", reward, prompts=2, devices=2)
    fit += ["--model.validation.every_n_steps", "0"]
    proc = subprocess.run(fit, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [[json.loads(line) for line in open(records / f"rank{r}.jsonl")] for r in (0, 1)]
    rollouts = [
        [call for call in calls if len(set(call["prompts"])) < len(call["prompts"])] for calls in ranks
    ]  # G each
    assert len(rollouts[0]) == len(rollouts[1]) == 2  # two RL steps
    for zero, one in zip(*rollouts):
        assert zero["draw"] != one["draw"] and zero["completions"] != one["completions"]


@pytest.mark.distributed
def test_eval_of_a_ddp_runs_checkpoint_reproduces_the_validation_its_two_processes_logged_and_predict_runs_on_two(
    tmp_path,
):
    """Before: each rank validated its share of every batch from its own stream, and ``eval`` drew all the prompts
    from rank 0's: another number than the run logged, presented as its reproduction. Now the checkpoint and the
    export say the run had 2 processes, and ``eval`` samples each share from its process's stream: the same mean@3
    and pass@k as the run's last ``val/reward`` and ``val/pass@k``; ``--world_size 1`` draws others."""
    from lit_gspo.tools import eval as eval_cli

    fit = [sys.executable, "-m", "lit_gspo.tools.main", "fit"]
    fit += run_args(tmp_path / "run", "--trainer.strategy", "ddp", prompts=2, devices=2)
    fit += ["--checkpoint_every_n_steps", "1", "--data.val_batch_size", "4", "--model.generation.max_new_tokens", "3"]
    fit += ["--model.validation.num_generations", "3", "--model.validation.temperature", "1.2"]
    fit += ["--model.validation.pass_at_k", "[1,3]", "--model.validation.pass_threshold", "0.3"]
    fit += ["--model.rewards", "[{class_path: lit_gspo.rl.rewards.CharAccuracy}]"]  # partial credit: means differ
    fit += ["--model.policy.warm_start.steps", "20"]  # some credit to draw
    proc = subprocess.run(fit, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(next((tmp_path / "run").glob("**/metrics.csv"))) as fh:
        logged = [r for r in csv.DictReader(fh) if r.get("val/reward")][-1]
    assert float(logged["step"]) == 2

    for model in ("checkpoints/last.ckpt", "hf_model"):
        result = eval_cli.main(["--ckpt", str(tmp_path / "run" / model), "--output", str(tmp_path / "eval.json")])
        sampled = result["sampled"]
        assert result["world_size"] == 2 and sampled["samples"] == 3
        assert 0 < sampled["pass@1"] < sampled["pass@3"]  # the case tells the draws apart
        assert sampled["mean@3"] == float(logged["val/reward"]), model
        for k in (1, 3):
            assert sampled[f"pass@{k}"] == pytest.approx(float(logged[f"val/pass@{k}"]), abs=1e-12), model
    one = eval_cli.main(["--ckpt", str(tmp_path / "run/hf_model"), "--world_size", "1", "--greedy", "false"])
    assert one["world_size"] == 1 and one["sampled"]["mean@3"] != float(logged["val/reward"])

    # `lit-gspo predict` of the same run, on its 2 processes (its config): rank 0 writes each held-out row once, in order
    predict = [sys.executable, "-m", "lit_gspo.tools.main", "predict", "--ckpt_path", str(tmp_path / "run/hf_model")]
    proc = subprocess.run(predict, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]  # before: rank 0 alone read trainer.log_dir, a collective: a hang
    lines = (tmp_path / "run/lightning_logs/predict/predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["row"]["prompt"] for line in lines] == [p["prompt"] for p in result["per_prompt"]]
    assert all(len(json.loads(line)["completions"]) == 3 for line in lines)  # the run's sampled validation's n


@pytest.mark.distributed
def test_ddp_with_a_reward_failing_on_every_rank_stops_every_rank_with_its_error(tmp_path):
    """Before (issue 20): every sample of every rank failed, yet each rank kept its all-masked rollout and stepped the
    optimiser; the run ran all its steps, exited 0 and saved a model. Now the ranks agree the step has nothing to
    learn from, count it alike, and all stop after max_skipped_steps with the reward's error. (A reward failing from
    its very first call stops the run at that call instead: the test below.)"""
    cmd = [
        sys.executable,
        "-m",
        "lit_gspo.tools.main",
        "fit",
        *run_args(
            tmp_path,
            "--trainer.strategy",
            "ddp",
            "--model.generation.max_skipped_steps",
            "2",
            "--model.validation.every_n_steps",
            "0",
            "--model.rewards",
            "[{class_path: fault_helpers.RaisesAfterFirstCall}]",
            prompts=2,
            devices=2,
            steps=20,
        ),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "2 RL steps in a row had nothing to learn from" in proc.stderr, proc.stderr[-3000:]
    assert (
        "The last reward error: reward function 'raises_after_first_call' raised ConnectionError: reward server down"
        in proc.stderr
    )
    assert not (tmp_path / "hf_model").exists()
    with open(next(tmp_path.glob("**/metrics.csv"))) as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh) if r.get("train/reward")]
    assert steps == [0]  # stopped in the 2nd step (it raises before its row), not after 20 steps


@pytest.mark.distributed
def test_ddp_with_a_reward_failing_from_its_first_call_stops_every_rank_at_the_first_scoring(tmp_path):
    """Issue 29: a reward that fails on every sample of its first call stops the run there, on every rank, naming it."""
    cmd = [
        sys.executable,
        "-m",
        "lit_gspo.tools.main",
        "fit",
        *run_args(
            tmp_path,
            "--trainer.strategy",
            "ddp",
            "--model.validation.every_n_steps",
            "0",
            "--model.rewards",
            "[{class_path: fault_helpers.AlwaysRaises}]",
            prompts=2,
            devices=2,
            steps=20,
        ),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "reward function 'always_raises' raised ConnectionError: reward server down" in proc.stderr
    assert not (tmp_path / "hf_model").exists()
    rows = list(tmp_path.glob("**/metrics.csv"))
    assert not rows or "train/reward" not in rows[0].read_text()  # no RL step ran


def _update_vector(weights: dict) -> torch.Tensor:
    initial, _ = load_policy("tiny-llama", config_overrides=MODEL_CONFIG, seed=0)
    start = initial.state_dict()
    return torch.cat([(weights[k].float() - start[k].float()).flatten() for k in start])


@pytest.mark.distributed
def test_adamw8bit_under_fsdp2_keeps_uint8_state_tracks_adamw_and_resumes_from_a_sharded_checkpoint(tmp_path, single):
    eight_bit = [
        "--model.optimizer",
        "bitsandbytes.optim.AdamW8bit",
        "--model.optimizer.lr",
        "0.01",
        "--trainer.enable_checkpointing",
        "true",
        "--checkpoint_every_n_steps",
        "1",
    ]
    first = launch(tmp_path / "a", run_args(tmp_path, *FSDP2, *eight_bit, prompts=2, devices=2, steps=1))
    assert first["optimizer"] == "ShardAwareAdamW8bit"
    # bitsandbytes keeps 8-bit state for tensors of >= 4096 elements (min_8bit_size) and fp32 state below
    assert "torch.uint8" in first["state_dtypes"]["state1"] and "torch.float32" in first["state_dtypes"]["state1"]
    assert first["uint8_state_numel"] > 0
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_dir(), "FSDP2 writes a distributed (sharded) checkpoint directory"
    resumed = launch(
        tmp_path / "b", run_args(tmp_path, *FSDP2, *eight_bit, prompts=2, devices=2, steps=2), ckpt_path="last"
    )
    # the resumed run (a new logger version) logs only the second RL step
    newest = resumed["metrics_by_file"][max(resumed["metrics_by_file"])]
    assert [int(r["step"]) for r in newest if r.get("train/loss")] == [1]
    ours, reference = _update_vector(resumed["weights"]), _update_vector(single["weights"])
    assert (ours - reference).norm() / reference.norm() < 0.1
    assert torch.nn.functional.cosine_similarity(ours, reference, dim=0) > 0.99
    for key in ("train/loss", "train/kl"):
        ref = dict(metric(single, key))
        for step, value in metric(first, key) + metric(resumed, key):
            assert abs(value - ref[step]) < 1e-3, (key, step, value, ref[step])


def test_fsdp1_strategy_is_refused_with_a_pointer_to_fsdp2(tmp_path):
    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        cli_main(run_args(tmp_path, "--trainer.strategy", "fsdp"), run=False)
    from lightning.pytorch.strategies import FSDPStrategy

    from lit_gspo.lightning.strategy import FSDP1_NOTE, check_strategy

    assert "19626" in FSDP1_NOTE and "19685" in FSDP1_NOTE
    with pytest.raises(ValueError, match="FSDP2"):
        check_strategy(FSDPStrategy)


def processes_of(root: Path) -> list[int]:
    """Processes whose command line names ``root``: a run's ranks and the rollout workers they forked."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (cmdline.parent / "status").read_text()
        except OSError:
            continue
        if str(root) in text and "\nState:\tZ" not in status:
            found.append(int(cmdline.parent.name))
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("worker", ["process", "thread"])
def test_ddp_with_k1_runs_a_worker_per_rank_keeps_the_ranks_in_step_and_leaves_none_behind(tmp_path, worker):
    """Asynchronous rollouts under DDP (issue 38): each rank samples its batches in its own worker, the learners stay
    identical, every step after the first trains on a batch sampled one version earlier, and no worker outlives the
    run."""
    extra = ["--trainer.strategy", "ddp", "--model.generation.max_staleness", "1"]
    extra += ["--model.generation.async_worker", worker, "--model.validation.every_n_steps", "2"]
    result = launch(tmp_path, run_args(tmp_path, *extra, prompts=2, devices=2, steps=4))
    assert result["world_size"] == 2
    assert [v for _, v in metric(result, "train/staleness")] == [0.0, 1.0, 1.0, 1.0]
    assert [s for s, _ in metric(result, "val/reward")] == [0, 2, 4]
    rank0, rank1 = (torch.load(tmp_path / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1))
    initial, _ = load_policy("tiny-llama", config_overrides=MODEL_CONFIG, seed=0)
    assert any(not torch.equal(rank0[k], v) for k, v in initial.state_dict().items())  # it learned
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    # step 1 trains the batch drawn to prime the pipeline: each rank its own prompts, not the same twice
    refills = [torch.load(tmp_path / f"refills_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert len(refills[0]) == len(refills[1]) == 2 and refills[0] != refills[1]
    assert not processes_of(tmp_path)


@pytest.mark.distributed
def test_ddp_with_a_rollout_worker_failing_on_one_rank_stops_every_rank_naming_it(tmp_path):
    cmd = [sys.executable, "-m", "lit_gspo.tools.main", "fit"]
    cmd += run_args(
        tmp_path,
        "--trainer.strategy",
        "ddp",
        "--model.generation.max_staleness",
        "1",
        "--model.engine",
        "fault_helpers.FailsOnRank1",
        "--trainer.enable_checkpointing",
        "true",
        "--checkpoint_every_n_steps",
        "1",
        prompts=2,
        devices=2,
        steps=20,
    )
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and time.perf_counter() - start < 120, proc.stderr[-3000:]
    assert (
        "WorkerFailed: the rollout worker (lit-gspo-rollout-worker-rank1, pid " in proc.stderr
        and ") failed: RuntimeError: sampler out of memory on rank 1" in proc.stderr
    ), proc.stderr[-3000:]
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] >= 1
    assert not processes_of(tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case",
    [
        "dynamic sampling keeps no group on rank 0",
        "rank 0 skips a group's rows",
    ],
)
def test_ddp_ranks_with_unequal_rows_to_learn_from_finish_in_step(tmp_path, case):
    """Before, a rank with fewer micro-batches than the other (``rank_pairing.py``) left it waiting in DDP's gradient
    reduction: DAPO's dynamic sampling keeping no group on one rank hung the fit at its first update; so did one rank
    skipping more rows with Â = 0 (the default) under a micro-batch size. Now both ranks run as many passes and learn
    in step (tests/test_rank_pairing.py checks the weights against one process)."""
    if case.startswith("dynamic"):  # rank 0: every reward 0; rank 1: 0, 1, 0, 1, …
        extra = ["--model.generation.dynamic_sampling", "true", "--model.generation.max_sampling_rounds", "1"]
        extra += ["--model.rewards", "[{class_path: fault_helpers.ConstantOnRank0}]"]
    else:  # rank 0's first group all 0
        extra = ["--model.update.skip_zero_advantage_rows", "true"]
        extra += ["--model.rewards", "[{class_path: fault_helpers.FirstGroupConstantOnRank0}]"]
    extra += ["--trainer.strategy", "ddp", "--model.validation.every_n_steps", "0"]
    result = launch(tmp_path, run_args(tmp_path, *extra, prompts=2, devices=2), timeout=180)
    assert [s for s, _ in metric(result, "train/loss")] == [0, 1]
    if case.startswith("dynamic"):  # rank 1's 2 groups kept, rank 0's none: the logged rewards are rank 1's
        assert [v for _, v in metric(result, "train/reward")] == [0.5, 0.5]
        assert [v for _, v in metric(result, "train/frac_zero_std_groups")] == [0.5, 0.5]
    rank0, rank1 = (torch.load(tmp_path / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1))
    initial, _ = load_policy("tiny-llama", config_overrides=MODEL_CONFIG, seed=0)
    assert any(not torch.equal(rank0[k], v) for k, v in initial.state_dict().items())  # it learned
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case",
    [
        "a validation batch smaller than the world",
        "a sampled validation batch smaller than the world",
        "dynamic sampling refills on rank 0",
    ],
)
def test_fsdp2_ranks_with_nothing_to_sample_generate_with_the_others(tmp_path, case):
    """Under FSDP2 every forward gathers the parameters from all ranks, so sampling is a collective too
    (``synced_gpus``). Before, a rank with no rows of a validation batch (3 held-out prompts in batches of 2 over 2
    ranks) skipped it, and a rank whose dynamic sampling was done skipped the other's refill rounds: the other rank
    waited in its first forward for good. Now such a rank generates one unused token alongside."""
    if "validation" in case:
        extra = ["--data.num_val", "3", "--data.val_batch_size", "2"]
        extra += ["--model.validation.num_generations", "2"] if "sampled" in case else []
    else:  # rank 0: every group flat, refilled up to 3 rounds; rank 1 keeps its groups at once
        extra = ["--model.generation.dynamic_sampling", "true", "--model.generation.max_sampling_rounds", "3"]
        extra += ["--model.rewards", "[{class_path: fault_helpers.ConstantOnRank0}]"]
    # the CLI's own engine: dist_run.py's samples each prompt apart (a generate per prompt, not per rollout)
    cmd = [
        sys.executable,
        "-m",
        "lit_gspo.tools.main",
        "fit",
        *run_args(tmp_path, *FSDP2, *extra, prompts=2, devices=2),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ddp_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(next(tmp_path.glob("**/metrics.csv"))) as fh:
        rows = list(csv.DictReader(fh))
    keys = (
        "val/reward",
        "train/loss",
        "train/sampling_rounds",
        "train/frac_zero_std_groups",
        "train/reward_all_groups",
        "train/rewards/constant_on_rank0/mean",
        "train/rewards/constant_on_rank0/std",
    )
    logged = {key: [float(r[key]) for r in rows if r.get(key)] for key in keys}
    assert len(logged["val/reward"]) == 3 and len(logged["train/loss"]) == 2
    if "validation" not in case:
        assert logged["train/sampling_rounds"] == [3.0, 3.0]  # rank 0's (the max over ranks)
        # over every group sampled: rank 0's 3 rounds × 2 groups all flat (rewards 0), rank 1's 2 groups with a
        # spread (0, 1, 0, 1); a mean of the ranks' means would say 0.5 and 0.25
        assert logged["train/frac_zero_std_groups"] == [0.75, 0.75]
        assert logged["train/reward_all_groups"] == [0.125, 0.125]
        # the function's mean and std over the same 32 samples (24 zeros, then 0, 1, 0, 1, ...: 4 ones); before, the
        # mean of the ranks' first-round means (0.25)
        assert logged["train/rewards/constant_on_rank0/mean"] == [0.125, 0.125]
        std = math.sqrt((4 * 0.875**2 + 28 * 0.125**2) / 31)
        assert logged["train/rewards/constant_on_rank0/std"] == pytest.approx([std, std])
