"""The policy as the decoding step reads it under autocast: its ``nn.Linear`` weights already in autocast's dtype.

Under bf16 autocast every ``F.linear`` casts its fp32 weight (and bias) to bf16. Eager sampling casts each weight once
per rollout (``weights_cast_once``: autocast's cast cache). A compiled decoding step cannot: the casts are ops of its
graph and run at every token, so a weight-bound step moves 4 bytes read + 2 written + 2 read per weight instead of 2
read (measured in the compiled graph on CPU: one ``convert_element_type`` per Linear weight per step).

:class:`PrecastLinears` keeps a structural copy of the policy that shares every parameter and buffer with it except
the weights and biases of its ``nn.Linear`` modules, which are copies in autocast's dtype, refreshed from the policy
once per rollout. They hold what autocast would compute (the same round-to-nearest cast), so the tokens and log-probs
are the policy's under autocast, bit for bit. A tied LM head gets its own copy; the embedding keeps the shared fp32
weight, as autocast reads it. Its cost: one copy of the Linear weights in autocast's dtype on the device.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn


class PrecastLinears:
    """``view(policy)``: the policy with its Linear weights in autocast's dtype, or the policy itself outside autocast."""

    def __init__(self):
        self.source: nn.Module | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.copy: nn.Module | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the copy's tensor, the policy's)

    def view(self, policy: nn.Module) -> nn.Module:
        device = next(policy.parameters()).device
        if not torch.is_autocast_enabled(device.type):
            return policy
        dtype = torch.get_autocast_dtype(device.type)
        if self.copy is None or self.source is not policy or (self.dtype, self.device) != (dtype, device):
            self.build(policy, dtype)  # (Lightning's teardown moves a fitted policy back to the CPU)
        with torch.no_grad():
            for cast, weight in self.pairs:
                cast.copy_(weight)
        return self.copy

    def build(self, policy: nn.Module, dtype: torch.dtype) -> None:
        self.close()
        shared = {id(t): t for t in itertools.chain(policy.parameters(), policy.buffers())}
        self.copy = copy.deepcopy(policy, memo=shared)  # new modules around the same tensors
        self.source, self.dtype, self.pairs = policy, dtype, []
        self.device = next(policy.parameters()).device
        for name, module in self.copy.named_modules():
            if type(module) is not nn.Linear:  # not quantised or adapter layers: their forward is their own
                continue
            original = policy.get_submodule(name)
            for attr in ("weight", "bias"):
                tensor = getattr(original, attr)
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                cast = nn.Parameter(torch.empty_like(tensor, dtype=dtype), requires_grad=False)
                setattr(module, attr, cast)
                self.pairs.append((cast, tensor))

    def close(self) -> None:
        self.source = self.copy = self.dtype = self.device = None
        self.pairs = []
