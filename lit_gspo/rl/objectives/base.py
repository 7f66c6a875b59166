"""The objective contract: ``Objective``, the registry, ``LossOutput`` and the shared pieces.

An objective maps per-token log-probabilities of the current policy, the old (rollout-time) policy
and advantages to a scalar loss. Everything here is pure tensor math in fp32; no Lightning.

Normalisers are passed in, never guessed per micro-batch: ``Counts`` holds the number of valid
tokens and of sequences in the *whole optimisation step* (all micro-batches, all ranks). With it,
the gradient of a batch equals the sum of the gradients of its micro-batches.

Padding and non-finite values: anything outside the mask (even inf/NaN) is ignored and gets a zero
gradient. A non-finite log-prob, advantage, reference log-prob, value or return *inside* the mask
raises ``ValueError`` naming the tensor and the first (row, token): a NaN there is a bug upstream
and must not be averaged silently into the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import Tensor

from lit_gspo.runtime.registry import Registered, snake_case

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = Aggregation.__args__  # type: ignore[attr-defined]
KLEstimator = Literal["k1", "k2", "k3", "k3_is"]
KL_ESTIMATORS: tuple[str, ...] = KLEstimator.__args__  # type: ignore[attr-defined]

OBJECTIVES: dict[str, type[Objective]] = {}


@dataclass(frozen=True)
class Counts:
    """Normalisers of one optimisation step, summed over its micro-batches and ranks.

    tokens: valid (mask = 1) completion tokens; seqs: completions; max_len: the constant length L
    of ``seq-mean-token-sum-norm`` (Dr. GRPO divides every sequence's token sum by it).
    """

    tokens: float
    seqs: float
    max_len: float

    @staticmethod
    def of(mask: Tensor, max_len: float | None = None) -> Counts:
        """Counts of a single batch (the default when the caller passes none)."""
        return Counts(tokens=float(mask.sum()), seqs=float(mask.shape[0]), max_len=float(max_len or mask.shape[1]))


@dataclass
class LossOutput:
    """``loss``: scalar with gradient to ``logprobs``; ``metrics``: detached scalars for logging."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask``; values outside the mask (even inf/NaN) never leak in."""
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over valid entries; 0 where there are none (never NaN)."""
    return masked_sum(x, mask, dim) / mask.sum(dim if dim is not None else None).clamp(min=1)


MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ±20 before ``exp`` (as verl does): e^20 ≈ 5e8 keeps ratios, products
and their gradients finite in fp32; the clamp only bites absurdly far off-policy."""


def log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """logp − old_logp clamped to ±``MAX_LOG_RATIO`` (zero gradient beyond, finite everywhere)."""
    return (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip loss ℓ = −min(r Â, clip(r, 1 − ε_low, 1 + ε_high) Â), elementwise.

    Returns (loss, clipped_low, clipped_high): the masks of entries whose gradient the clip zeroes,
    i.e. Â < 0 with r < 1 − ε_low, and Â > 0 with r > 1 + ε_high.
    """
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    clipped_low = (advantages < 0) & (ratio < 1 - clip_low)
    clipped_high = (advantages > 0) & (ratio > 1 + clip_high)
    return loss, clipped_low, clipped_high


def aggregate(loss: Tensor, mask: Tensor, mode: str, counts: Counts) -> Tensor:
    """Reduce a per-token loss (B, T) to the scalar of this micro-batch's share of the step.

    token-mean:               Σ_i Σ_t m ℓ / N_tokens
    seq-mean-token-mean:      Σ_i (Σ_t m ℓ / |y_i|) / N_seqs
    seq-mean-token-sum:       Σ_i Σ_t m ℓ / N_seqs
    seq-mean-token-sum-norm:  Σ_i Σ_t m ℓ / (N_seqs · L)       (Dr. GRPO)
    N_tokens and N_seqs count the whole step, so micro-batch losses add up to the batch loss.
    """
    per_seq = masked_sum(loss, mask, dim=1)  # (B,)
    if mode == "token-mean":
        return per_seq.sum() / max(counts.tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(1).clamp(min=1)).sum() / max(counts.seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(counts.seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / max(counts.seqs * counts.max_len, 1.0)
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, old_logprobs: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1, k2, k3), or of π_old (k3_is).

    k1 = logp − ref;  k2 = ½(logp − ref)²;  k3 = e^(ref − logp) − (ref − logp) − 1;
    k3_is = (π_θ/π_old) · k3: the samples are π_old's, and its gradient is the reverse KL's whole gradient, the ratio's
    included (it is 1 on-policy, its gradient is not): DeepSeek-V3.2's unbiased KL estimate, TRL's
    ``use_bias_correction_kl`` (with its token-level ratio).
    """
    if estimator == "k3_is":
        if old_logprobs is None:
            raise ValueError("kl_estimator 'k3_is' weights k3 by π_θ/π_old: it needs the old log-probs")
        return torch.exp(log_ratio(logprobs, old_logprobs)) * kl_penalty(logprobs, ref_logprobs, "k3")
    difference = logprobs - ref_logprobs
    if estimator == "k1":
        return difference
    if estimator == "k2":
        return 0.5 * difference.square()
    if estimator == "k3":
        neg = (-difference).clamp(max=20.0)  # e^20 keeps fp32 finite; the clamp only bites far off-policy
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


class Objective(Registered, register=False):
    """Base class of every policy objective.

    A subclass gives its paper's hyperparameters as its ``__init__``'s defaults (``GSPO(clip_low=3e-4, ...)``;
    without an ``__init__``, the ones below: ε 0.2/0.2, ``token-mean``) and implements :meth:`policy_loss`.
    Subclasses register themselves under ``name`` (default: the class name in snake_case), so a
    new algorithm is one class; ``get_objective(name)`` and LightningCLI (by class name or class
    path) both find it.

    Class attributes (facts about the algorithm, not settings):
      needs_critic: the loss trains a value head on ``values``/``old_values``/``returns`` (PPO)
      zero_advantage_has_no_gradient: ``policy_loss`` is 0 with zero gradient on a row whose Â is 0,
        so the trainer may skip such rows (set it only if that holds: it is tested for the built-ins)
      paper_advantage: the advantage estimator of the paper (``lit_gspo.rl.advantages`` name: ``group``,
        ``group_mean``, ``rloo``, ``gae``), used when ``model.advantage`` is not set
      paper_dynamic_sampling: whether the paper drops all-equal groups and refills (DAPO), used when
        ``model.generation.dynamic_sampling`` is not set
    The settings themselves live on the stage that uses them: the loss's hyperparameters here, the
    advantage estimator on ``model.advantage``, dynamic sampling on ``model.generation.dynamic_sampling``.

    Args:
        clip_low: ε_low: ratios below 1 − ε_low are clipped (each objective's default is its paper's).
        clip_high: ε_high: ratios above 1 + ε_high are clipped (each objective's default is its paper's).
        beta: β, the weight of the KL penalty to the reference policy (0: none).
        kl_estimator: the per-token KL estimator of the penalty (Schulman's ``k1``, ``k2``, ``k3``; ``k3_is``: k3
            weighted by π_θ/π_old, the unbiased estimate, as TRL's ``use_bias_correction_kl``; :func:`kl_penalty`).
        aggregation: how per-token losses reduce to the step's loss (``token-mean``: over all tokens;
            ``seq-mean-token-mean``: per sequence, then over sequences; ``seq-mean-token-sum``;
            ``seq-mean-token-sum-norm``: Dr. GRPO's constant length).
    """

    registry, kind = OBJECTIVES, "objective"
    name: ClassVar[str] = "objective"
    needs_critic: ClassVar[bool] = False
    zero_advantage_has_no_gradient: ClassVar[bool] = False
    paper_advantage: ClassVar[str] = "group"
    paper_dynamic_sampling: ClassVar[bool] = False

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
    ):
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.beta = float(beta)
        self.kl_estimator = kl_estimator
        self.aggregation = aggregation
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low and clip_high must be >= 0, got {self.clip_low} and {self.clip_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(clip_low={self.clip_low}, clip_high={self.clip_high}, beta={self.beta}, "
            f"kl_estimator={self.kl_estimator!r}, aggregation={self.aggregation!r})"
        )

    # -- the one method a new algorithm writes -------------------------------------------------
    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        """Policy-gradient loss of this micro-batch. Inputs are validated fp32, padding zeroed,
        ``advantages`` already (B, T). Must return metrics with at least ``clip_frac``."""
        raise NotImplementedError

    # -- shared plumbing ------------------------------------------------------------------------
    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        counts: Counts | None = None,
        ref_logprobs: Tensor | None = None,
        **extra,
    ) -> LossOutput:
        """loss = policy_loss + β · aggregate(KL(π_θ ‖ π_ref)).

        Shapes: logprobs, old_logprobs, mask (B, T); advantages (B,) or (B, T). ``counts`` are the
        normalisers of the whole optimisation step (default: this batch alone).
        """
        mask = _check_inputs(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            ref_logprobs,
            {k: extra[k] for k in ("values", "old_values", "returns") if extra.get(k) is not None},
        )
        counts = counts or Counts.of(mask)
        zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
        logprobs = torch.where(mask, logprobs.float(), zero)
        old_logprobs = torch.where(mask, old_logprobs.float(), zero)
        advantages = advantages.float()
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logprobs)
        advantages = torch.where(mask, advantages, zero)
        for key in ("values", "old_values", "returns"):
            if extra.get(key) is not None:
                extra[key] = torch.where(mask, extra[key].float(), zero)
        out = self.policy_loss(logprobs, old_logprobs, advantages, mask, counts, **extra)
        if self.beta > 0:
            if ref_logprobs is None:
                raise ValueError(f"{type(self).__name__} has beta={self.beta} > 0 but no ref_logprobs were passed")
            ref = torch.where(mask, ref_logprobs.float(), zero)
            kl = kl_penalty(logprobs, ref, self.kl_estimator, old_logprobs)
            kl_loss = aggregate(kl, mask, self.aggregation, counts)
            out.loss = out.loss + self.beta * kl_loss
            out.metrics["kl"] = masked_mean(kl.detach(), mask)
        elif ref_logprobs is not None:
            ref = torch.where(mask, ref_logprobs.float(), zero)
            out.metrics["kl"] = masked_mean(kl_penalty(logprobs.detach(), ref, self.kl_estimator, old_logprobs), mask)
        return out


