"""The RolloutEngine protocol: token ids of prompts in, sampled completions (and the sampler's log-probs) out."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn

from lit_gspo.models.cast_parameters import CastParameters
from lit_gspo.rl.engines.fast_generate import ATTENTION_IMPLEMENTATIONS, attention_implementation, weights_cast_once
from lit_gspo.rl.rollout import RolloutBatch, completion_mask_through_eos, left_pad
from lit_gspo.rl.stop_strings import StopStrings
from lit_gspo.runtime.sharding import is_sharded


class RolloutEngine:
    """Samples ``num_generations`` completions per prompt; picked by class path (``--model.engine LeanSampler``).

    A subclass implements :meth:`generate` on left-padded prompt tensors; :meth:`sample` does the rest
    (padding, eval mode, the attention kernel while sampling, masks through the first EOS, the batch
    layout). Engines that keep their own copy of the weights (a server, another process) refresh it in
    :meth:`sync_weights`, which the trainer calls before every rollout; the built-ins sample from the
    policy module itself, so theirs does nothing. Every random draw goes through :meth:`generator` (torch's
    default stream unless the engine was given its own, as the async rollouts' worker gives its copy).

    Args:
        attn_implementation: the attention kernel while sampling (``eager``, ``sdpa``, ``lit_gqa_eager``:
            eager without copying K, V per query head, ...); None keeps the model's. The update's forward
            always uses the model's own kernel, and the trainer's log-probs come only from that forward.
    """

    #: seconds the last :meth:`sync_weights` spent pushing weights; None when it pushed nothing (logged as
    #: ``time/weight_sync_s`` when set)
    last_sync_s: float | None = None

    #: whether :meth:`generate` samples under sharded parameters (``synced_gpus``); where it does not, :meth:`sample`
    #: uses transformers' ``generate`` there, whose synchronised loop keeps ranks that finish early in step
    samples_sharded: bool = True

    #: ``update.param_dtype`` during a sampling call, for an engine that casts or pushes the weights itself
    #: (:meth:`reading_in`); None outside one, or without it
    reading_dtype: torch.dtype | None = None

    #: the seed of the engine's own random stream (:meth:`own_random_stream`); None: it draws from torch's default one
    random_seed: int | None = None

    #: the stop strings of the current sampling call (None outside one, or without them); every engine's replies are
    #: cut at them after :meth:`generate`, and an engine that can stop a row there while sampling reads them
    stopping: StopStrings | None = None

    def __init__(self, attn_implementation: str | None = None):
        if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {attn_implementation!r}"
            )
        self.attn_implementation = attn_implementation

    def __repr__(self) -> str:
        return f"{type(self).__name__}(attn_implementation={self.attn_implementation!r})"

    def own_random_stream(self, seed: int | None) -> None:
        """From now on draw every sample from generators of this engine's own, seeded with ``seed`` (one per device),
        not from torch's default stream (None: from the default stream again). The thread rollout worker's engine does:
        the trainer's thread draws from the default stream too (data loaders, shuffles, a user's callback), at moments
        no one controls, and a shared stream would make what the worker samples depend on that timing."""
        self.random_seed, self._generators = seed, {}

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """Where the engine's random draws on ``device`` come from: its own stream's generator there, or None
        (torch's default stream, as :func:`torch.rand` without one). An engine passes it to every draw it makes."""
        if self.random_seed is None:
            return None
        device, generators = torch.device(device), self.__dict__.setdefault("_generators", {})
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(self.random_seed)
        return generators[device]

    def sync_weights(self, policy: nn.Module) -> None:
        """Make the engine sample from ``policy``'s current weights (nothing to do for the built-ins)."""

    def parameters_in(self, policy: nn.Module, dtype: torch.dtype | None):
        """The context :meth:`generate` runs in for ``param_dtype``: the built-ins read the policy's modules, whose
        floating parameters are casts in ``dtype`` there (not under FSDP2, where the update reads them as they are too).
        An engine that keeps its own weights, or casts them itself, returns :meth:`reading_in` and reads
        :attr:`reading_dtype`."""
        if dtype is None or is_sharded(policy):
            return nullcontext()
        return CastParameters(dtype).active(policy)

    @contextmanager
    def reading_in(self, dtype: torch.dtype | None):
        """:attr:`reading_dtype` is ``dtype`` while in this context (one sampling call)."""
        self.reading_dtype = dtype
        try:
            yield
        finally:
            self.reading_dtype = None

    def close(self) -> None:
        """Free what the engine holds beyond the policy (a server, a KV cache); the next rollout starts it again.
        Called when a fit ends or fails; nothing to do for the built-ins."""

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
        """Sample from left-padded prompts (N, P), each once in ``input_ids``.

        Returns (sequences, logprobs): sequences (N·G, P + T) group-major, the prompt then the completion
        (anything after a stop id is ignored); logprobs (N·G, T) fp32, the sampler's log-probability of each
        sampled token under the distribution it sampled from, or None (not asked for, or not available).
        ``sampling`` holds ``temperature``, ``top_p``, ``top_k`` (and ``min_p`` when > 0, ``repetition_penalty`` when
        not 1) — empty for greedy decoding. ``eos_id``: the ids a reply ends at, an int or a list (the collector passes
        its ``stop_ids``, lit_gspo.rl.stop_tokens).
        """
        raise NotImplementedError

    @torch.no_grad()
    def sample(
        self,
        policy: nn.Module,
        prompt_ids: list[list[int]],
        *,
        num_generations: int,
        max_new_tokens: int,
        pad_id: int,
        eos_id: int | list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        greedy: bool = False,
        synced_gpus: bool = False,
        return_logprobs: bool = False,
        param_dtype: torch.dtype | None = None,
        stop: StopStrings | None = None,
    ) -> RolloutBatch:
        """Completions of ``prompt_ids`` as a rollout batch: prompts left-padded to P, completions right-padded
        to T (columns no row uses trimmed), ``completion_mask`` 1 through the first EOS (or ``stop`` string), rows
        group-major. ``param_dtype``: the policy's floating parameters read in this dtype, cast once for the call
        (:meth:`parameters_in`), as the update reads them under ``update.param_dtype``."""
        ids, attn = left_pad(prompt_ids, pad_id)
        device = next(policy.parameters()).device
        ids, attn = ids.to(device), attn.to(device)
        was_training = policy.training
        policy.eval()  # gradient checkpointing disables the KV cache in train mode
        self.stopping = stop
        try:
            sampling = {} if greedy else dict(temperature=temperature, top_p=top_p, top_k=top_k)
            if sampling and min_p > 0.0:
                sampling["min_p"] = min_p
            if sampling and repetition_penalty != 1.0:
                sampling["repetition_penalty"] = repetition_penalty
            generate = self.generate
            if synced_gpus and not self.samples_sharded:
                from lit_gspo.rl.engines.hf import generate_with_hf

                warnings.warn(
                    f"{type(self).__name__} samples with transformers' generate under sharded parameters (synced_gpus)",
                    stacklevel=2,
                )
                generate = partial(generate_with_hf, generator=self.generator(device), stop=stop)
            with (
                attention_implementation(policy, self.attn_implementation),
                weights_cast_once(device.type),
                self.parameters_in(policy, param_dtype),
            ):
                out, logprobs = generate(
                    policy,
                    ids,
                    attn,
                    num_generations=num_generations,
                    max_new_tokens=max_new_tokens,
                    pad_id=pad_id,
                    eos_id=eos_id,
                    sampling=sampling,
                    synced_gpus=synced_gpus,
                    return_logprobs=return_logprobs,
                )
        finally:
            policy.train(was_training)
            self.stopping = None
        ids = ids.repeat_interleave(num_generations, 0)
        attn = attn.repeat_interleave(num_generations, 0)
        prompt_length = ids.shape[1]
        completions = out[:, prompt_length:]
        mask = completion_mask_through_eos(completions, eos_id)
        if stop is not None:
            mask = stop.cut(completions, mask)
        completions = completions.masked_fill(~mask, pad_id)
        used = int(mask.sum(1).max()) if mask.numel() else 0  # trim columns no row uses
        completions, mask = completions[:, :used], mask[:, :used]
        if logprobs is not None:
            logprobs = logprobs[:, :used].float().masked_fill(~mask, 0.0)
        return RolloutBatch(
            input_ids=torch.cat([ids, completions], 1),
            attention_mask=torch.cat([attn, mask.long()], 1),
            prompt_length=prompt_length,
            completion_mask=mask,
            engine_logprobs=logprobs,
        )
