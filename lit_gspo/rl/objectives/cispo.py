"""CISPO (MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention")."""

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


class CISPO(Objective):
    """Clipped IS-weight policy optimisation: clip the (detached) weight, never the token's gradient.

        r_t = exp(logp_t − old_logp_t)
        ℓ_t = −sg( clip(r_t, 1 − ε_low, 1 + ε_high) ) · Â_t · logp_t
        loss = Σ_i Σ_t ℓ_t / Σ_i |y_i|                                (``token-mean``)

    Every token keeps its gradient sg(r̂_t) Â_t ∇logp_t, so ``clip_frac`` (tokens whose gradient the
    clip zeroes) is 0 by definition; ``is_clip_frac`` is the share of tokens whose weight was truncated.
    Defaults: MiniMax-M1 imposes no lower bound ("we did not impose a lower bound on the IS weight
    by setting ε_low to a large value; instead, we only tuned ε_high"): ε_low = 1 (the bound 0 never
    bites). ε_high = 3, i.e. weights capped at ε_max = 4 as in ScaleRL (Khatri et al., 2025, "The Art
    of Scaling RL Compute for LLMs"; also Tinker's CISPO default). verl's example uses ε_high = 0.2.
    """

    name = "cispo"
    zero_advantage_has_no_gradient = True  # every policy-loss term is a multiple of Â

    def __init__(
        self,
        clip_low: float = 1.0,
        clip_high: float = 3.0,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation)

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = torch.exp(log_ratio(logprobs, old_logprobs)).detach()  # (B, T)
        weight = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)  # (B, T), sg(r̂)
        loss = -weight * advantages * logprobs  # (B, T)
        never = torch.zeros_like(mask)
        metrics = token_ratio_metrics(ratio, mask, never, never)
        metrics["is_clip_frac"] = masked_mean((weight != ratio).float(), mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
