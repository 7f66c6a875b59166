"""The CUDA path (``pytest -m cuda``; every test here is skipped where torch sees no GPU, never failed).

On the GPU: the engines' log-probs (StaticCacheSampler compiled, with CUDA graphs) are the trainer's in fp32; under
bf16 autocast the LM head (bf16x3 on CUDA), log-probs and ratios stay fp32 and an on-policy GSPO step is finite with a
ratio of exactly 1; lean norms and activations give the plain modules' gradients; the compiled step follows in-place weight updates without recompiling; fused AdamW steps as the
plain one; bitsandbytes' 8-bit AdamW keeps uint8 state; a fit in bf16-mixed, one process and under FSDP2
(``ModelParallelStrategy``, one process: NCCL) with AdamW and AdamW8bit, trains and logs finite losses.

``LIT_GSPO_CUDA_TESTS_ON=cpu pytest -m cuda tests/test_cuda.py`` runs the same code on CPU (a dry run of the
tests themselves; the FSDP2 fit then uses gloo). ``benchmarks/gpu_check.py`` is the end-to-end check with speeds.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gspo.models import load_policy
from lit_gspo.models.cast_parameters import CastParameters
from lit_gspo.models.lean_activations import LeanActivations
from lit_gspo.rl.advantages import GroupNormalized
from lit_gspo.rl.config import Update
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.lm_head import chunk_logprobs_and_entropy, head_precision, head_weights
from lit_gspo.rl.objectives import GSPO
from lit_gspo.rl.rollout import position_ids_of, token_logprobs
from lit_gspo.runtime.optim import state_dtypes

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
PAD, EOS = 0, 1  # conftest.py's tiny model
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]


@pytest.fixture
def gpu_model(model, cuda_device):
    return copy.deepcopy(model).to(cuda_device)


def sample(engine, model, seed=0, **kwargs):
    torch.manual_seed(seed)
    return engine.sample(model, PROMPTS, num_generations=3, max_new_tokens=8, pad_id=PAD, eos_id=EOS, **kwargs)


@pytest.mark.parametrize("engine", [HFGenerate, LeanSampler, StaticCacheSampler], ids=["hf", "lean", "static"])
def test_engine_logprobs_are_the_trainers_on_the_device_in_fp32(gpu_model, cuda_device, engine):
    """StaticCacheSampler as the device runs it by default: compiled, CUDA graphs (eager in the CPU dry run)."""
    engine = engine()
    batch = sample(engine, gpu_model, temperature=0.7, return_logprobs=True)
    assert batch.input_ids.device.type == cuda_device.type and batch.engine_logprobs.dtype == torch.float32
    with torch.no_grad():
        trainer = token_logprobs(gpu_model, batch, temperature=0.7).logprobs
    mask = batch.completion_mask
    # the sampler's KV-cached steps and the trainer's full-sequence forward: other kernels, the same fp32 math
    torch.testing.assert_close(batch.engine_logprobs[mask], trainer[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", [LeanSampler, StaticCacheSampler], ids=["lean", "static"])
def test_the_engines_agree_with_generate_on_greedy_tokens_on_the_device_in_fp32(gpu_model, engine):
    hf = sample(HFGenerate(), gpu_model, greedy=True, return_logprobs=True)
    ours = sample(engine(), gpu_model, greedy=True, return_logprobs=True)
    assert torch.equal(hf.input_ids, ours.input_ids) and torch.equal(hf.completion_mask, ours.completion_mask)
    torch.testing.assert_close(hf.engine_logprobs, ours.engine_logprobs, atol=1e-4, rtol=0)


def test_under_bf16_autocast_the_lm_head_and_the_logprobs_stay_fp32(gpu_model, cuda_device):
    """On CUDA the head runs as bf16x3 (three bf16 GEMMs with fp32 output: lit_gspo/rl/lm_head.py), the CPU dry run as
    one fp32 GEMM; either way the log-probs are the fp32 head's to fp32-class precision, and a bf16 head's are not."""
    batch = sample(HFGenerate(), gpu_model)
    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    with torch.no_grad(), torch.autocast(cuda_device.type, dtype=torch.bfloat16):
        assert head_precision(cuda_device) == ("bf16x3" if cuda_device.type == "cuda" else "fp32")
        logprobs = token_logprobs(gpu_model, batch).logprobs
        hidden = gpu_model.get_decoder()(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_of(batch.attention_mask),
        ).last_hidden_state
        hidden = hidden[:, P - 1 : P - 1 + T]
        bf16_head = F.linear(hidden, gpu_model.get_output_embeddings().weight).float().log_softmax(-1)
    weight = gpu_model.get_output_embeddings().weight
    fp32_head = F.linear(hidden.float(), weight.float()).log_softmax(-1)  # outside autocast: fp32
    targets = batch.input_ids[:, P : P + T, None]
    mask = batch.completion_mask
    assert logprobs.dtype == torch.float32
    # the decoder ran in bf16 (as Lightning's bf16-mixed runs it), the head on its output at fp32 precision
    ours = (logprobs - fp32_head.gather(-1, targets).squeeze(-1))[mask].abs().max()
    bf16 = (bf16_head.gather(-1, targets).squeeze(-1) - fp32_head.gather(-1, targets).squeeze(-1))[mask].abs().max()
    assert ours <= 1e-4 and bf16 > 1e-5 and ours < bf16 / 10, (float(ours), float(bf16))


def test_the_entropy_bonus_differentiates_the_entropy_through_the_bf16x3_head(gpu_model, cuda_device):
    """``update.entropy_coef``'s path: under bf16 autocast the head's entropy is the fp32 head's to fp32-class
    precision and its gradient to the decoder state the fp32 one's to bf16 precision (the backward's GEMM is bf16)."""
    torch.manual_seed(0)
    head = gpu_model.get_output_embeddings()
    hidden = torch.randn(2, 5, head.weight.shape[1], device=cuda_device)
    targets = torch.randint(0, head.weight.shape[0], (2, 5), device=cuda_device)
    ours = hidden.clone().requires_grad_()
    with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
        _, entropy = chunk_logprobs_and_entropy(ours, targets, head_weights(head), 1.0, True, entropy_grad=True)
    entropy.sum().backward()
    plain = hidden.clone().requires_grad_()
    log_softmax = F.linear(plain, head.weight.float()).log_softmax(-1)
    plain_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    plain_entropy.sum().backward()
    assert entropy.dtype == torch.float32 and (entropy - plain_entropy).abs().max() <= 1e-4
    assert (ours.grad - plain.grad).norm() <= 2e-2 * plain.grad.norm()


@pytest.mark.parametrize("param_dtype", [None, "bf16"], ids=["autocast", "bf16-casts"])
def test_lean_norms_and_activations_give_the_plain_gradients_on_the_device(cuda_device, param_dtype):
    """``update.lean_activations`` under bf16 autocast (and on bf16 casts) on the device: Qwen3's norms (its q/k norms
    too) and SwiGLUs lean, every parameter's gradient the plain modules' (bit for bit on the CPU; here within what a
    kernel's reordering could change, 1e-6 of the largest entry)."""
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = Qwen3Config(vocab_size=300, num_hidden_layers=2, attn_implementation="eager", **shape)
    model = Qwen3ForCausalLM(config).to(cuda_device)
    ids = (torch.arange(2 * 24, device=cuda_device).reshape(2, 24) * 37) % 300
    grads = []
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        cast = CastParameters(torch.bfloat16).active(model) if param_dtype else contextlib.nullcontext()
        with LeanActivations().active(model) if lean else contextlib.nullcontext(0) as count, cast:
            with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            logits.float().log_softmax(-1)[..., 7].sum().backward()
        grads.append({name: p.grad.float() for name, p in model.named_parameters()})
    assert count["rmsnorm"] + count["swiglu"] == 2 * 5 + 1 and count["linear"] == 2 * 7 + 1
    for name, plain in grads[0].items():
        assert (grads[1][name] - plain).abs().max() <= 1e-6 * plain.abs().max(), name


def test_the_compiled_static_cache_step_samples_with_the_weights_of_the_moment(gpu_model, cuda_device):
    """StaticCacheSampler as it runs on the GPU (compiled: CUDA graphs there; inductor on the CPU dry run) under bf16
    autocast, across what an RL step does between two rollouts (an in-place optimiser step that moves the log-probs
    far more than bf16 does, validation under inference mode): the log-probs it reports are the trainer's for the
    weights of the moment, not those its graph was captured with, and nothing compiles again."""
    policy, engine = copy.deepcopy(gpu_model), StaticCacheSampler(compile=True)

    def trainer_logprobs(batch):
        with torch.no_grad(), torch.autocast(cuda_device.type, dtype=torch.bfloat16):
            return token_logprobs(policy, batch).logprobs

    try:
        for step in range(3):
            with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
                batch = sample(engine, policy, seed=step, return_logprobs=True)
            mask = batch.completion_mask
            before = trainer_logprobs(batch)
            assert (batch.engine_logprobs - before)[mask].abs().max() < 0.05, f"rollout {step}"
            with torch.no_grad():
                for p in policy.parameters():  # an optimiser step: new values in the same tensors
                    p.add_(torch.randn_like(p) * p.abs().mean())
            assert (trainer_logprobs(batch) - before)[mask].abs().max() > 0.3  # stale weights would show
            with torch.inference_mode(), torch.autocast(cuda_device.type, dtype=torch.bfloat16):
                sample(engine, policy, greedy=True)  # validation's call: the greedy step
            if step == 0:  # each step (sampled, greedy) compiled once
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_compiled_draw_at_a_real_vocabulary_draws_the_eager_tokens(cuda_device, top_p):
    """The decoding step's draw compiled at a real model's shape (64 rows × SmolLM2's 49,152 tokens): inductor split
    such a cumsum into a scan whose code generation failed on the H100 (torch 2.11), so StaticCacheSampler, the CUDA
    default, could not sample a Qwen3-0.6B-shaped model. It compiles, and draws the tokens the eager step draws."""
    from lit_gspo.rl.engines.static_cache import next_tokens

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49_152, generator=gen) * 3).to(cuda_device)
    uniform, finished = (
        torch.rand(64, generator=gen).to(cuda_device),
        torch.zeros(64, dtype=torch.bool, device=cuda_device),
    )
    eos = torch.tensor([EOS], device=cuda_device)
    sampling = {"temperature": torch.tensor(0.7, device=cuda_device), "top_p": top_p}
    eager = next_tokens(logits, finished, eos, PAD, uniform, sampling)
    compiled = torch.compile(next_tokens, fullgraph=True)(logits, finished, eos, PAD, uniform, sampling)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-4)


