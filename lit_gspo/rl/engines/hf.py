"""Sampling with transformers' ``model.generate``."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.checkpoint_settings import empty_generation_config
from lit_gspo.rl.engines.fast_generate import WARPERS, filter_logits, penalize_repeats, sample_tokens, tokens_seen
from lit_gspo.rl.stop_strings import StopStrings


class HFGenerate(RolloutEngine):
    """``policy.generate`` on every prompt repeated G times (the default engine; works under FSDP2 with
    ``synced_gpus``). The sampler's log-probs come from the processed scores (after temperature, top-k, top-p)."""

    def generate(
        self, policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs
    ) -> tuple[Tensor, Tensor | None]:
        generator = self.generator(input_ids.device)
        return generate_with_hf(policy, input_ids, attention_mask, generator=generator, stop=self.stopping, **kwargs)


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
    stop: StopStrings | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:meth:`RolloutEngine.generate` with ``policy.generate``; with a ``generator``, sampled from it (transformers' own
    sampling draws from torch's default stream only); a row stops at a ``stop`` string too. The log-probs are kept a
    step at a time (:class:`InProcessor`), never as transformers' ``output_scores``."""
    draws = generator is not None and bool(sampling)
    # the warpers in the processor, none of transformers' (1.0 and 0 add none); so the penalty too, whose transformers
    # processor would count the prompts' left padding as tokens seen
    if draws or return_logprobs or "repetition_penalty" in sampling:
        prompt_mask = attention_mask.repeat_interleave(num_generations, 0).bool()
        processor = InProcessor(sampling, generator if draws else None, prompt_mask)
        sampler_args = {"do_sample": bool(sampling) and not draws, **NO_WARPERS}
    else:
        processor, sampler_args = None, {"do_sample": bool(sampling), **sampling}
    with empty_generation_config(policy):  # the checkpoint's sampling settings never apply (checkpoint_settings.py)
        sequences = policy.generate(
            input_ids=input_ids.repeat_interleave(num_generations, 0),
            attention_mask=attention_mask.repeat_interleave(num_generations, 0),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=eos_id if eos_id != [] else None,
            synced_gpus=synced_gpus,
            logits_processor=LogitsProcessorList([processor] if processor is not None else []),
            stopping_criteria=StoppingCriteriaList([StringWritten(stop, input_ids.shape[1])] if stop else []),
            **sampler_args,
        )
    if not return_logprobs:
        return sequences, None
    return sequences, processor.drawn_logprobs(sequences)


#: sampling settings under which transformers adds no warper of its own (a model's generation_config may hold others)
NO_WARPERS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


class InProcessor(LogitsProcessor):
    """The repetition penalty (over the prompt's tokens, not its padding, and the reply's), then temperature, top-k,
    top-p and min-p applied in a logits processor (:func:`filter_logits`, bit for bit transformers' warpers, which
    transformers adds after the processors it is given), and with a ``generator`` the draw too: the
    inverse CDF (:func:`sample_tokens`, as the lean sampler draws), returned as scores whose argmax is the drawn token
    so that greedy decoding emits it. Keeps each drawn token's log-prob under the filtered distribution: one step's
    (rows, vocabulary) log-softmax at a time, read at the next call, whose ``input_ids`` end with the token drawn from
    it — not ``output_scores``' stack of every step (rows × T × vocabulary in fp32: 10 GB for 64 rows × 256 tokens of
    a 152k vocabulary)."""

    def __init__(self, sampling: dict, generator: torch.Generator | None = None, prompt_mask: Tensor | None = None):
        self.sampling, self.generator, self.previous = sampling, generator, None
        self.prompt_mask = prompt_mask  # (rows, P): the prompts' tokens that are not left padding
        self.seen: Tensor | None = None  # (rows, vocabulary): the tokens each row holds, for the repetition penalty
        self.logprobs: list[Tensor] = []  # (rows,) per decoding step

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._keep(input_ids[:, -1])
        if "repetition_penalty" in self.sampling:
            if self.seen is None:  # the first step: input_ids are the prompts
                self.seen = tokens_seen(input_ids, self.prompt_mask, scores.shape[-1])
            else:  # each later step: the token drawn at the one before
                self.seen.scatter_(1, input_ids[:, -1:], True)
            scores = penalize_repeats(scores.float(), self.seen, self.sampling["repetition_penalty"])
        logits = filter_logits(scores, **{key: self.sampling[key] for key in WARPERS if key in self.sampling})
        self.previous = logits.log_softmax(-1)
        if self.generator is None:
            return logits  # transformers draws from them
        chosen = sample_tokens(logits.softmax(-1), self.generator)
        return torch.full_like(scores, float("-inf")).scatter_(-1, chosen[:, None], 0.0)

    def _keep(self, drawn: Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, drawn[:, None]).squeeze(1))
            self.previous = None

    def drawn_logprobs(self, sequences: Tensor) -> Tensor:
        """(rows, T): the log-probs of the tokens drawn (the last one is the last of ``sequences``)."""
        self._keep(sequences[:, -1])
        return torch.stack(self.logprobs, 1)


class StringWritten(StoppingCriteria):
    """A row is done once its reply (the tokens after the ``prompt_length`` of the prompts) writes a stop string."""

    def __init__(self, stop: StopStrings, prompt_length: int):
        self.stop, self.prompt_length = stop, prompt_length

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        return self.stop.written(input_ids[:, self.prompt_length :])
