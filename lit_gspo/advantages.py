"""Advantage estimators: rewards → advantages, pure torch in fp32.

Rows are ordered group-major: prompt 0's G completions, then prompt 1's, and so on.

    group       Â_i = (R_i − mean_g R) / (std_g R + eps)      GRPO, DAPO, GSPO (std unbiased, as torch.std)
    group_mean  Â_i = R_i − mean_g R                          Dr. GRPO (no std division)
    batch       Â_i = (R_i − mean_g R) / (std_batch R + eps)  group baseline, batch-wide scale
    rloo        Â_i = R_i − (Σ_g R − R_i) / (G − 1)           leave-one-out baseline
    gae         generalised advantage estimation with a critic (needs values: ``gae``)

A group whose rewards are all equal carries no signal: its advantages are exactly 0, never NaN.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ESTIMATORS: tuple[str, ...] = ("group", "group_mean", "batch", "rloo")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """(N,) → (N / G, G) in fp32, validating the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"the number of rewards N={rewards.numel()} must be a positive multiple of "
                         f"group_size={group_size}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    return rewards.float().reshape(-1, group_size)


def _zero_constant_groups(adv: Tensor, grouped: Tensor) -> Tensor:
    """Advantages of all-equal groups set exactly to 0 (floating means are not exact)."""
    constant = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)  # (N/G, 1)
    return torch.where(constant, torch.zeros_like(adv), adv).reshape(-1)


def group_advantages(rewards: Tensor, group_size: int, scale: Literal["group", "batch", "none"] = "group",
                     eps: float = 1e-6) -> Tensor:
    """(R − group mean) / (std + eps), std of the group (``group``), of the batch (``batch``) or 1 (``none``)."""
    grouped = _grouped(rewards, group_size)  # (N/G, G)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale == "group":
        std = grouped.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        adv = centred / (std + eps)
    elif scale == "batch":
        std = grouped.std() if grouped.numel() > 1 else torch.zeros(())
        adv = centred / (std + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown scale {scale!r}; valid: group, batch, none")
    return _zero_constant_groups(adv, grouped)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out: Â_i = R_i − mean of the other G − 1 rewards of its group."""
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    grouped = _grouped(rewards, group_size)  # (N/G, G)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    return _zero_constant_groups(grouped - baseline, grouped)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
        ) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid (right-padded) tokens of each row.

        δ_t = r_t + γ V_{t+1} m_{t+1} − V_t,   Â_t = δ_t + γ λ m_{t+1} Â_{t+1},   returns = Â + V
    Shapes (B, T); outputs are 0 on padding (rows may be all padding). Values after the last valid
    token count as 0 (the episode ends there).
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards, values and mask must share a (B, T) shape, got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)} and {tuple(mask.shape)}")
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    r = torch.where(m, rewards.float(), zero)  # (B, T)
    v = torch.where(m, values.float(), zero)  # (B, T)
    mf = m.float()
    adv = torch.zeros_like(r)
    last = torch.zeros_like(r[:, 0])  # (B,)
    for t in reversed(range(r.shape[1])):
        next_m = mf[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)
        next_v = v[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)
        delta = r[:, t] + gamma * next_v * next_m - v[:, t]
        last = (delta + gamma * lam * next_m * last) * mf[:, t]
        adv[:, t] = last
    return adv, torch.where(m, adv + v, zero)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment of completion lengths L:

        0                             if L ≤ L_max − L_cache
        (L_max − L_cache − L) / L_cache   if L_max − L_cache < L ≤ L_max
        −1                            if L > L_max
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths).float()
    start = max_len - cache_len
    ramp = (start - lengths) / max(cache_len, 1)
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, -torch.ones_like(lengths), penalty)


def compute_advantages(estimator: str, rewards: Tensor, group_size: int, **kw) -> Tensor:
    """Dispatch to an estimator by name (``group``, ``group_mean``, ``batch``, ``rloo``); (N,) → (N,)."""
    if estimator == "group":
        return group_advantages(rewards, group_size, scale="group", **kw)
    if estimator == "group_mean":
        return group_advantages(rewards, group_size, scale="none", **kw)
    if estimator == "batch":
        return group_advantages(rewards, group_size, scale="batch", **kw)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size, **kw)
    if estimator == "gae":
        raise ValueError("the 'gae' estimator needs a critic's values: call lit_gspo.advantages.gae(rewards, values, "
                         f"mask) in the trainer; compute_advantages handles {', '.join(ESTIMATORS)}")
    raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)} (and 'gae' "
                     "with values)")
