"""Under autocast, one 16-bit copy of an activation for every Linear that reads it.

autocast casts a Linear's fp32 input at each call, and the matmul keeps its copy for ∂L/∂W: q, k and v of one norm's
output make three copies of it, gate and up two (Qwen3-0.6B's shape: 3 · hidden · 2 bytes a token and layer, a
tenth of what a lean token keeps, and three cast kernels a layer's forward). :class:`SharedCasts` lets the first
Linear that reads a tensor cast it and the next ones that read the same tensor, unchanged, read that copy, each
through its own :class:`SharedCast`: the cast's backward (the gradient converted to the input's dtype) on an edge of
its own, so the readers' gradients add up in fp32 in the order autocast's casts add them — autocast's gradients bit
for bit (``tests/test_lean_activations.py``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SharedCast(torch.autograd.Function):
    """``copy`` (x cast once) as one Linear reads it; its gradient reaches x converted to x's dtype, as a cast's does."""

    @staticmethod
    def forward(ctx, x: Tensor, copy: Tensor) -> Tensor:
        ctx.dtype = x.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.dtype), None


class SharedCasts:
    """The last activation cast and its copy (weak references: the matmuls that keep the copy keep it alive)."""

    def __init__(self):
        self.source = self.copy = lambda: None
        self.version = -1

    def copy_of(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        copy = self.copy()
        if copy is None or copy.dtype != dtype or self.source() is not x or self.version != x._version:
            copy = x.detach().to(dtype)
            self.source, self.copy, self.version = weakref.ref(x), weakref.ref(copy), x._version
        return copy

    def linear_forward(self, linear: nn.Linear, x: Tensor) -> Tensor:
        """``linear(x)``, reading the shared copy of x where autocast would cast x."""
        device = x.device.type
        if x.dtype != torch.float32 or not torch.is_grad_enabled() or not torch.is_autocast_enabled(device):
            return F.linear(x, linear.weight, linear.bias)
        copy = self.copy_of(x, torch.get_autocast_dtype(device))
        return F.linear(SharedCast.apply(x, copy), linear.weight, linear.bias)
