"""The reference policy moved toward the policy (TR-DPO's syncing, TRL's ``sync_ref_model``; ProRL's reset at α = 1):

π_ref ← α · π_θ + (1 − α) · π_ref        every parameter, in place, after every n-th RL step
"""

from __future__ import annotations

import torch
from torch import nn


def sync_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """``reference``'s parameters moved to ``α · policy + (1 − α) · reference`` (the two name the same parameters)."""
    mine, theirs = dict(reference.named_parameters()), dict(policy.named_parameters())
    if mine.keys() != theirs.keys():
        missing = sorted(mine.keys() ^ theirs.keys())[:3]
        raise ValueError(f"the reference and the policy do not hold the same parameters (e.g. {missing})")
    with torch.no_grad():
        for name, parameter in mine.items():
            parameter.lerp_(theirs[name].detach().to(parameter.dtype), alpha)


def check_reference_sync(has_reference: bool, lora: bool) -> None:
    """A ValueError where ``policy.ref_sync`` has no reference of its own to move."""
    if lora:
        raise ValueError(
            "policy.ref_sync moves the reference's weights, but with LoRA the reference is the base model with the "
            "adapters off (no weights of its own); drop policy.ref_sync, or train the full model"
        )
    if not has_reference:
        raise ValueError(
            "policy.ref_sync moves the reference toward the policy, but this run keeps none (objective beta 0 and "
            "policy.kl_to_ref false); set a beta > 0 or policy.kl_to_ref true, or drop policy.ref_sync"
        )
