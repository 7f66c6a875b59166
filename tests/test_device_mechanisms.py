"""The classes of CUDA bug the first GPU run showed (shared/gpu/2026-11-26-h100), seen on the CPU.

* A tensor made on the CPU reaching a module on the GPU: the policy goes to the ``meta`` device and
  ``tests/device_mixing.py`` refuses any op that mixes devices.
* A sharded module run under ``torch.inference_mode``: FSDP2 on one device keeps the unsharded parameters it made at
  its first forward, and as inference tensors they cannot be written in training. Lightning validates under inference
  mode; the policy must never run under it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from device_mixing import DeviceMixing, OneDevicePerOp, run_until_a_value_is_read
from lightning.pytorch import Callback
from transformers import LlamaConfig, LlamaForCausalLM

from lit_gspo.data.synthetic import make_task
from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.config import WarmStart
from lit_gspo.rl.rollout import RolloutBatch, left_pad, token_logprobs
from lit_gspo.rl.warm_start import warm_start

ROOT = Path(__file__).resolve().parents[1]


def meta_llama(vocab_size: int = 23) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def cpu_rollout() -> RolloutBatch:
    ids, attn = left_pad([[5, 6, 7], [3, 4]], pad_id=0)
    completion = torch.tensor([[8, 1], [9, 10]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    return RolloutBatch(
        input_ids=torch.cat([ids, completion], 1),
        attention_mask=torch.cat([attn, mask.long()], 1),
        prompt_length=ids.shape[1],
        completion_mask=mask,
        advantages=torch.tensor([1.0, -1.0]),
    )


def test_the_checker_refuses_a_cpu_index_into_a_meta_embedding():
    """CUDA refuses this; meta alone would not (it returns a meta tensor): the mode is what makes the test see it."""
    weight = torch.empty(10, 4, device="meta")
    with pytest.raises(DeviceMixing, match="embedding"), OneDevicePerOp():
        torch.nn.functional.embedding(torch.tensor([1, 2]), weight)


def test_token_logprobs_runs_a_cpu_batch_on_the_models_device():
    """A meta model's forward stops at transformers' mask (it reads the mask's values), after the embedding: the op
    that failed on CUDA when ids stayed on the CPU."""
    assert run_until_a_value_is_read(token_logprobs, meta_llama(), cpu_rollout()) in ("done", "stopped at a value")


def test_rollout_to_moves_every_tensor_and_is_itself_where_it_already_is():
    rollout = cpu_rollout()
    assert rollout.to("cpu") is rollout
    moved = rollout.to("meta")
    assert {
        t.device.type for t in (moved.input_ids, moved.attention_mask, moved.completion_mask, moved.advantages)
    } == {"meta"}
    assert rollout.input_ids.device.type == "cpu"  # the caller's batch is left as it was


def test_the_warm_start_computes_its_loss_on_the_policys_device(monkeypatch):
    """The quickstart crashed on CUDA in its warm start: the demonstrations stayed on the CPU. The forward is
    token_logprobs' (above); here it is a stand-in with the policy's device, so the loss itself is what runs."""
    import lit_gspo.rl.warm_start as module

    def forward_on_meta(policy, batch, **_):
        return type(
            "Forward", (), {"logprobs": torch.zeros(batch.completion_mask.shape, device="meta", requires_grad=True)}
        )

    monkeypatch.setattr(module, "token_logprobs", forward_on_meta)
    tokenizer = char_tokenizer()
    policy = meta_llama(vocab_size=len(tokenizer))
    rows = make_task("reversal", 8, seed=0)
    encode = lambda chosen: [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in chosen]
    outcome = run_until_a_value_is_read(
        warm_start, policy, tokenizer, rows, encode, WarmStart(steps=1, batch_size=2), seed=0
    )
    assert outcome == "stopped at a value"  # float(loss) of a meta policy: every op before it ran on one device


class NoInferenceMode(Callback):
    """Records whether the policy ever ran a forward under ``torch.inference_mode``."""

    def __init__(self):
        self.forwards, self.under_inference_mode, self.loop_in_inference_mode = 0, 0, False

    def setup(self, trainer, module, stage):
        def hook(*_):
            self.forwards += 1
            self.under_inference_mode += torch.is_inference_mode_enabled()

        module.policy.register_forward_pre_hook(hook)

    def on_validation_batch_start(self, *_):
        self.loop_in_inference_mode = torch.is_inference_mode_enabled()


def test_validation_never_runs_the_policy_under_inference_mode(tmp_path):
    """Lightning's validation loop runs under inference mode (one process: no gloo that would make it no_grad)."""
    from lit_gspo.lightning.cli import cli_main

    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--model.policy.warm_start.steps",
            "1",
            "--data.num_val",
            "4",
            "--model.generation.max_new_tokens",
            "3",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        run=False,
    )
    probe = NoInferenceMode()
    cli.trainer.callbacks.append(probe)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert probe.loop_in_inference_mode  # the condition: Lightning's loop is in inference mode
    assert probe.forwards > 0 and probe.under_inference_mode == 0


def test_validation_logs_its_synced_metrics_on_the_modules_device():
    """``log_dict(..., sync_dist=True)`` reduces with the process group's backend, and NCCL refuses CPU tensors ("No
    backend type associated with device type cpu": FSDP2 on one H200, 2026-11-26): every tensor validation logs is on
    the module's device (``meta`` here, as the GPU's stand-in)."""
    from types import SimpleNamespace

    from lit_gspo.lightning.validation import ValidationPass

    logged = []
    module = SimpleNamespace(
        device=torch.device("meta"),
        rl_step=3,
        collector=SimpleNamespace(environment=SimpleNamespace(max_turns=1), rewards=SimpleNamespace(names=["f"])),
        validation=SimpleNamespace(log_completions_every_n_steps=0, print_completions=False, num_generations=0),
        trainer=SimpleNamespace(sanity_checking=False, is_global_zero=True),
        loggers=[],
        log_dict=lambda values, **kwargs: logged.append((values, kwargs)),
    )
    validation = ValidationPass(module)
    validation.tally.sums[:3] = torch.tensor([2.0, 4.0, 12.0], dtype=torch.float64)
    validation.log("val")
    synced = [value for values, kwargs in logged if kwargs.get("sync_dist") for value in values.values()]
    tensors = [value for value in synced if isinstance(value, torch.Tensor)]
    assert tensors and all(t.device == module.device for t in tensors)
    assert all(isinstance(value, torch.Tensor | float) for value in synced)  # floats: Lightning puts them there
