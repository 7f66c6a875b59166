"""Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
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
    clipped_surrogate,
    log_ratio,
    masked_mean,
    token_ratio_metrics,
)


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """(B, T) detached centred products (Â_t − mean Â)(logp_t − mean logp), means over the valid tokens
    of *this* batch; 0 outside the mask. Their mean is the covariance that drives entropy down."""
    lp, adv = logprobs.detach(), advantages.detach()
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
    return torch.where(mask, cov, 0.0)


def selection_size(ratio: float, mask: Tensor) -> int:
    """max(⌊ratio · N⌋, 1) tokens of a batch with N valid tokens (0 when it has none)."""
    n = int(mask.sum())
    return max(int(ratio * n), 1) if n else 0


class ClipCov(Objective):
    """PPO-clip that detaches the gradient of a few tokens whose advantage and log-prob covary strongly.

        c_t = (Â_t − mean Â)(logp_t − mean logp)                        (means over the batch's valid tokens)
        I = ⌊r · N⌋ tokens (at least 1) drawn uniformly from { t : ω_low < c_t < ω_high, not clipped by PPO }
        ℓ_t = −min( r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t )  for t ∉ I;   sg(ℓ_t) for t ∈ I
        loss = aggregate(ℓ)                                                      (``token-mean``)

    High-covariance tokens (confident and rewarded, or rare and punished) are what collapses entropy;
    dropping their gradient keeps it up. ``clip_frac`` counts PPO-clipped and selected tokens (both lose
    their gradient), ``cov_clip_frac`` the selected ones alone, ``cov_mean`` the batch covariance.

    The selection is over the batch given to the loss — a micro-batch under gradient accumulation, as
    in verl, whose loss sees one micro-batch: its means and N, so unlike the other objectives the
    gradient depends on the split (exact invariance needs the whole step's statistics before the first
    backward). The draw uses torch's global RNG (seeded by ``seed_everything``).

    Defaults are the paper's: r = 2e-4, ω_low = 1, ω_high = 5, ε 0.2/0.2, ``token-mean`` (verl, SkyRL and
    the authors' fork agree). verl sets the selected tokens' loss to 0 (same gradient, other value).
    """

    name = "clip_cov"
    # ℓ vanishes with Â, but skipping Â = 0 rows would change the batch means and N the selection uses

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        clip_cov_ratio: float = 2e-4,
        clip_cov_lb: float = 1.0,
        clip_cov_ub: float = 5.0,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
    ):
        super().__init__(
            clip_low=clip_low, clip_high=clip_high, beta=beta, kl_estimator=kl_estimator, aggregation=aggregation
        )
        if not 0 < clip_cov_ratio <= 1:
            raise ValueError(f"clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}")
        if clip_cov_lb >= clip_cov_ub:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {clip_cov_lb} and {clip_cov_ub}")
        self.clip_cov_ratio = float(clip_cov_ratio)
        self.clip_cov_lb, self.clip_cov_ub = float(clip_cov_lb), float(clip_cov_ub)

    def __repr__(self) -> str:
        return (
            f"{super().__repr__()[:-1]}, clip_cov_ratio={self.clip_cov_ratio}, clip_cov_lb={self.clip_cov_lb}, "
            f"clip_cov_ub={self.clip_cov_ub})"
        )

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = torch.exp(log_ratio(logprobs, old_logprobs))  # (B, T)
        loss, clipped_low, clipped_high = clipped_surrogate(ratio, advantages, self.clip_low, self.clip_high)
        cov = token_covariance(logprobs, advantages, mask)  # (B, T)
        candidates = mask & ~clipped_low & ~clipped_high & (cov > self.clip_cov_lb) & (cov < self.clip_cov_ub)
        flat = candidates.flatten().nonzero().squeeze(1)  # row-major: the same order however the rows are padded
        drawn = flat[torch.randperm(flat.numel(), device=flat.device)[: selection_size(self.clip_cov_ratio, mask)]]
        selected = torch.zeros_like(candidates).flatten().index_fill_(0, drawn, True).view_as(mask)
        loss = torch.where(selected, loss.detach(), loss)  # (B, T)
        metrics = token_ratio_metrics(ratio, mask, clipped_low, clipped_high)
        metrics["clip_frac"] = masked_mean((clipped_low | clipped_high | selected).float(), mask)
        metrics["cov_clip_frac"] = masked_mean(selected.float(), mask)
        metrics["cov_mean"] = masked_mean(cov, mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)
