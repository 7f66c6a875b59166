"""GSPO and GSPO-token (Zheng et al., 2025, "Group Sequence Policy Optimization")."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_gspo.rl.objectives.base import (
    MAX_LOG_RATIO,
    Aggregation,
    Counts,
    KLEstimator,
    LossOutput,
    Objective,
    aggregate,
    clipped_surrogate,
    masked_sum,
    sequence_ratio_metrics,
)


class GSPO(Objective):
    """Sequence-level importance ratio, clipped per sequence.

        s_i = exp( Σ_t m_t (logp_t − old_logp_t) / |y_i| )          (geometric mean of token ratios)
        ℓ_i = −min( s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i )
        loss = Σ_i ℓ_i / N_seqs                                      (every token of y_i weighs the same)

    Paper defaults: ε_low = 3e-4, ε_high = 4e-4. ``clip_frac`` counts every token of a clipped
    sequence, the quantity the paper compares with GRPO's token clip fraction.
    """

    name = "gspo"
    zero_advantage_has_no_gradient = True  # every policy-loss term is a multiple of Â

    def __init__(
        self,
        clip_low: float = 3e-4,
        clip_high: float = 4e-4,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-mean",
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation)

    def sequence_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        lengths = mask.sum(1).clamp(min=1)  # (B,)
        mean_log_ratio = masked_sum(logprobs - old_logprobs, mask, dim=1) / lengths  # (B,)
        return torch.exp(mean_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # (B,)

    def importance_weight(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        """(B, T) weight whose value is s_i on every token of sequence i."""
        return self.sequence_ratio(logprobs, old_logprobs, mask)[:, None].expand_as(logprobs)

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = self.importance_weight(logprobs, old_logprobs, mask)  # (B, T), value s_i on row i
        loss, clipped_low, clipped_high = clipped_surrogate(ratio, advantages, self.clip_low, self.clip_high)  # (B, T)
        seq_ratio = self.sequence_ratio(logprobs.detach(), old_logprobs, mask)  # (B,)
        metrics = sequence_ratio_metrics(seq_ratio, mask, clipped_low, clipped_high)
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
