"""The LM head: fp32 logits z = m(h Wᵀ + b), and log π(y) = z_y − logsumexp(z) without the (B, c, V) log-softmax.

m is what the model's forward does to its head's output (a scale, a soft cap: ``logit_map.py``; the identity for most).

Log-probs, ratios and their reductions are fp32. The head's matmul has fp32 precision too, in one of two ways:

- ``fp32``: one fp32 GEMM. What the CPU runs, and CUDA outside bf16 (autocast or weights).
- ``bf16x3``: on CUDA under bf16 autocast (Lightning's ``bf16-mixed``). There an fp32 GEMM runs at about 1/15 of the
  bf16 tensor cores' rate, and the head (V × H) is a small model's largest matmul (Qwen3-0.6B: 156M of its 596M
  parameters, 0.3 GFLOP a token forward). Each fp32 operand is split into two bf16 parts, x = x_hi + x_lo with
  x_hi = bf16(x) and x_lo = bf16(x − x_hi), and three bf16 GEMMs that accumulate and return fp32 give

      z ≈ h_hi W_hiᵀ + h_hi W_loᵀ + h_lo W_hiᵀ      (the dropped h_lo W_loᵀ is ~2⁻¹⁶ of z's terms)

  A bf16 product is exact in fp32, so only the splits round: measured on SmolLM2-135M's trained head, the log-probs
  are within 5.3e-5 of fp64's (fp32's: 2.3e-5; one bf16 GEMM with fp32 output: 3.3e-2). Backward, ∂h = ∂z W and
  ∂W = ∂zᵀ h are one bf16 GEMM each with fp32 output: gradients at bf16 precision, as autocast gives the decoder's.
  An operand already in bf16 has no low part: with ``bf16-true`` weights and states, one GEMM whose products and fp32
  sums are the fp32 GEMM's.

Chunks of positions share one :class:`HeadWeights` (W is split once per forward, not once per chunk).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_gspo.rl.logit_map import LogitMap


class HeadWeights(NamedTuple):
    """The head's weight (V, H) and bias; ``hi``/``lo``: the weight's bf16 parts when the head runs as bf16x3;
    ``logit_map``: what the model's forward does to h Wᵀ + b."""

    weight: Tensor
    bias: Tensor | None = None
    hi: Tensor | None = None
    lo: Tensor | None = None
    logit_map: LogitMap = LogitMap()


def head_weights(head: nn.Module, logit_map: LogitMap = LogitMap()) -> HeadWeights:
    """The weights ``head_logits`` uses, split into bf16 parts where :func:`head_precision` says bf16x3."""
    weight, bias = head.weight, head.bias
    if head_precision(weight.device, weight.dtype) == "fp32":  # a bf16 weight cast once, not once per chunk
        return HeadWeights(weight.float(), bias, logit_map=logit_map)
    hi, lo = bf16_parts(weight.detach())
    return HeadWeights(weight, bias, hi, lo, logit_map)


def head_precision(device: torch.device, weight_dtype: torch.dtype = torch.float32) -> str:
    """``bf16x3`` on a device with bf16 GEMMs returning fp32, while bf16 autocast is on there or the weights are bf16
    (``bf16-true``: then one GEMM, the fp32 GEMM's numbers); else ``fp32``."""
    bf16_autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
    bf16 = bf16_autocast or weight_dtype == torch.bfloat16
    return "bf16x3" if bf16 and gemm_bf16_to_fp32_exists(device.type) else "fp32"


