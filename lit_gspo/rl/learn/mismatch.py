"""Rollout-mismatch correction: the sampler is not numerically the trainer; one layer for every objective.

    δ_t = log π_old(y_t) − log π_sampler(y_t)     π_old: the trainer's forward before the update;
                                                   π_sampler: the engine's own log-probs (``engine_logprobs``)
    before the update (``model.update.mismatch.corrections``, each on the rollout's own tokens):
        TIS            Â_t ← clamp(e^δ_t, L, C) · Â_t                          C = 2, L none
        SequenceTIS    Â_{i,t} ← clamp(ρ_i, L, C) · Â_{i,t}                    (TRL's sequence_truncate)
        MIS (IcePop)   token t masked when e^δ_t ∉ [α, β]                     [0.5, 5]
        SequenceMIS    sequence i masked when ρ_i > C, ρ_i = e^(Σ_t δ_t)       C = 3 (or the geometric mean
                       e^(Σ_t δ_t / |y_i|))
        weighted: true (MIS, SequenceMIS)  Â_t ← ρ · 1[ρ in the band] · Â_t     Yao et al.'s MIS, TRL's token_mask
                       and sequence_mask (TRL's default): kept tokens weighted by their ratio, the others by 0
    in each update step (its π_θ: the policy being updated, detached):
        OPSM           Â_{i,t} ← 0 where Â_{i,t} < 0 and (1/|y_i|) Σ_t log π_sampler(y_t)/π_θ(y_t) > δ    δ = 0.5

Token weights fold into the advantage: every built-in policy loss is Â times a non-negative factor of
the ratio (a positive weight keeps Â's sign, so clipping and SAPO's gate act as before); GSPO and
GMPO share one ratio per sequence, so there the weights act through their mean over the sequence.
Masks before the update set ``completion_mask`` to 0: masked tokens leave every normaliser, and a
sequence masked whole leaves the sequence count (verl's rejection sampling); a weighted MIS's 0 is a weight, so its
tokens stay in the normalisers (as TRL's). OPSM depends on π_θ, so
it acts in each micro-step as the paper writes it, on the advantage: its tokens stay in the normalisers.
``old_logprobs: sampler`` skips the trainer's old-policy pass: π_old = π_sampler, so the first
minibatch's ratio is π_θ/π_sampler (verl's bypass mode); TIS and MIS have nothing to correct then.
Every step logs ``mismatch/*``: k3 (KL(π_sampler ‖ π_old) per token), max and mean |δ|, shares masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from lit_gspo.rl.objectives.base import kl_penalty, log_ratio, masked_mean, masked_sum
from lit_gspo.rl.rollout import RolloutBatch


class Correction:
    """One correction; a subclass fills one hook. ``log_ratio`` is δ = log π_old − log π_sampler, (N, T)."""

    needs_trainer_old: ClassVar[bool] = True  # reads π_old of the trainer's pass (not OPSM)

    def weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        """(N, T) non-negative weights multiplying Â, or None."""
        return None

    def keep(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        """(N, T) bool: tokens kept, or None."""
        return None

    def clipped(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        """(N, T) bool: tokens whose weight is not their ratio (a truncation's), or None."""
        return None

    def keep_in_update(
        self, logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, advantages: Tensor
    ) -> Tensor | None:
        """(B, T) bool: tokens whose Â is kept in this update step (``logprobs``: π_θ, detached), or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def truncation_bounds(name: str, cap: float, low: float | None) -> tuple[float, float | None]:
    if not cap > 0 or (low is not None and not 0 <= low < cap):
        raise ValueError(f"{name} needs cap > 0 and 0 <= low < cap (or low null), got cap={cap}, low={low}")
    return float(cap), None if low is None else float(low)


def sequence_log_ratios(log_ratio: Tensor, mask: Tensor, ratio: str) -> Tensor:
    """(N,) log ρ_i: Σ_t δ_t (``product``) or Σ_t δ_t / |y_i| (``geometric``)."""
    seq = masked_sum(log_ratio, mask, dim=1)
    return seq / mask.sum(1).clamp(min=1) if ratio == "geometric" else seq


def check_sequence_ratio(name: str, ratio: str) -> str:
    if ratio not in ("product", "geometric"):
        raise ValueError(f"{name} ratio must be 'product' or 'geometric', got {ratio!r}")
    return ratio


class TIS(Correction):
    """Truncated importance sampling: Â_t ← clamp(ρ_t, low, cap) · Â_t, ρ_t = π_old(y_t)/π_sampler(y_t).

    Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; cap 2
    is verl's ``rollout_is_threshold`` default; ``low`` (none by default): TRL's ``token_truncate`` with its
    ``vllm_importance_sampling_clip_min``.
    """

    def __init__(self, cap: float = 2.0, low: float | None = None):
        self.cap, self.low = truncation_bounds("TIS", cap, low)

    def weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return log_ratio.exp().clamp(min=self.low, max=self.cap)  # (N, T)

    def clipped(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return self.weights(log_ratio, mask) != log_ratio.exp()


class SequenceTIS(Correction):
    """Sequence-level truncated IS: Â_{i,t} ← clamp(ρ_i, low, cap) · Â_{i,t}, one weight per sequence.

    ρ_i = exp(Σ_t δ_t)            ``ratio: product``   (TRL's ``vllm_importance_sampling_mode: sequence_truncate``)
    ρ_i = exp(Σ_t δ_t / |y_i|)    ``ratio: geometric``

    A sequence-level objective (GSPO) sees one ratio per sequence; this weighs it by one IS weight too.
    """

    def __init__(self, cap: float = 2.0, low: float | None = None, ratio: str = "product"):
        self.cap, self.low = truncation_bounds("SequenceTIS", cap, low)
        self.ratio = check_sequence_ratio("SequenceTIS", ratio)

    def sequence_ratios(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return sequence_log_ratios(log_ratio, mask, self.ratio).exp()[:, None].expand_as(mask)  # (N, T)

    def weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return self.sequence_ratios(log_ratio, mask).clamp(min=self.low, max=self.cap)

    def clipped(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return self.weights(log_ratio, mask) != self.sequence_ratios(log_ratio, mask)


class MIS(Correction):
    """Masked importance sampling (IcePop): token t masked when ρ_t = π_old(y_t)/π_sampler(y_t) ∉ [low, high].

    Defaults [0.5, 5]: IcePop's band (Ling team, 2025, "Every Step Evolves"; verl's ``token_k1``
    rejection); the bounds themselves are kept. ``weighted``: Â_t ← ρ_t · 1[low ≤ ρ_t ≤ high] · Â_t instead, the
    masked tokens staying in the normalisers with weight 0 (Yao et al.'s MIS; TRL's ``token_mask`` with
    ``vllm_importance_sampling_clip_min``/``clip_max`` as ``low``/``high``).
    """

    def __init__(self, low: float = 0.5, high: float = 5.0, weighted: bool = False):
        if not 0 <= low < high:
            raise ValueError(f"MIS needs 0 <= low < high, got low={low}, high={high}")
        self.low, self.high, self.weighted = float(low), float(high), weighted

    def band(self, log_ratio: Tensor) -> Tensor:
        ratio = log_ratio.exp()  # (N, T)
        return (ratio >= self.low) & (ratio <= self.high)

    def keep(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        return None if self.weighted else self.band(log_ratio)

    def weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        return log_ratio.exp() * self.band(log_ratio) if self.weighted else None


class SequenceMIS(Correction):
    """Sequence-level masked IS: sequence i masked when its ratio ρ_i > cap (or < low).

    ρ_i = exp(Σ_t δ_t)            ``ratio: product``   (the sum of its tokens' log-ratios, as TRL's ``sequence_mask``)
    ρ_i = exp(Σ_t δ_t / |y_i|)    ``ratio: geometric`` (verl's ``seq_mean_k1``)

    ``weighted``: Â_{i,t} ← ρ_i · 1[low ≤ ρ_i ≤ cap] · Â_{i,t} instead, a masked sequence staying in the normalisers
    with weight 0: TRL's ``vllm_importance_sampling_mode: sequence_mask`` (its default, ``clip_max`` 3) exactly, with
    ``ratio: product``.
    """

    def __init__(self, cap: float = 3.0, low: float | None = None, ratio: str = "product", weighted: bool = False):
        self.cap, self.low = truncation_bounds("SequenceMIS", cap, low)
        self.ratio, self.weighted = check_sequence_ratio("SequenceMIS", ratio), weighted

    def band(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        seq = sequence_log_ratios(log_ratio, mask, self.ratio)
        keep = seq <= math.log(self.cap)
        if self.low is not None:
            keep &= seq >= (math.log(self.low) if self.low > 0 else -math.inf)
        return keep[:, None].expand_as(mask)

    def keep(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        return None if self.weighted else self.band(log_ratio, mask)

    def weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor | None:
        if not self.weighted:
            return None
        rho = sequence_log_ratios(log_ratio, mask, self.ratio).exp()[:, None].expand_as(mask)
        return rho * self.band(log_ratio, mask)


class OPSM(Correction):
    """Off-policy sequence masking (DeepSeek-AI, 2025, DeepSeek-V3.2, eq. 9), in every update step:

        M_{i,t} = 0  if Â_{i,t} < 0 and (1/|y_i|) Σ_t log( π_sampler(y_t) / π_θ(y_t) ) > δ,   else 1

    π_θ is the policy being updated (detached), so drift from earlier minibatches counts too. The paper
    gives no δ; 0.5 is TRL's suggestion (``off_policy_mask_threshold``).
    """

    needs_trainer_old = False

    def __init__(self, delta: float = 0.5):
        if not delta >= 0:
            raise ValueError(f"OPSM delta must be >= 0 (nats per token), got {delta}")
        self.delta = float(delta)

    def keep_in_update(self, logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, advantages: Tensor) -> Tensor:
        drift = masked_mean(sampler_logprobs - logprobs.detach(), mask, dim=1)  # (B,)
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
        return ~((drift > self.delta)[:, None] & (adv < 0))  # (B, T)


OLD_LOGPROBS = ("trainer", "sampler")


@dataclass
class Mismatch:
    """``model.update.mismatch``: measure the sampler–trainer mismatch every step and apply ``corrections``.

    corrections: any of ``TIS``, ``SequenceTIS``, ``MIS``, ``SequenceMIS``, ``OPSM`` (class paths in
        ``lit_gspo.rl.learn.mismatch``), applied together; empty: measure only.
    old_logprobs: ``trainer`` (the trainer's forward before the update is π_old) or ``sampler`` (the
        engine's log-probs are π_old: no old-policy pass; only OPSM applies).
    """

    corrections: list[Correction] = field(default_factory=list)
    old_logprobs: str = "trainer"

    def __post_init__(self):
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"mismatch.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        for c in self.corrections:
            if not isinstance(c, Correction):
                raise ValueError(
                    "mismatch.corrections takes TIS, SequenceTIS, MIS, SequenceMIS or OPSM (lit_gspo.rl.learn.mismatch), "
                    f"got {c!r}"
                )
        needing = [type(c).__name__ for c in self.corrections if c.needs_trainer_old]
        if self.sampler_is_old and needing:
            raise ValueError(
                f"mismatch.old_logprobs='sampler' makes π_old the sampler: {', '.join(needing)} would "
                "correct π_old/π_sampler = 1 (nothing); use old_logprobs='trainer', or only OPSM"
            )

    @property
    def sampler_is_old(self) -> bool:
        return self.old_logprobs == "sampler"

    @property
    def needs_trainer_old(self) -> bool:
        """Whether the trainer's old-policy pass must run over every row before the update."""
        return not self.sampler_is_old

    def before_update(self, rollout: RolloutBatch) -> tuple[RolloutBatch, Tensor, list[tuple[dict, float]]]:
        """A copy of ``rollout`` with corrected advantages and loss mask (or π_old = π_sampler).

        Returns (rollout, emptied, records): ``emptied`` (N,) bool marks sequences the masks emptied (they
        leave the sequence count); ``records`` are (metrics, weight) pairs for the step's weighted means.
        """
        sampler = sampler_logprobs(rollout)
        if self.sampler_is_old:
            return replace(rollout, old_logprobs=sampler.clone()), torch.zeros(len(rollout), dtype=torch.bool), []
        if rollout.old_logprobs is None:
            raise ValueError(
                "mismatch corrections compare the trainer's old log-probs with the sampler's: run "
                "Learner.snapshot(rollout) (with this mismatch) before learn"
            )
        mask = rollout.completion_mask
        delta = log_ratio(rollout.old_logprobs, sampler)  # (N, T), clamped to ±20
        weights, keep, truncated = None, mask.clone(), torch.zeros_like(mask)
        zeroed = torch.zeros_like(mask)  # weighted to 0 (a weighted MIS's mask): counted as masked, kept in normalisers
        for c in self.corrections:
            w, k = c.weights(delta, mask), c.keep(delta, mask)
            if w is not None:
                weights = w if weights is None else weights * w
                if getattr(c, "weighted", False):  # a weighted mask: its 0s are masked tokens
                    zeroed |= w == 0
            clipped = c.clipped(delta, mask)  # a truncation's (TIS, SequenceTIS): weights other than the ratio
            if clipped is not None:
                truncated |= clipped
            if k is not None:
                keep &= k
        emptied = mask.any(1) & ~keep.any(1)  # (N,)
        token_metrics = mismatch_metrics(rollout.old_logprobs, sampler, mask)
        token_metrics.update(
            {
                "mismatch/truncated_token_frac": masked_mean(truncated.float(), mask),
                "mismatch/masked_token_frac": masked_mean((~keep | zeroed).float(), mask),
            }
        )
        has_tokens = mask.any(1)
        seq_metrics = {"mismatch/masked_seq_frac": emptied[has_tokens].float().mean() if has_tokens.any() else 0.0}
        advantages = rollout.advantages
        if weights is not None:  # (N, T): Â_t · w_t
            advantages = (advantages if advantages.dim() == 2 else advantages[:, None]) * weights
        corrected = replace(rollout, advantages=advantages, completion_mask=keep)
        records = [
            ({k: float(v) for k, v in token_metrics.items()}, float(mask.sum())),
            ({k: float(v) for k, v in seq_metrics.items()}, float(mask.any(1).sum())),
        ]
        return corrected, emptied, records

    def in_update(self, micro: RolloutBatch, logprobs: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The micro-batch's advantages with OPSM (π_θ = ``logprobs``) applied, and its shares masked."""
        advantages, metrics = micro.advantages, {}
        for c in self.corrections:
            keep = c.keep_in_update(logprobs, sampler_logprobs(micro), micro.completion_mask, advantages)
            if keep is None:
                continue
            adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(keep)
            advantages = torch.where(keep, adv, torch.zeros((), dtype=adv.dtype, device=adv.device))
            dropped = micro.completion_mask & ~keep
            metrics[f"mismatch/{type(c).__name__.lower()}_masked_token_frac"] = float(
                masked_mean(dropped.float(), micro.completion_mask)
            )
        return advantages, metrics


def sampler_logprobs(rollout: RolloutBatch) -> Tensor:
    if rollout.engine_logprobs is None:
        raise ValueError(
            "model.update.mismatch needs the sampler's log-probs of the sampled tokens (RolloutBatch.engine_logprobs), "
            "but the engine returned none: use an engine whose generate returns them (HFGenerate, LeanSampler)"
        )
    return rollout.engine_logprobs.float()


def mismatch_metrics(logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per valid token: k3 estimate of KL(π_sampler ‖ π) (tokens were sampled from π_sampler), max and mean |δ|."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    logprobs, sampler_logprobs = (
        torch.where(mask, logprobs.float(), zero),
        torch.where(mask, sampler_logprobs.float(), zero),
    )
    abs_delta = (logprobs - sampler_logprobs).abs()
    k3 = kl_penalty(sampler_logprobs.double(), logprobs.double(), "k3").float()  # fp64: e^x − x − 1 of a tiny x
    return {
        "mismatch/k3": masked_mean(k3, mask),
        "mismatch/log_ratio_abs_mean": masked_mean(abs_delta, mask),
        "mismatch/log_ratio_abs_max": abs_delta.max() if mask.any() else zero,
    }
