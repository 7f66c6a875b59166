"""The models one run holds: the policy (with its LoRA adapters), its tokenizer, the frozen reference, the critic's head."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from lit_gspo.models.loading import load_policy
from lit_gspo.models.lora import apply_lora
from lit_gspo.models.routing import moe_routers
from lit_gspo.models.utils import enable_gradient_checkpointing


@dataclass
class Policies:
    """``reference``: a frozen copy of the policy RL starts from, ``"adapters_off"`` (LoRA: the policy with its adapters
    disabled is the reference, no copy) or None (no reference log-probs); ``value_head``: the critic's head on the
    decoder's last state (objectives with a critic: PPO), or None."""

    policy: nn.Module
    tokenizer: object
    reference: nn.Module | str | None
    value_head: nn.Linear | None

    @property
    def is_moe(self) -> bool:
        return bool(moe_routers(self.policy))


def build_policies(
    model: str,
    *,
    model_config: dict | None = None,
    gguf_file: str | None = None,
    seed: int = 0,
    lora=None,
    gradient_checkpointing: bool = False,
    reference: bool = True,
    critic: bool = False,
    trust_remote_code: bool = False,
) -> Policies:
    """Load ``model`` (``lit_gspo.models.loading.load_policy``), add LoRA adapters (``lora``: a ``LoRA`` config) and
    gradient checkpointing, copy the frozen reference when asked, and the critic's head (in this order: the head's
    initial weights come from the global RNG after the policy's)."""
    policy, tokenizer = load_policy(
        model, gguf_file=gguf_file, config_overrides=model_config, seed=seed, trust_remote_code=trust_remote_code
    )
    if lora is not None:
        policy = apply_lora(
            policy, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.target_modules)
        )
    if gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    ref: nn.Module | str | None = None
    if reference:
        ref = "adapters_off" if lora is not None else frozen_copy(policy)
    value_head = nn.Linear(policy.config.hidden_size, 1) if critic else None
    return Policies(policy, tokenizer, ref, value_head)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode without gradients."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref
