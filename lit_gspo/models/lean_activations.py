"""The update's RMSNorms and SwiGLU activations keep for backward only what is not one elementwise op away.

autograd keeps every tensor an op's backward reads. An RMSNorm and a SwiGLU MLP (Llama, Qwen, Mistral, SmolLM)

    y = w ⊙ x̂,   x̂ = x · r,   r = (mean(x²) + ε)^-½          keeps x, r and x̂ (w ⊙ x̂ reads x̂ for ∂L/∂w)
    h = silu(g) ⊙ u                                          keeps g, silu(g) and u

where x̂ and silu(g) are one elementwise op of what is kept anyway. :class:`RMSNormFunction` keeps x and r,
:class:`SwiGLUFunction` g and u, and each recomputes the rest in its backward — with autograd's own formulas in
autograd's order, so the gradients are the plain modules' bit for bit (tested on whole models: fp32, bf16 autocast,
bf16 parameter casts). Per token and layer that is ``2·hidden + intermediate`` values fewer (the norm's x̂ twice, the
MLP's silu(g)); under autocast or casts a 16-bit x is kept instead of its fp32 copy, and Qwen3's per-head q/k norms
keep half as much. The cost is those elementwise ops once more in backward. Under autocast, every ``nn.Linear`` also
reads a copy of its input shared with the other Linears that read the same tensor (``models/shared_casts.py``).

:class:`LeanActivations` puts the lean ``forward`` in each such module's instance dictionary for the duration of
``active`` (Python's attribute lookup finds it before the class's, as ``CastParameters`` does with the parameters'
casts) and removes it after: samplers, checkpoints and exports never see it, and without grad it runs the class's
own forward. A module class qualifies only where a probe shows that its forward and its gradients equal the lean
ones bit for bit (``qualifies``), so an RMSNorm of another form (Gemma's ``1 + w``), another activation or another
op order keeps its own forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from types import MethodType, SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_gspo.models.shared_casts import SharedCasts


class RMSNormFunction(torch.autograd.Function):
    """``w ⊙ (x·r)`` with ``r = (mean(x²) + ε)^-½`` computed in fp32 (x̂ back in x's dtype), as transformers' RMSNorm;
    keeps x and r. ``x`` is given twice: the plain module's graph reaches an fp32 x along two edges (directly, then
    through r), so its two gradients add, in that order, onto what x's other uses gave (the residual stream's)."""

    @staticmethod
    def forward(ctx, x: Tensor, x_again: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.to(torch.float32)
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return weight * (x32 * r).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, r, weight = ctx.saved_tensors
        x32 = x.to(torch.float32)
        x_hat = (x32 * r).to(x.dtype)
        grad_weight = grad * x_hat if ctx.needs_input_grad[2] else None  # (summed to w's shape by autograd)
        if not ctx.needs_input_grad[0]:
            return None, None, grad_weight, None
        grad_x_hat = (grad * weight).to(x_hat.dtype).to(torch.float32)
        grad_direct = grad_x_hat * r  # through x̂ = x · r
        grad_r = (grad_x_hat * x32).sum_to_size(r.shape)
        grad_mean = -0.5 * grad_r * r.pow(3)  # r = (m + ε)^-½
        grad_square = grad_mean.expand(x32.shape) / x32.shape[-1] * (2.0 * x32)  # m = mean(x²)
        if x.dtype == torch.float32:
            return grad_direct, grad_square, grad_weight, None
        return (grad_direct + grad_square).to(x.dtype), None, grad_weight, None


class SwiGLUFunction(torch.autograd.Function):
    """``silu(g) ⊙ u``; keeps g and u."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def lean_rmsnorm_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    if args or kwargs or not torch.is_grad_enabled():  # (a call the probe did not see, or nothing kept anyway)
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return RMSNormFunction.apply(hidden_states, hidden_states, self.weight, self.variance_epsilon)


def lean_swiglu_forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    if args or kwargs or not torch.is_grad_enabled():
        return type(self).forward(self, x, *args, **kwargs)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(SwiGLUFunction.apply(gate, up))


def is_rmsnorm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def identical(plain, lean, inputs: list[Tensor]) -> bool:
    """Whether ``plain(*inputs)`` and ``lean(*inputs)`` give the same output and the same gradients bit for bit, the
    first input also reaching the loss directly after (as a residual stream does: its gradients then add up in the
    engine's order). False where ``plain`` fails on the probe (a forward that reads more than the lean one knows)."""
    weights = torch.linspace(-1, 1, inputs[0].numel()).view(inputs[0].shape)
    results = []
    for forward in (plain, lean):
        for tensor in inputs:
            tensor.grad = None
        try:
            with torch.enable_grad(), torch.autocast("cpu", enabled=False):  # (asked inside a training step's autocast)
                out = forward(*inputs)
                loss = (out.float() * torch.linspace(-2, 1, out.numel()).view(out.shape)).sum()
                loss = loss + (inputs[0].float() * weights).sum()
            loss.backward()
        except Exception:  # noqa: BLE001 - not this form
            return False
        results.append([out.detach(), *[t.grad for t in inputs]])
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*results))


def rmsnorm_qualifies(cls: type, eps: float) -> bool:
    """The class's forward against the lean one on a probe (fp32; 16-bit input on fp32 and on 16-bit weights)."""
    generator = torch.Generator().manual_seed(0)
    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16,) * 2):
        x = torch.randn(2, 5, 40, generator=generator).to(x_dtype).requires_grad_()
        w = (torch.rand(40, generator=generator) + 0.5).to(w_dtype).requires_grad_()
        probe = SimpleNamespace(weight=w, variance_epsilon=eps)
        if not identical(lambda x, w: cls.forward(probe, x), lambda x, w: lean_rmsnorm_forward(probe, x), [x, w]):
            return False
    return True


def gated_mlp_qualifies(cls: type, act_fn: nn.Module, bias: bool) -> bool:
    """The class's forward against the lean one on a probe with ``act_fn`` (fp32 and bf16)."""
    for dtype in (torch.float32, torch.bfloat16):
        with torch.random.fork_rng(devices=[]):  # nn.Linear's init draws: the run's random stream stays as it was
            torch.manual_seed(0)
            probe = nn.Module()
            probe.gate_proj, probe.up_proj = nn.Linear(24, 40, bias=bias), nn.Linear(24, 40, bias=bias)
            probe.down_proj, probe.act_fn = nn.Linear(40, 24, bias=bias), act_fn
            x = torch.randn(2, 5, 24).to(dtype).requires_grad_()
        probe.to(dtype)
        params = list(probe.parameters())
        if not identical(
            lambda x, *_: cls.forward(probe, x), lambda x, *_: lean_swiglu_forward(probe, x), [x, *params]
        ):
            return False
    return True


class LeanActivations:
    """``with lean.active(model):`` the model's qualifying RMSNorms and gated MLPs keep less for backward
    (:class:`RMSNormFunction`, :class:`SwiGLUFunction`; which classes qualify is probed once per class), and its
    Linears share autocast's copies (:class:`~lit_gspo.models.shared_casts.SharedCasts`)."""

    def __init__(self):
        self.verdicts: dict[tuple, bool] = {}  # (class, its probe's settings) -> qualifies
        self.casts = SharedCasts()

    def qualifies(self, module: nn.Module) -> bool:
        cls = type(module)
        if is_rmsnorm(module):
            key = (cls, module.variance_epsilon)
            if key not in self.verdicts:
                self.verdicts[key] = rmsnorm_qualifies(cls, module.variance_epsilon)
            return self.verdicts[key]
        if is_gated_mlp(module):
            key = (cls, type(module.act_fn), getattr(module.gate_proj, "bias", None) is not None)
            if key not in self.verdicts:
                self.verdicts[key] = gated_mlp_qualifies(cls, module.act_fn, key[2])
            return self.verdicts[key]
        return False

    def lean_forward(self, module: nn.Module) -> tuple[str, Callable] | None:
        """(its kind, its lean forward, unbound) for ``module``; None where it keeps its own."""
        if "forward" in vars(module):  # (lean already: a nested context)
            return None
        if type(module) is nn.Linear:
            return "linear", self.casts.linear_forward
        if self.qualifies(module):
            return ("rmsnorm", lean_rmsnorm_forward) if is_rmsnorm(module) else ("swiglu", lean_swiglu_forward)
        return None

    @contextmanager
    def active(self, model: nn.Module):
        """Yields how many modules of each kind run lean (``rmsnorm``, ``swiglu``, ``linear``)."""
        lean = [(module, found) for module in model.modules() if (found := self.lean_forward(module))]
        for module, (_, forward) in lean:
            object.__setattr__(module, "forward", MethodType(forward, module))
        try:
            yield Counter(kind for _, (kind, _) in lean)
        finally:
            for module, _ in lean:
                object.__delattr__(module, "forward")