def test_one_engine_samples_on_the_device_then_on_the_cpu_after_lightnings_teardown(gpu_model, cuda_device):
    """Lightning's teardown moves a fitted policy back to the CPU; the engine's precast weights and caches follow it."""
    policy, engine = copy.deepcopy(gpu_model), StaticCacheSampler(compile=False)
    with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
        on_device = sample(engine, policy, greedy=True)
    policy.cpu()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on_cpu = sample(engine, policy, greedy=True)
    assert on_device.input_ids.device.type == cuda_device.type and on_cpu.input_ids.device.type == "cpu"
    assert engine.precast.key[1] == torch.device("cpu")  # (dtype, device, every parameter)


def policy_and_rollout(device: torch.device):
    """tiny-llama on ``device`` and 3 prompts × 4 completions it sampled under bf16 autocast, with rewards spread within
    every group."""
    policy, tokenizer = load_policy("tiny-llama", seed=0)
    policy.to(device)
    prompts = [tokenizer(p)["input_ids"] for p in ("rev 123=", "rev 4567=", "rev 89=")]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        torch.manual_seed(0)
        rollout = LeanSampler().sample(
            policy,
            prompts,
            num_generations=4,
            max_new_tokens=6,
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
        )
    rollout = rollout.trimmed()
    rollout.rewards = torch.arange(len(rollout), dtype=torch.float32) % 3
    return policy, rollout


