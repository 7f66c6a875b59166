"""DPPO (Qi, Zhou et al., 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv:2602.04879)."""

from __future__ import annotations

from typing import Literal

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

Divergence = Literal["binary_tv", "binary_kl"]
DIVERGENCES: tuple[str, ...] = Divergence.__args__  # type: ignore[attr-defined]
DEFAULT_BOUND = {"binary_tv": 0.15, "binary_kl": 0.05}


def binary_divergence(logprobs: Tensor, old_logprobs: Tensor, divergence: str) -> Tensor:
    """(B, T) divergence between Bernoulli(μ_t) and Bernoulli(π_t), μ = e^old_logp, π = e^logp (detached).

    binary_tv: |π − μ|;   binary_kl: μ log(μ/π) + (1 − μ) log((1 − μ)/(1 − π))   (KL(μ ‖ π)).
    Log-probs are clamped to ≤ 0 and 1 − π to ≥ 1e-30, so the result is finite for any finite input.
    """
    lp, old = logprobs.detach().clamp(max=0.0), old_logprobs.detach().clamp(max=0.0)
    if divergence == "binary_tv":
        return (lp.exp() - old.exp()).abs()
    q_old, q_new = -torch.expm1(old), (-torch.expm1(lp)).clamp(min=1e-30)  # 1 − μ, 1 − π, exact near μ, π ≈ 1
    return old.exp() * (old - lp) + torch.xlogy(q_old, q_old) - torch.xlogy(q_old, q_new)


class DPPO(Objective):
    """Divergence PPO: a trust region on how far each sampled token's probability moved, not on its ratio.

        r_t = exp(logp_t − old_logp_t),  π_t = e^logp_t,  μ_t = e^old_logp_t
        D_t = |π_t − μ_t|                                               (``binary_tv``)
            = μ_t log(μ_t/π_t) + (1 − μ_t) log((1 − μ_t)/(1 − π_t))     (``binary_kl``)
        M_t = 0 if Â_t > 0 and π_t > μ_t and D_t > δ_high,  or  Â_t < 0 and π_t < μ_t and D_t > δ_low;  else 1
        ℓ_t = −M_t · r̃_t · Â_t,   r̃_t = r_t (or min(r_t, C) with ``ratio_cap`` C: value and gradient truncated)
        loss = aggregate(ℓ)                                             (``seq-mean-token-sum-norm``)

    ∇ℓ_t = −M_t r̃_t Â_t ∇logp_t: the unclipped policy gradient except on tokens that left the trust
    region in the direction their advantage pushes (a rare token's probability going 1e-5 → 1e-3 is a
    ratio of 100 but a TV of 0.001; 0.99 → 0.8 is a ratio of 0.81 but a TV of 0.19). ``clip_low``/
    ``clip_high`` are the bounds δ_low/δ_high on D; ``clip_frac`` counts masked tokens; ``divergence_mean``
    is the mean D over valid tokens.

    Defaults are the authors' recipe (their verl example, Qwen3-30B-A3B): δ = 0.15 for binary TV, 0.05
    for binary KL, Dr. GRPO advantages (no std division) and ``seq-mean-token-sum-norm``, no ratio cap
    (C = 10000 there). Implementations differ: prime-rl's default loss is binary TV with δ 0.2/0.2,
    ``token-mean`` and an extra 1e-3·(logp − old_logp)² on every token; verl truncates r at its
    ``clip_ratio_c`` (the dual-clip constant, 3 unless set) through −sg(min(r, C)) Â logp (this gradient).
    """

    name = "dppo"
    zero_advantage_has_no_gradient = True  # ℓ is a multiple of Â
    paper_advantage = "group_mean"

    def __init__(
        self,
        divergence: Divergence = "binary_tv",
        clip_low: float | None = None,
        clip_high: float | None = None,
        ratio_cap: float | None = None,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-sum-norm",
    ):
        """
        Args:
            divergence: the divergence D the trust region bounds (``binary_tv`` or ``binary_kl``).
            clip_low: δ_low, the bound on D for tokens whose probability fell (None: the divergence's: 0.15 for
                ``binary_tv``, 0.05 for ``binary_kl``).
            clip_high: δ_high, the bound on D for tokens whose probability rose (None: the divergence's, as ``clip_low``).
            ratio_cap: C: the ratio is truncated at C, value and gradient (None: no cap).
        """
        if divergence not in DIVERGENCES:
            raise ValueError(f"unknown divergence {divergence!r}; valid: {', '.join(DIVERGENCES)}")
        bound = DEFAULT_BOUND[divergence]
        super().__init__(
            clip_low=bound if clip_low is None else clip_low,
            clip_high=bound if clip_high is None else clip_high,
            beta=beta,
            kl_estimator=kl_estimator,
            aggregation=aggregation,
        )
        if ratio_cap is not None and ratio_cap <= 0:
            raise ValueError(f"ratio_cap must be > 0 (or None), got {ratio_cap}")
        self.divergence, self.ratio_cap = divergence, ratio_cap

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, divergence={self.divergence!r}, ratio_cap={self.ratio_cap})"

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = torch.exp(log_ratio(logprobs, old_logprobs))  # (B, T)
        weight = ratio if self.ratio_cap is None else ratio * (ratio.clamp(max=self.ratio_cap) / ratio).detach()
        div = binary_divergence(logprobs, old_logprobs, self.divergence)  # (B, T)
        up = logprobs.detach() > old_logprobs  # (B, T), π > μ
        masked_high = (advantages > 0) & up & (div > self.clip_high)  # (B, T)
        masked_low = (advantages < 0) & (logprobs.detach() < old_logprobs) & (div > self.clip_low)
        loss = torch.where(masked_low | masked_high, 0.0, -weight * advantages)  # (B, T)
        metrics = token_ratio_metrics(ratio, mask, masked_low, masked_high)
        metrics["divergence_mean"] = masked_mean(div, mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
