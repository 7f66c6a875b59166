"""The update's passes on parameters cast once per optimiser step (``update.param_dtype``), fp32 master weights kept.

Under Lightning's ``bf16-mixed`` the parameters are fp32 and autocast casts each ``nn.Linear``'s weight and input to
bf16 at every call; the embedding, the norms and the residual stream stay fp32. With ``param_dtype: bf16`` every
floating parameter W is read as

    W₁₆ = bf16(W)            once per optimiser step (and once for each no-grad pass: old, reference log-probs)

so the whole forward computes in bf16 (as Megatron's and verl's mixed precision do), and its backward gives

    ∂L/∂W = Σ_micro-batches fp32(∂L_m/∂W₁₆)     (the cast's backward; the sum in fp32, in W's ``.grad``)

The parameters themselves never change dtype: the optimiser, gradient clipping, checkpoints, resume and exports see
the fp32 master weights as before. Tied parameters (an LM head tied to the embedding) share one cast.

:class:`CastParameters` puts each floating parameter's cast in its module's instance dictionary for the duration of
``active``: Python's attribute lookup finds it there before ``nn.Module`` looks among the registered parameters, so
every forward, hook and recomputation inside reads the cast, while the parameters stay registered as they are
(``parameters()``, ``state_dict()``, the optimiser and DDP's hooks see the fp32 ones). Leaving removes the casts.
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
        casts = {}  # id(parameter) -> its cast (one per tied parameter)
        shadowed = []  # (module, name): a cast in the module's instance dict, in front of its registered parameter
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.is_floating_point() or param.dtype == self.dtype or name in vars(module):
                    continue  # (already shadowed: a nested context)
                if id(param) not in casts:
                    casts[id(param)] = param.to(self.dtype)
                object.__setattr__(module, name, casts[id(param)])  # attribute lookup finds it before the parameter
                shadowed.append((module, name))
        try:
            yield
        finally:
            for module, name in shadowed:
                object.__delattr__(module, name)