@pytest.mark.parametrize("param_dtype", [None, "bf16"], ids=["fp32-params", "bf16-casts"])
def test_an_on_policy_gspo_step_under_bf16_autocast_is_finite_with_a_ratio_of_one(cuda_device, param_dtype):
    policy, rollout = policy_and_rollout(cuda_device)
    with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
        learner = Learner(policy, GSPO(), Update(param_dtype=param_dtype), max_len=6, group_size=4)
        learner.snapshot(rollout)
        rollout.advantages = GroupNormalized()(rollout, 4)
        before = [p.detach().clone() for p in policy.parameters()]
        metrics = learner.learn(rollout, torch.optim.AdamW(policy.parameters(), lr=1e-3, fused=True))
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["nonfinite_steps"] == 0
    assert metrics["clip_frac"] == 0.0  # on-policy: the ratio is exactly 1 whatever the precision of the forward
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))


class DeviceWaits:
    """``with DeviceWaits(device) as waits:`` records, in order, ``"wait"`` for every time the host waits for the device
    and the names given to ``waits.mark``. On CUDA its sync debug mode says when (a value read, a value-dependent size,
    a copy either way that is not ``non_blocking``); the CPU dry run sees the value reads only (its dispatch mode)."""

    def __init__(self, device: torch.device):
        self.device, self.events = device, []

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":  # in order with the sync warnings
            warnings.warn(f"MARK {name}", stacklevel=2)
        else:
            self.events.append(name)

    def __enter__(self):
        if self.device.type == "cuda":
            self.caught = warnings.catch_warnings(record=True)
            self.records = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            from test_host_reads import Timeline

            self.timeline = Timeline()
            self.timeline.events = self.events
            self.timeline.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self.caught.__exit__(*exc)
            messages = [str(w.message) for w in self.records]
            self.events[:] = [
                m[5:] if m.startswith("MARK ") else "wait" for m in messages if "MARK " in m or "synchroniz" in m
            ]
        else:
            self.timeline.__exit__(*exc)
        return False


