"""The lean sampler: one prefill per prompt shared by its G completions, finished rows leave the KV cache."""

from __future__ import annotations

from torch import Tensor, nn

from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.fast_generate import fast_generate


class LeanSampler(RolloutEngine):
    """:func:`lit_gspo.rl.engines.fast_generate.fast_generate`: same greedy tokens as ``generate``, less work per token
    (shared prefill, a cache that shrinks as rows finish, last-position logits, CDF sampling).

    Under sharded parameters (``synced_gpus``) it samples with ``generate`` instead, whose
    synchronised loop keeps ranks that finish early in step with the others.
    """

    samples_sharded = False  # RolloutEngine.sample uses generate's synchronised loop there

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
        out = fast_generate(
            policy,
            input_ids,
            attention_mask,
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            do_sample=bool(sampling),
            return_logprobs=return_logprobs,
            generator=self.generator(input_ids.device),
            stop=self.stopping,
            **sampling,
        )
        return out if return_logprobs else (out, None)
