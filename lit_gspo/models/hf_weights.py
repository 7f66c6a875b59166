"""The policy's weights as a Hugging Face checkpoint of the plain model names them: what an inference engine loads
(``VLLMEngine``'s push) and what a LoRA run exports as its merged model when it cannot copy the policy (FSDP2).

    hf_weights(policy)  (name, tensor) for every weight of the plain model; under LoRA each adapted layer's
                        ``W + Σ_adapters ΔW`` (peft's ``get_delta_weight``) under its base name, the adapters
                        themselves left out; the policy is not modified

Under FSDP2 (parameters are DTensors, one shard per rank) every rank gets the full tensors: gathers, which every
rank must run through in the same order, to the end.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_gspo.models.lora import is_lora
from lit_gspo.runtime.sharding import full_state_dict, is_sharded


def hf_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every weight of ``policy`` under its Hugging Face checkpoint name (LoRA adapters merged into a copy)."""
    base = policy.get_base_model() if is_lora(policy) else policy
    state = full_state_dict(base, cpu_offload=False) if is_sharded(policy) else base.state_dict()
    if not is_lora(policy):
        for name, tensor in state.items():
            yield name, tensor.detach()
        return
    adapted = {name: module for name, module in base.named_modules() if hasattr(module, "get_delta_weight")}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, tensor.detach()
            continue
        layer_name, _, leaf = name.partition(".base_layer.")
        tensor = tensor.detach()
        if leaf == "weight":
            layer = adapted[layer_name]
            deltas = [_full(layer.get_delta_weight(a)) for a in layer.active_adapters if a in layer.lora_A]
            if deltas and not layer.merged and not getattr(layer, "disable_adapters", False):
                tensor = tensor + sum(deltas).to(tensor.dtype)
        yield f"{layer_name}.{leaf}", tensor


def _full(tensor: Tensor) -> Tensor:
    """A DTensor's shards gathered (collective); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