@pytest.mark.parametrize(
    "align, param_dtype", [(False, None), (True, None), (True, "bf16")], ids=["padded", "aligned", "aligned-bf16-casts"]
)
def test_an_update_waits_for_the_device_once_between_a_forward_and_its_backward(cuda_device, align, param_dtype):
    """A micro-step's metrics and loss stay on the device until they are read together, and rows chosen on the host
    reach the device without a wait (issue 36): between a forward and its backward the host waits once, for the
    objective's check of its inputs (and casting the parameters once per step adds no wait)."""
    from test_host_reads import reads_between_forward_and_backward

    policy, rollout = policy_and_rollout(cuda_device)
    with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
        update = Update(
            num_minibatches=2,
            micro_batch_size=3,
            align_rows=align,
            skip_zero_advantage_rows=False,
            param_dtype=param_dtype,
        )
        learner = Learner(policy, GSPO(), update, max_len=6, group_size=4)
        learner.snapshot(rollout)
        rollout.advantages = GroupNormalized()(rollout, 4)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        with DeviceWaits(cuda_device) as waits:
            policy.register_forward_hook(lambda *_: waits.mark("forward"))

            def backward(loss):
                waits.mark("backward")
                loss.backward()

            metrics = learner.learn(rollout, optimizer, backward=backward)
    # 2 minibatches of 6 rows, 2 micro-batches of 3 each
    assert reads_between_forward_and_backward(waits.events) == [1, 1, 1, 1], waits.events
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["entropy"])


