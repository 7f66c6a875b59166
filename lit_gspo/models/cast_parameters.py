"""The update's passes on parameters cast once per optimiser step (``update.param_dtype``), fp32 master weights kept.

Under Lightning's ``bf16-mixed`` the parameters are fp32 and autocast casts each ``nn.Linear``'s weight and input to
bf16 at every call; the embedding, the norms and the residual stream stay fp32. With ``param_dtype: bf16`` every
floating parameter W is read as

    W₁₆ = bf16(W)            once per optimiser step (and once for each no-grad pass: old, reference log-probs)

so the whole forward computes in bf16 (as Megatron's and verl's mixed precision do), and its backward gives

    ∂L/∂W = Σ_micro-batches fp32(∂L_m/∂W₁₆)     (the cast's backward; the sum in fp32, in W's ``.grad``)

The parameters themselves never change dtype: the optimiser, gradient clipping, checkpoints, resume and exports see
the fp32 master weights as before. Tied parameters (an LM head tied to the embedding) share one cast.

:class:`CastParameters` replaces each floating parameter of the model by its cast for the duration of ``active``
(the modules read their attributes at every call, so every layer, hook and recomputation inside sees the casts) and
registers the same parameter objects back, in their order, after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

#: the values ``update.param_dtype`` takes, and the dtype each names
PARAM_DTYPES = {"bf16": torch.bfloat16}


class CastParameters:
    """``with cast.active(model):`` the model's floating parameters are read in ``dtype`` (differentiable casts)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    @contextmanager
    def active(self, model: nn.Module):
        modules = {}  # module -> its own parameters, in their order
        for _, module in model.named_modules(remove_duplicate=False):
            own = list(module.named_parameters(recurse=False))
            if any(p.is_floating_point() and p.dtype != self.dtype for _, p in own):
                modules[module] = own
        casts = {}  # id(parameter) -> its cast (one per tied parameter)
        for module, own in modules.items():
            for name, param in own:
                delattr(module, name)
                if param.is_floating_point() and param.dtype != self.dtype:
                    if id(param) not in casts:
                        casts[id(param)] = param.to(self.dtype)
                    setattr(module, name, casts[id(param)])  # a plain attribute: the module reads it as before
                else:
                    setattr(module, name, param)
        try:
            yield
        finally:
            for module, own in modules.items():
                for name, _ in own:
                    delattr(module, name)
                for name, param in own:
                    module.register_parameter(name, param)
