"""GMPO (Zhao et al., 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673)."""

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
    log_ratio,
    masked_sum,
    sequence_ratio_metrics,
)


class GMPO(Objective):
    """Maximise the geometric mean of token-level rewards, clipping each token's ratio in log space.

        Δ_t = logp_t − old_logp_t
        Δ̃_t = min(Δ_t, ε_high)  if Â_i > 0,   max(Δ_t, −ε_low)  if Â_i < 0     (sign-aware clip)
        ℓ_i = −Â_i · exp( Σ_t m_t Δ̃_t / |y_i| )      (= −sgn(Â_i) Π_t min(r_t Â_i, clip(r_t, e^−ε_low, e^ε_high) Â_i)^(1/|y_i|))
        loss = Σ_i ℓ_i / N_seqs                                                 (``seq-mean-token-mean``)

    Here ``clip_low``/``clip_high`` are log-space bounds: the paper's default range (e^−0.4, e^0.4)
    is ε = 0.4 on both sides (the official code clamps sgn(Â)·Δ the same way). A clipped token
    has zero gradient; ``clip_frac`` counts those. ``ratio_*`` are the unclipped sequence geometric
    means exp(Σ_t m_t Δ_t / |y_i|).
    """

    name = "gmpo"
    zero_advantage_has_no_gradient = True  # every policy-loss term is a multiple of Â

    def __init__(
        self,
        clip_low: float = 0.4,
        clip_high: float = 0.4,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-mean",
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation)

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        delta = log_ratio(logprobs, old_logprobs)  # (B, T)
        positive = advantages > 0  # (B, T)
        clipped_delta = torch.where(positive, delta.clamp(max=self.clip_high), delta.clamp(min=-self.clip_low))
        lengths = mask.sum(1).clamp(min=1)  # (B,)
        seq_log_ratio = (masked_sum(clipped_delta, mask, dim=1) / lengths).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        seq_ratio = torch.exp(seq_log_ratio)  # (B,), clipped geometric mean
        loss = -advantages * seq_ratio[:, None]  # (B, T), ℓ_i on every token of row i
        clipped_high = positive & (delta > self.clip_high)
        clipped_low = (advantages < 0) & (delta < -self.clip_low)
        unclipped_ratio = torch.exp(masked_sum(delta.detach(), mask, dim=1) / lengths)  # (B,)
        metrics = sequence_ratio_metrics(unclipped_ratio, mask, clipped_low, clipped_high)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
