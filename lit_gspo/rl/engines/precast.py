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

Under ``update.param_dtype`` the update reads every floating parameter (embedding and norms too) cast to that dtype;
``view(policy, dtype)`` then holds such a copy of each, so that the sampler computes what the update computes.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn


class PrecastLinears:
    """``view(policy)``: the policy with its Linear weights in autocast's dtype, or the policy itself outside autocast;
    ``view(policy, dtype)``: with every floating parameter in ``dtype`` (tied ones sharing one copy), as the update
    reads them under ``update.param_dtype``."""

    def __init__(self):
        self.source: nn.Module | None = None
        self.key: tuple | None = None  # (dtype, device, every parameter) of the copy
        self.copy: nn.Module | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the copy's tensor, the policy's)

    def view(self, policy: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        device = next(policy.parameters()).device
        every = dtype is not None
        if not every:
            if not torch.is_autocast_enabled(device.type):
                return policy
            dtype = torch.get_autocast_dtype(device.type)
        if self.copy is None or self.source is not policy or self.key != (dtype, device, every):
            self.build(policy, dtype, every)  # (Lightning's teardown moves a fitted policy back to the CPU)
        with torch.no_grad():
            for cast, weight in self.pairs:
                cast.copy_(weight)
        return self.copy

    def build(self, policy: nn.Module, dtype: torch.dtype, every: bool = False) -> None:
        self.close()
        shared = {id(t): t for t in itertools.chain(policy.parameters(), policy.buffers())}
        self.copy = copy.deepcopy(policy, memo=shared)  # new modules around the same tensors
        self.source, self.key, self.pairs = policy, (dtype, next(policy.parameters()).device, every), []
        casts = {}  # id(the policy's tensor) -> its copy (a tied parameter is cast once)
        for name, module in self.copy.named_modules():
            if not every and type(module) is not nn.Linear:  # not quantised or adapter layers: their own forward
                continue
            original = policy.get_submodule(name)
            names = [n for n, _ in original.named_parameters(recurse=False)] if every else ("weight", "bias")
            for attr in names:
                tensor = getattr(original, attr)
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in casts or not every:  # (Linears alone: a tied LM head gets its own copy)
                    casts[id(tensor)] = nn.Parameter(torch.empty_like(tensor, dtype=dtype), requires_grad=False)
                    self.pairs.append((casts[id(tensor)], tensor))
                setattr(module, attr, casts[id(tensor)])

    def close(self) -> None:
        self.source = self.copy = self.key = None
        self.pairs = []
