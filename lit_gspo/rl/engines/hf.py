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
    (:class:`DrawFrom`: transformers' own sampling draws from torch's default stream only). The log-probs are kept
    a step at a time (:class:`KeepLogprobs`), never as transformers' ``output_scores``."""
    if generator is not None and sampling:
        processor, sampler_args = DrawFrom(generator, sampling), {"do_sample": False}
    elif return_logprobs:  # the warpers in the processor, none of transformers' (1.0 and 0 add none)
        processor, sampler_args = KeepLogprobs(sampling), {"do_sample": bool(sampling), **NO_WARPERS}
    else:
        processor, sampler_args = None, {"do_sample": bool(sampling), **sampling}
    sequences = policy.generate(
        input_ids=input_ids.repeat_interleave(num_generations, 0),
        attention_mask=attention_mask.repeat_interleave(num_generations, 0),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        synced_gpus=synced_gpus,
        logits_processor=LogitsProcessorList([processor] if processor is not None else []),
        **sampler_args,
    )
    if not return_logprobs:
        return sequences, None
    return sequences, processor.drawn_logprobs(sequences)


#: sampling settings under which transformers adds no warper of its own (a model's generation_config may hold others)
NO_WARPERS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


class KeepLogprobs(LogitsProcessor):
    """Applies temperature, top-k and top-p itself (:func:`filter_logits`, bit for bit transformers' warpers, which
    transformers adds after the processors it is given) and keeps each drawn token's log-prob under them: one step's
    (rows, vocabulary) log-softmax at a time, read at the next call, whose ``input_ids`` end with the token drawn from
    it — not ``output_scores``' stack of every step (rows × T × vocabulary in fp32: 10 GB for 64 rows × 256 tokens of
    a 152k vocabulary)."""

    def __init__(self, sampling: dict):
        self.sampling, self.previous = sampling, None
        self.logprobs: list[Tensor] = []  # (rows,) per decoding step

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._keep(input_ids[:, -1])
        logits = filter_logits(scores, **self.sampling)
        self.previous = logits.log_softmax(-1)
        return logits

    def _keep(self, drawn: Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, drawn[:, None]).squeeze(1))
            self.previous = None

    def drawn_logprobs(self, sequences: Tensor) -> Tensor:
        """(rows, T): the log-probs of the tokens drawn (the last one is the last of ``sequences``)."""
        self._keep(sequences[:, -1])
        return torch.stack(self.logprobs, 1)


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

    def drawn_logprobs(self, sequences: Tensor) -> Tensor:
        return torch.stack(self.logprobs, 1)
