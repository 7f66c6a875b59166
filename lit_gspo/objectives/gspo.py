"""GSPO and GSPO-token (Zheng et al., 2025, "Group Sequence Policy Optimization")."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_gspo.objectives.base import Counts, LossOutput, Objective, aggregate, masked_mean, masked_sum


class GSPO(Objective):
    """Sequence-level importance ratio, clipped per sequence.

        s_i = exp( Σ_t m_t (logp_t − old_logp_t) / |y_i| )          (geometric mean of token ratios)
        ℓ_i = −min( s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i )
        loss = Σ_i ℓ_i / N_seqs                                      (every token of y_i weighs the same)

    Paper defaults: ε_low = 3e-4, ε_high = 4e-4. ``clip_frac`` counts every token of a clipped
    sequence, the quantity the paper compares with GRPO's token clip fraction.
    """

    name = "gspo"
    default_clip_low = 3e-4
    default_clip_high = 4e-4
    default_aggregation = "seq-mean-token-mean"

    def sequence_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        lengths = mask.sum(1).clamp(min=1)  # (B,)
        return torch.exp(masked_sum(logprobs - old_logprobs, mask, dim=1) / lengths)  # (B,)

    def importance_weight(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        """(B, T) weight whose value is s_i on every token of sequence i."""
        return self.sequence_ratio(logprobs, old_logprobs, mask)[:, None].expand_as(logprobs)

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    counts: Counts, **extra) -> LossOutput:
        ratio = self.importance_weight(logprobs, old_logprobs, mask)  # (B, T)
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        loss = -torch.minimum(ratio * advantages, clipped * advantages)  # (B, T)
        seq_ratio = ratio.detach()[:, 0] if ratio.shape[1] else torch.ones(ratio.shape[0])
        clipped_low = (advantages < 0) & (ratio < 1 - self.clip_low)
        clipped_high = (advantages > 0) & (ratio > 1 + self.clip_high)
        metrics = _sequence_metrics(seq_ratio, mask, clipped_low, clipped_high)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)


class GSPOToken(GSPO):
    """GSPO-token: the sequence ratio's value with each token's own gradient, for per-token Â_{i,t}.

        s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]
        ℓ_i = (1/|y_i|) Σ_t −min( s_{i,t} Â_{i,t}, clip(s_{i,t}, 1 − ε_low, 1 + ε_high) Â_{i,t} )

    With Â_{i,t} = Â_i it equals GSPO in value, clipping and gradient.
    """

    name = "gspo_token"

    def importance_weight(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        seq_ratio = self.sequence_ratio(logprobs, old_logprobs, mask).detach()  # (B,)
        return seq_ratio[:, None] * torch.exp(logprobs - logprobs.detach())  # (B, T), value s_i


def _sequence_metrics(seq_ratio: Tensor, mask: Tensor, clipped_low: Tensor, clipped_high: Tensor) -> dict[str, Tensor]:
    has_tokens = mask.any(1)
    ratios = seq_ratio[has_tokens] if has_tokens.any() else torch.ones(1)
    return {
        "clip_frac": masked_mean((clipped_low | clipped_high).float(), mask),
        "clip_frac_low": masked_mean(clipped_low.float(), mask),
        "clip_frac_high": masked_mean(clipped_high.float(), mask),
        "ratio_mean": ratios.mean(),
        "ratio_min": ratios.min(),
        "ratio_max": ratios.max(),
    }
