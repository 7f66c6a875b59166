"""KL-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv:2505.22617)."""

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
from lit_gspo.rl.objectives.clip_cov import selection_size, token_covariance


class KLCov(Objective):
    """Unclipped policy gradient plus a KL penalty on the tokens whose advantage and log-prob covary most.

        c_t = (Â_t − mean Â)(logp_t − mean logp)                        (means over the batch's valid tokens)
        I = the ⌊k · N⌋ tokens (at least 1) with the largest c_t
        ℓ_t = −r_t Â_t + β_cov · |logp_t − old_logp_t| · [t ∈ I]
        loss = aggregate(ℓ)                                                      (``token-mean``)

    No ratio clip: the penalty pulls only the selected tokens back to the old policy, so nothing is
    zeroed and ``clip_frac`` is 0; ``kl_cov_frac`` is the share of penalised tokens, ``cov_mean`` the
    batch covariance. As with Clip-Cov the selection is over the batch given to the loss (a
    micro-batch under gradient accumulation, as in verl): the gradient depends on the split.

    Defaults: β_cov = 1 and k = 2e-3, the paper's Qwen2.5-7B setting (2e-4 for 32B, which verl and SkyRL
    take as their default ``kl_cov_ratio``); ``token-mean`` as in the authors' DAPO-based recipe.
    """

    name = "kl_cov"

    def __init__(
        self,
        kl_cov_ratio: float = 2e-3,
        kl_cov_coef: float = 1.0,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
    ):
        super().__init__(clip_low=0.0, clip_high=0.0, beta=beta, kl_estimator=kl_estimator, aggregation=aggregation)
        if not 0 < kl_cov_ratio <= 1:
            raise ValueError(f"kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
        if kl_cov_coef < 0:
            raise ValueError(f"kl_cov_coef must be >= 0, got {kl_cov_coef}")
        self.kl_cov_ratio, self.kl_cov_coef = float(kl_cov_ratio), float(kl_cov_coef)

    def __repr__(self) -> str:
        return (
            f"KLCov(kl_cov_ratio={self.kl_cov_ratio}, kl_cov_coef={self.kl_cov_coef}, beta={self.beta}, "
            f"kl_estimator={self.kl_estimator!r}, aggregation={self.aggregation!r})"
        )

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = torch.exp(log_ratio(logprobs, old_logprobs))  # (B, T)
        cov = token_covariance(logprobs, advantages, mask)  # (B, T)
        scores = torch.where(mask, cov, float("-inf")).flatten()
        top = torch.topk(scores, selection_size(self.kl_cov_ratio, mask)).indices
        selected = torch.zeros_like(mask).flatten().index_fill_(0, top, True).view_as(mask)
        penalty = torch.where(selected, self.kl_cov_coef * (logprobs - old_logprobs).abs(), 0.0)  # (B, T)
        loss = -ratio * advantages + penalty  # (B, T)
        never = torch.zeros_like(mask)
        metrics = token_ratio_metrics(ratio, mask, never, never)
        metrics["kl_cov_frac"] = masked_mean(selected.float(), mask)
        metrics["cov_mean"] = masked_mean(cov, mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