def token_ratio_metrics(ratio: Tensor, mask: Tensor, clipped_low: Tensor, clipped_high: Tensor) -> dict[str, Tensor]:
    """clip_frac(_low/_high): share of valid tokens whose policy gradient clipping zeroes; ratio stats."""
    ratio = ratio.detach()
    return {
        "clip_frac": masked_mean((clipped_low | clipped_high).float(), mask),
        "clip_frac_low": masked_mean(clipped_low.float(), mask),
        "clip_frac_high": masked_mean(clipped_high.float(), mask),
        **ratio_stats(ratio, mask),
    }


def ratio_stats(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean, min and max of ``ratio`` where ``mask`` (1 each where it is empty), left on the device: choosing by
    ``torch.where`` rather than ``if mask.any()``, which would read the mask on the host between forward and backward."""
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    if not ratio.numel():  # (the reductions below have no identity)
        return {"ratio_mean": one, "ratio_min": one, "ratio_max": one}
    some = mask.any()
    return {
        "ratio_mean": torch.where(some, masked_mean(ratio, mask), one),
        "ratio_min": torch.where(some, torch.where(mask, ratio, float("inf")).min(), one),
        "ratio_max": torch.where(some, torch.where(mask, ratio, float("-inf")).max(), one),
    }


def sequence_ratio_metrics(
    seq_ratio: Tensor, mask: Tensor, clipped_low: Tensor, clipped_high: Tensor
) -> dict[str, Tensor]:
    """Metrics of a sequence-level objective: clip fractions over valid tokens (every token of a
    clipped sequence counts), ratio statistics over the (B,) sequence ratios of non-empty rows."""
    seq_ratio = seq_ratio.detach()
    has_tokens = mask.any(1)  # (B,)
    return {
        "clip_frac": masked_mean((clipped_low | clipped_high).float(), mask),
        "clip_frac_low": masked_mean(clipped_low.float(), mask),
        "clip_frac_high": masked_mean(clipped_high.float(), mask),
        **ratio_stats(seq_ratio, has_tokens),
    }


def get_objective(name: str, **hparams) -> Objective:
    """Build a registered objective by name (``gspo``) or class name (``GSPO``)."""
    key = name if name in OBJECTIVES else snake_case(name)
    if key not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; registered: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[key](**hparams)


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    others: dict[str, Tensor] | None = None,
) -> Tensor:
    """Validate shapes and finiteness inside the mask; return the mask as bool."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    shapes = {"old_logprobs": old_logprobs, "mask": mask}
    if ref_logprobs is not None:
        shapes["ref_logprobs"] = ref_logprobs
    shapes.update(others or {})
    for key, tensor in shapes.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{key} has shape {tuple(tensor.shape)} but logprobs has {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(
            f"advantages must be (B,) = {tuple(logprobs.shape[:1])} or (B, T) = "
            f"{tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    mask = mask.bool()
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    checked = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": adv}
    checked.update({k: v for k, v in shapes.items() if k != "mask" and k != "old_logprobs"})
    finite = torch.stack([torch.isfinite(tensor.detach()) for tensor in checked.values()]).all(0)
    if bool((mask & ~finite).any()):  # one read of the device for all of them; the culprit named below
        for key, tensor in checked.items():
            bad = mask & ~torch.isfinite(tensor.detach())
            if not bad.any():
                continue
            where = bad.nonzero()[0].tolist()
            raise ValueError(
                f"{key} has {int(bad.sum())} non-finite value(s) inside the mask, first at (row, token) "
                f"= {tuple(where)}: {tensor.detach()[tuple(where)].item()}"
            )
    return mask