@cache
def gemm_bf16_to_fp32_exists(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 ``a``, ``b`` on this device type (CUDA)."""
    if device_type != "cuda":
        return False  # the CPU has no such kernel; emulating it costs three fp32 GEMMs
    try:  # the calls the head makes: h Wᵀ (forward), ∂z W and ∂zᵀ h (backward), on transposed views; no RNG drawn
        h, w, z = (
            (torch.arange(r * c, device=device_type) % 5 - 2).reshape(r, c).to(torch.bfloat16)
            for r, c in ((3, 8), (5, 8), (3, 5))
        )
        pairs = ((h, w.t()), (z, w), (z.t(), h))
        with torch.autocast(device_type, enabled=False):  # asked first under the fit's autocast
            return all(torch.equal(torch.mm(a, b, out_dtype=torch.float32), a.float() @ b.float()) for a, b in pairs)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def bf16_parts(x: Tensor) -> tuple[Tensor, Tensor | None]:
    """x = hi + lo to ~2⁻¹⁶ relative, both bf16; a bf16 ``x`` is its own ``hi`` (no ``lo``)."""
    if x.dtype == torch.bfloat16:
        return x, None
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def matmul_fp32_out(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for bf16 ``a`` (n, k) and ``b`` (k, m), accumulated and returned in fp32.

    On CUDA one bf16 GEMM; elsewhere the same numbers from an fp32 GEMM of the (exactly representable) bf16 values.
    """
    if gemm_bf16_to_fp32_exists(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _Bf16x3Linear(torch.autograd.Function):
    """z = h Wᵀ as h_hi W_hiᵀ + h_hi W_loᵀ + h_lo W_hiᵀ (fp32 out); backward one bf16 GEMM per input gradient."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, w_hi: Tensor, w_lo: Tensor | None) -> Tensor:
        h_hi, h_lo = bf16_parts(hidden)
        logits = matmul_fp32_out(h_hi, w_hi.t())
        if w_lo is not None:
            logits += matmul_fp32_out(h_hi, w_lo.t())
        if h_lo is not None:
            logits += matmul_fp32_out(h_lo, w_hi.t())
        ctx.save_for_backward(h_hi, w_hi)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return logits

    @staticmethod
    def backward(ctx, grad_logits: Tensor):
        h_hi, w_hi = ctx.saved_tensors
        grad = grad_logits.to(torch.bfloat16)
        grad_hidden = matmul_fp32_out(grad, w_hi).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = matmul_fp32_out(grad.t(), h_hi).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def head_logits(hidden: Tensor, head: HeadWeights, temperature: float = 1.0) -> Tensor:
    """fp32 logits (…, V) of ``hidden`` (…, H), the model's :class:`LogitMap` applied, divided by ``temperature``."""
    with torch.autocast(hidden.device.type, enabled=False):
        if head.hi is None:
            logits = F.linear(hidden.float(), head.weight.float())
        else:
            flat = _Bf16x3Linear.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.hi, head.lo)
            logits = flat.reshape(*hidden.shape[:-1], -1)
        if head.bias is not None:
            logits = logits + head.bias.float()
        logits = head.logit_map(logits)
        return logits if temperature == 1.0 else logits / temperature


def chunk_logprobs_and_entropy(
    hidden: Tensor,
    targets: Tensor,
    head: HeadWeights,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One LM-head matmul and one softmax serve the log-probs and the entropy."""
    return target_logprobs_and_entropy(head_logits(hidden, head, temperature), targets, with_entropy, entropy_grad)


def target_logprobs_and_entropy(
    logits: Tensor, targets: Tensor, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log softmax(z)[y] (with grad) and, if asked, the entropy of softmax(z), for (B, c, V) fp32 logits z; the entropy
    detached unless ``entropy_grad`` (an entropy bonus differentiates it)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, entropy = _TargetLogprob.apply(logits, targets, with_entropy or entropy_grad, entropy_grad)
        return logp, entropy if with_entropy or entropy_grad else None
    logp, lse = _target_logprob_and_lse(logits, targets)
    return logp, _entropy(logits, lse) if with_entropy or entropy_grad else None


def _target_logprob_and_lse(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(z_y − logsumexp(z), logsumexp(z)) without materialising the log-softmax."""
    lse = logits.logsumexp(-1)
    return logits.gather(-1, targets[..., None]).squeeze(-1) - lse, lse


class _TargetLogprob(torch.autograd.Function):
    """log p_y = z_y − logsumexp(z), keeping p = softmax(z) for backward: ∂ log p_y / ∂z = onehot(y) − p.

    Autograd's own graph for ``gather − logsumexp`` recomputes exp(z − lse) and fills a zero (B, c, V)
    buffer for the gather in backward; here backward is one multiply and one scatter. The entropy
    H = lse − Σ p·z comes from the same p: a diagnostic without gradient, or with ``entropy_grad``

        ∂H / ∂z = −p ⊙ (log p + H) = −p ⊙ (z − lse + H)

    for which z is kept instead of p (p recomputed in backward: still one (B, c, V) buffer).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, with_entropy: bool, entropy_grad: bool):
        logp, lse = _target_logprob_and_lse(logits, targets)
        probs = (logits - lse[..., None]).exp_()
        entropy = _entropy(logits, lse, probs) if with_entropy else logp.new_zeros(())
        ctx.entropy_grad = entropy_grad
        if entropy_grad:
            ctx.save_for_backward(logits, lse, entropy, targets)
        else:
            ctx.save_for_backward(probs, targets)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        if ctx.entropy_grad:
            logits, lse, entropy, targets = ctx.saved_tensors
            shifted = logits - lse[..., None]  # log p
            grad = shifted.exp() * -(grad_logp[..., None] + grad_entropy[..., None] * (shifted + entropy[..., None]))
        else:
            probs, targets = ctx.saved_tensors
            grad = probs * -grad_logp[..., None]
        grad.scatter_add_(-1, targets[..., None], grad_logp[..., None])
        return grad, None, None, None


@torch.no_grad()
def _entropy(logits: Tensor, lse: Tensor, probs: Tensor | None = None) -> Tensor:
    """H = −Σ p log p = lse − Σ p·z for p = softmax(z) (given, or computed from lse = logsumexp(z))."""
    if probs is None:
        probs = (logits - lse[..., None]).exp()
    return lse - (probs * logits).sum(-1)
