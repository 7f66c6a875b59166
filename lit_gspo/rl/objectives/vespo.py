"""VESPO (Shen et al., 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization for Stable
Off-Policy LLM Training", arXiv:2602.10693)."""

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
    masked_mean,
    masked_sum,
    sequence_ratio_metrics,
)


class VESPO(Objective):
    """REINFORCE weighted by a smooth Gamma-shaped kernel of the whole sequence's importance weight.

        W_i = Π_t r_{i,t} = exp( Σ_t m_t (logp_t − old_logp_t) )          (the product: no 1/|y_i|)
        φ(W) = W^k · exp( λ (1 − W) ),   (k, λ) = (k_pos, λ_pos) if Â_t ≥ 0 else (k_neg, λ_neg)
        ℓ_t = −sg(φ(W_i)) · Â_t · logp_t
        loss = aggregate(ℓ)                                                      (``token-mean``)

    ∇ℓ_t = −φ(W_i) Â_t ∇logp_t. φ(1) = 1 (on-policy it is the policy gradient), φ peaks at W = k/λ and
    decays to 0 as W → 0 or W → ∞, so stale or mismatched sequences are attenuated smoothly rather than
    clipped. ``gate_weight`` is the mean φ over valid tokens (1: unchanged; it can exceed 1 near W = k/λ);
    ``clip_frac`` counts tokens whose φ underflowed to exactly 0; ``ratio_*`` describe W.

    Defaults k_pos 2, λ_pos 3, k_neg 3, λ_neg 2 and ``token-mean`` are the authors' code (their verl
    recipe) and TRL's ``loss_type="vespo"``; both clamp log W to [log 1e-8, 20] (here ±20) and can fold
    a token-level rollout correction π_old/π_sampler into W, which this trainer does not pass.
    """

    name = "vespo"
    zero_advantage_has_no_gradient = True  # ℓ is a multiple of Â

    def __init__(
        self,
        k_pos: float = 2.0,
        lambda_pos: float = 3.0,
        k_neg: float = 3.0,
        lambda_neg: float = 2.0,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
    ):
        super().__init__(clip_low=0.0, clip_high=0.0, beta=beta, kl_estimator=kl_estimator, aggregation=aggregation)
        if min(k_pos, k_neg) < 0 or min(lambda_pos, lambda_neg) <= 0:
            raise ValueError(
                f"k_pos and k_neg must be >= 0 and lambda_pos and lambda_neg > 0, got "
                f"{k_pos}, {k_neg}, {lambda_pos}, {lambda_neg}"
            )
        self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg = map(float, (k_pos, lambda_pos, k_neg, lambda_neg))

    def __repr__(self) -> str:
        return (
            f"VESPO(k_pos={self.k_pos}, lambda_pos={self.lambda_pos}, k_neg={self.k_neg}, "
            f"lambda_neg={self.lambda_neg}, beta={self.beta}, kl_estimator={self.kl_estimator!r}, "
            f"aggregation={self.aggregation!r})"
        )

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        log_w = masked_sum(log_ratio(logprobs.detach(), old_logprobs), mask, dim=1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        w = torch.exp(log_w)[:, None]  # (B, 1)
        positive = advantages >= 0  # (B, T)
        k = torch.where(positive, self.k_pos, self.k_neg)  # (B, T)
        lam = torch.where(positive, self.lambda_pos, self.lambda_neg)  # (B, T)
        phi = torch.exp(lam + k * log_w[:, None] - lam * w)  # (B, T), φ(W_i) with the token's (k, λ)
        loss = -phi * advantages * logprobs  # (B, T)
        zeroed = phi == 0  # (B, T): W so far from 1 that φ underflowed
        metrics = sequence_ratio_metrics(w[:, 0], mask, zeroed & (advantages < 0), zeroed & (advantages > 0))
        metrics["gate_weight"] = masked_mean(phi, mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
