"""GDPO's reward (group reward-decoupled normalisation; TRL's ``multi_objective_aggregation: normalize_then_sum``):

    R'_i = Σ_k w_k (r_{i,k} − mean_g r_k) / (std_g r_k + ε)       each reward function normalised within the group g

so that a function on a larger scale, or one whose scores spread more, does not drown the others in the sum. The
``GDPO`` advantage estimator whitens R' over the batch. A function's None (NaN) leaves that sample out of the
function's group mean, std and the sum, as TRL does; std is Bessel-corrected, ε = 1e-4 (TRL's).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_decoupled_sum(scores: Tensor, weights: Tensor, group_size: int, eps: float = 1e-4) -> Tensor:
    """(N,) R' of ``scores`` (N, K) with ``weights`` (K,), NaN where a function did not score; rows group-major in
    groups of ``group_size``."""
    n, k = scores.shape
    grouped = scores.double().view(n // group_size, group_size, k)
    scored = torch.isfinite(grouped)
    zero = torch.zeros((), dtype=grouped.dtype)
    count = scored.sum(1, keepdim=True)
    mean = torch.where(scored, grouped, zero).sum(1, keepdim=True) / count.clamp(min=1)
    variance = (torch.where(scored, grouped - mean, zero) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    normalised = torch.where(scored, (grouped - mean) / (variance.sqrt() + eps), zero)
    return (normalised * weights.double()).sum(2).reshape(n).float()