def test_aligned_rows_under_bf16_autocast_are_as_close_to_fp32_as_padded_ones(cuda_device):
    """``update.align_rows`` (on by default on a GPU in bf16): each row's tokens first and no mask, which on CUDA runs
    sdpa's causal kernel on the grouped key-value heads as they are; its log-probs are as near the fp32 forward's as
    the padded forward's (a mask-free kernel that let a row see another's padding would be far off)."""
    from test_packing import rollout as sample_rows
    from test_packing import tiny_qwen3

    policy = tiny_qwen3().to(cuda_device)
    policy.set_attn_implementation("sdpa")
    batch = sample_rows(policy)
    mask = batch.completion_mask
    with torch.no_grad():
        fp32 = token_logprobs(policy, batch).logprobs
        with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
            padded = token_logprobs(policy, batch).logprobs
            aligned = token_logprobs(policy, batch, align=True).logprobs
    padded_error = float((padded - fp32)[mask].abs().max())
    aligned_error = float((aligned - fp32)[mask].abs().max())
    assert aligned_error <= 2 * padded_error + 1e-3, (aligned_error, padded_error)


def test_fused_adamw_steps_as_the_plain_one_on_the_device(cuda_device):
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32)]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for fused in (True, False):
        ps = [torch.nn.Parameter(p.clone().to(cuda_device)) for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=fused)
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.to(cuda_device)
            opt.step()
        results.append(ps)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_adamw8bit_keeps_uint8_state_on_the_device(cuda_device):
    bnb = pytest.importorskip("bitsandbytes")
    big = torch.nn.Parameter(torch.randn(64, 128, device=cuda_device))  # ≥ 4096 elements: 8-bit state
    small = torch.nn.Parameter(torch.randn(16, device=cuda_device))  # fewer: fp32 state (bitsandbytes' rule)
    opt = bnb.optim.AdamW8bit([big, small], lr=1e-3)
    before = big.detach().clone()
    for p in (big, small):
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[big]["state1"].dtype == torch.uint8 and opt.state[big]["state2"].dtype == torch.uint8
    assert opt.state[small]["state1"].dtype == torch.float32
    assert opt.state[big]["state1"].device.type == cuda_device.type
    assert {torch.uint8, torch.float32} <= state_dtypes(opt)["state1"]
    assert not torch.equal(before, big.detach()) and torch.isfinite(big).all()


FIT = """
import json, math, sys, torch
import lightning as L
from lit_gspo import CharAccuracy, Generation, Policy, PromptDataModule, RLModule, Update
from lit_gspo.rl.engines import LeanSampler, StaticCacheSampler
from lit_gspo.runtime.optim import state_dtypes

device, strategy, optimizer, root = sys.argv[1:5]
lr = 1e-3
make = (lambda p: torch.optim.AdamW(p, lr=lr, fused=True)) if optimizer == "AdamW" else None
if optimizer == "AdamW8bit":
    import bitsandbytes as bnb
    make = lambda p: bnb.optim.AdamW8bit(p, lr=lr)
L.seed_everything(0)
model = RLModule(policy=Policy("tiny-llama", config={"hidden_size": 128, "intermediate_size": 256}), rewards=[CharAccuracy()],
                 optimizer=make, generation=Generation(num_generations=4, max_new_tokens=4),
                 update=Update(num_minibatches=2),
                 # CUDA's default (also on CPU); the 8-bit fits sample with the lean sampler: on the GPU each fit that
                 # compiles the static-cache step (greedy for validation, sampled for training) takes ~1 minute
                 engine=StaticCacheSampler() if optimizer == "AdamW" else LeanSampler())
data = PromptDataModule(train_source="reversal", task_kwargs={"min_length": 3, "max_length": 3}, num_train=64, num_val=4,
                        prompts_per_step=4, seed=0)
if strategy == "fsdp2":
    from lightning.pytorch.strategies import ModelParallelStrategy
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
losses, devices = [], set()
class Probe(L.Callback):  # the device during the fit: Lightning's teardown moves the module back to the CPU after it
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        losses.append(float(trainer.callback_metrics["train/loss"]))
        devices.add(next(module.policy.parameters()).device.type)
trainer = L.Trainer(accelerator=device, devices=1, strategy=strategy, precision="bf16-mixed", max_steps=4, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=root, callbacks=[Probe()])
trainer.validate(model, datamodule=data, verbose=False)  # as `lit-gspo fit`: under Lightning's inference mode first
trainer.fit(model, datamodule=data)
opt = trainer.optimizers[0]
opt = getattr(opt, "optimizer", opt)
print("RESULT " + json.dumps({"losses": losses, "devices": sorted(devices),
                             "state1": sorted(str(d) for d in state_dtypes(opt).get("state1", ())),
                             "nonfinite": float(trainer.callback_metrics["train/nonfinite_steps"])}))
"""


