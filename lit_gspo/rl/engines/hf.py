"""Sampling with transformers' ``model.generate``."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor, LogitsProcessorList

from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.fast_generate import filter_logits, sample_tokens


class HFGenerate(RolloutEngine):
    """``policy.generate`` on every prompt repeated G times (the default engine; works under FSDP2 with
    ``synced_gpus``). The sampler's log-probs come from the processed scores (after temperature, top-k, top-p)."""

    def generate(
        self, policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs
    ) -> tuple[Tensor, Tensor | None]:
        return generate_with_hf(policy, input_ids, attention_mask, generator=self.generator(input_ids.device), **kwargs)


def generate_with_hf(
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
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:meth:`RolloutEngine.generate` with ``policy.generate``; with a ``generator``, sampled from it
    (:class:`DrawFrom`: transformers' own sampling draws from torch's default stream only)."""
    draw = DrawFrom(generator, sampling) if generator is not None and sampling else None
    out = policy.generate(
        input_ids=input_ids.repeat_interleave(num_generations, 0),
        attention_mask=attention_mask.repeat_interleave(num_generations, 0),
        max_new_tokens=max_new_tokens,
        do_sample=bool(sampling) and draw is None,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        synced_gpus=synced_gpus,
        output_scores=return_logprobs and draw is None,
        return_dict_in_generate=return_logprobs,
        **({"logits_processor": LogitsProcessorList([draw])} if draw is not None else sampling),
    )
    if not return_logprobs:
        return out, None
    tokens = out.sequences[:, input_ids.shape[1] :]  # (N·G, T)
    if draw is not None:
        return out.sequences, torch.stack(draw.logprobs, 1)
    scores = torch.stack(out.scores, 1).float()  # (N·G, T, V): what was sampled from, step by step
    return out.sequences, scores.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


class DrawFrom(LogitsProcessor):
    """Draws each next token from ``generator`` — temperature, top-k, top-p (:func:`filter_logits`, the order of
    transformers' warpers), then the inverse CDF (:func:`sample_tokens`) — and returns scores whose argmax is it, so
    that greedy decoding emits it. Keeps the drawn tokens' log-probs under the distribution they were drawn from."""

    def __init__(self, generator: torch.Generator, sampling: dict):
        self.generator, self.sampling = generator, sampling
        self.logprobs: list[Tensor] = []  # (rows,) per decoding step

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        logits = filter_logits(scores, **self.sampling)
        chosen = sample_tokens(logits.softmax(-1), self.generator)
        self.logprobs.append(logits.log_softmax(-1).gather(-1, chosen[:, None]).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(-1, chosen[:, None], 0.0)
