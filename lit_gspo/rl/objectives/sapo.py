"""SAPO (Gao, Zheng et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347; Qwen team)."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_gspo.rl.objectives.base import (
    Aggregation,
    Counts,
    KLEstimator,
    LossOutput,
    Objective,
    aggregate,
    log_ratio,
    masked_mean,
    token_ratio_metrics,
)


class SAPO(Objective):
    """A soft, temperature-controlled gate on each token's ratio instead of a hard clip.

        r_t = exp(logp_t − old_logp_t)
        f_τ(r) = (4/τ) · σ(τ (r − 1)),   τ = τ_pos if Â_t > 0 else τ_neg
        ℓ_t = −f_τ(r_t) · Â_t
        loss = aggregate(ℓ)                                             (``seq-mean-token-mean``)

    ∇ℓ_t = −w_t · r_t Â_t ∇logp_t with w_t = 4 σ(τ(r_t − 1)) (1 − σ(τ(r_t − 1))): w = 1 at r = 1, so
    on-policy the gradient is the plain policy gradient (GRPO's), and it decays smoothly as r_t leaves
    1 — faster for negative advantages (τ_neg > τ_pos). Nothing is ever zeroed, so ``clip_frac`` is 0;
    ``gate_weight`` is the mean w_t over valid tokens (1: no attenuation).

    Defaults τ_pos = 1.0, τ_neg = 1.05 and the gate per token, averaged per sequence then over
    sequences, as the paper's objective; ms-swift, SkyRL and Trinity gate per token with the same
    τ defaults (their reductions differ: Trinity ``token-mean``, SkyRL ``sequence_mean``).
    """

    name = "sapo"
    zero_advantage_has_no_gradient = True  # ℓ is a multiple of Â

    def __init__(
        self,
        tau_pos: float = 1.0,
        tau_neg: float = 1.05,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-mean",
    ):
        super().__init__(clip_low=0.0, clip_high=0.0, beta=beta, kl_estimator=kl_estimator, aggregation=aggregation)
        if tau_pos <= 0 or tau_neg <= 0:
            raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos} and {tau_neg}")
        self.tau_pos, self.tau_neg = float(tau_pos), float(tau_neg)

    def __repr__(self) -> str:
        return (
            f"SAPO(tau_pos={self.tau_pos}, tau_neg={self.tau_neg}, beta={self.beta}, "
            f"kl_estimator={self.kl_estimator!r}, aggregation={self.aggregation!r})"
        )

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = torch.exp(log_ratio(logprobs, old_logprobs))  # (B, T)
        tau = torch.where(advantages > 0, self.tau_pos, self.tau_neg)  # (B, T)
        gate = torch.sigmoid(tau * (ratio - 1))  # (B, T)
        loss = -(4 / tau) * gate * advantages  # (B, T)
        never = torch.zeros_like(mask)
        metrics = token_ratio_metrics(ratio, mask, never, never)
        gate = gate.detach()
        metrics["gate_weight"] = masked_mean(4 * gate * (1 - gate), mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
