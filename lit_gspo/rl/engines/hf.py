"""Sampling with transformers' ``model.generate``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lit_gspo.rl.engines.base import RolloutEngine


class HFGenerate(RolloutEngine):
    """``policy.generate`` on every prompt repeated G times (the default engine; works under FSDP2 with
    ``synced_gpus``). The sampler's log-probs come from the processed scores (after temperature, top-k, top-p)."""

    def generate(
        self, policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs
    ) -> tuple[Tensor, Tensor | None]:
        return generate_with_hf(policy, input_ids, attention_mask, **kwargs)


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
) -> tuple[Tensor, Tensor | None]:
    """:meth:`RolloutEngine.generate` with ``policy.generate``."""
    out = policy.generate(
        input_ids=input_ids.repeat_interleave(num_generations, 0),
        attention_mask=attention_mask.repeat_interleave(num_generations, 0),
        max_new_tokens=max_new_tokens,
        do_sample=bool(sampling),
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        synced_gpus=synced_gpus,
        output_scores=return_logprobs,
        return_dict_in_generate=return_logprobs,
        **sampling,
    )
    if not return_logprobs:
        return out, None
    tokens = out.sequences[:, input_ids.shape[1] :]  # (N·G, T)
    scores = torch.stack(out.scores, 1).float()  # (N·G, T, V): what was sampled from, step by step
    return out.sequences, scores.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