@pytest.mark.parametrize("strategy", ["auto", "fsdp2"])
@pytest.mark.parametrize("optimizer", ["AdamW", "AdamW8bit"])
def test_a_bf16_mixed_fit_on_the_device_trains_with_finite_losses(tmp_path, cuda_device, strategy, optimizer):
    """In a fresh process: a ModelParallelStrategy fit leaves a process group behind that later tests must not meet."""
    if optimizer == "AdamW8bit":
        pytest.importorskip("bitsandbytes")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", FIT, cuda_device.type, strategy, optimizer, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert out["devices"] == [cuda_device.type]
    assert (
        len(out["losses"]) == 4 and all(math.isfinite(v) for v in out["losses"]) and out["nonfinite"] == 0
    )  # max_steps: RL steps
    assert ("torch.uint8" in out["state1"]) == (optimizer == "AdamW8bit")
    assert (tmp_path / "hf_model" / "config.json").exists()


def test_the_readmes_gpu_command_fits_the_quickstart_on_the_device(tmp_path, cuda_device):
    """README's command as a user runs it on a GPU, in bf16: ``lit-gspo fit --config configs/quickstart.yaml
    --trainer.accelerator cuda --trainer.precision bf16-mixed`` (CUDA's default engine, StaticCacheSampler, compiled;
    validation first, as the quickstart does), cut to 4 RL steps: finite losses and rewards, the checkpoint written.
    The quickstart crashed on CUDA in the first H100 run; the device check's quickstart cases sample with LeanSampler."""
    import csv

    root = tmp_path / "quickstart"
    command = [sys.executable, "-m", "lit_gspo", "fit", "--config", "configs/quickstart.yaml"]
    command += ["--trainer.accelerator", cuda_device.type, "--trainer.precision", "bf16-mixed"]
    command += [
        "--trainer.max_steps",
        "4",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
    ]
    command += ["--model.validation.every_n_steps", "2", "--data.num_val", "16"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(sorted(root.glob("**/metrics.csv"))[-1]) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    rewards = [float(r["val/reward"]) for r in rows if r.get("val/reward")]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert len(rewards) >= 2 and all(0.0 <= v <= 1.0 for v in rewards)
    assert list(root.glob("**/checkpoints/last.ckpt"))


def test_a_k1_fit_on_the_device_samples_in_its_worker_with_finite_losses(tmp_path, cuda_device):
    """Asynchronous rollouts on the device (issue 38): ``async_worker: auto`` is the thread worker on an accelerator (a
    forked child cannot use CUDA), its copy of the policy on the device and bf16 autocast entered in its thread; the
    fit trains with finite losses, every step after the first on a batch one version old, and no worker is left."""
    import csv
    import threading

    from test_trainer import tiny_args

    from lit_gspo.lightning.async_rollouts import worker_kind
    from lit_gspo.tools.main import cli_main

    args = tiny_args(tmp_path, "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "4")
    args += ["--trainer.accelerator", cuda_device.type, "--trainer.precision", "bf16-mixed"]
    cli = cli_main([*args, "--model.generation.max_staleness", "1"], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert worker_kind(cli.model) == ("thread" if cuda_device.type == "cuda" else "process")
    with open(sorted(tmp_path.glob("**/metrics.csv"))[-1]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/staleness")]
    assert [float(r["train/staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(math.isfinite(float(r["train/loss"])) for r in rows if r.get("train/loss"))
    assert not [t for t in threading.enumerate() if t.name.startswith("lit-gspo-rollout-worker")]
