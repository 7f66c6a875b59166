"""The policy's weights as an inference engine loads them: Hugging Face checkpoint names, LoRA merged, and a
fingerprint telling whether they changed since the last push.

    hf_weights(policy)       (name, tensor) for every weight of the plain model; under LoRA each adapted
                             layer's ``W + Σ_adapters ΔW`` (peft's ``get_delta_weight``) under its base name,
                             the adapters themselves left out; the policy is not modified
    weights_version(policy)  per parameter: its autograd version (bumped by in-place updates such as
                             torch optimizers' steps and ``load_state_dict``) and its fp64 sum (for writers
                             that bypass the version counter, e.g. bitsandbytes' 8-bit optimizers)

The whole state dict is sent every time: vLLM reloads a stacked layer (q, k, v → qkv) only once all its
parts arrived, and a partial push leaves it corrupted.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lit_gspo.models.lora import is_lora


def hf_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every weight of ``policy`` under its Hugging Face checkpoint name (LoRA adapters merged into a copy)."""
    if not is_lora(policy):
        for name, tensor in policy.state_dict().items():
            yield name, tensor.detach()
        return
    base = policy.get_base_model()
    adapted = {name: module for name, module in base.named_modules() if hasattr(module, "get_delta_weight")}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, tensor.detach()
            continue
        layer_name, _, leaf = name.partition(".base_layer.")
        tensor = tensor.detach()
        if leaf == "weight":
            layer = adapted[layer_name]
            deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
            if deltas and not layer.merged and not getattr(layer, "disable_adapters", False):
                tensor = tensor + sum(deltas).to(tensor.dtype)
        yield f"{layer_name}.{leaf}", tensor


@torch.no_grad()
def weights_version(policy: nn.Module) -> tuple:
    """A fingerprint of ``policy``'s parameters: equal before and after only when no parameter was written."""
    return tuple((id(p), p._version, float(p.detach().sum(dtype=torch.float64))) for p in policy.parameters())
