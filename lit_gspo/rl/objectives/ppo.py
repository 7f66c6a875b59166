"""PPO-clip (Schulman et al., 2017): the token-level surrogate GRPO, DAPO and Dr. GRPO reuse, and PPO with its critic."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_gspo.rl.objectives.base import (
    Aggregation,
    Counts,
    KLEstimator,
    LossOutput,
    Objective,
    aggregate,
    clipped_surrogate,
    log_ratio,
    masked_mean,
    token_ratio_metrics,
)


class PPOClip(Objective, register=False):
    """PPO's clipped surrogate per token, optional dual clip; no critic.

        r_t = exp(logp_t − old_logp_t)
        ℓ_t = −min( r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t )
        dual clip c > 1 (Â_t < 0 only):  ℓ_t = min( ℓ_t, −c Â_t )     (caps the loss when r_t ≫ 1)
        loss = aggregate(ℓ)

    Dual-clipped tokens count in ``clip_frac`` and ``clip_frac_high`` (their r_t is above the band
    and their gradient is zero) and alone in ``dual_clip_frac``. GRPO, DAPO and Dr. GRPO are this
    loss with their papers' ε, aggregation and advantage estimator.

    Args:
        dual_clip: the dual-clip constant c > 1 that caps the loss of Â < 0 tokens at −c Â (None: no dual clip).
    """

    zero_advantage_has_no_gradient = True  # every policy-loss term is a multiple of Â

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
        dual_clip: float | None = None,
    ):
        super().__init__(
            clip_low=clip_low, clip_high=clip_high, beta=beta, kl_estimator=kl_estimator, aggregation=aggregation
        )
        if dual_clip is not None and dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
        self.dual_clip = dual_clip

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, dual_clip={self.dual_clip})"

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        ratio = torch.exp(log_ratio(logprobs, old_logprobs))  # (B, T)
        loss, clipped_low, clipped_high = clipped_surrogate(ratio, advantages, self.clip_low, self.clip_high)
        dual = torch.zeros_like(mask)
        if self.dual_clip is not None:
            cap = -self.dual_clip * advantages  # (B, T), > 0 where Â < 0
            dual = (advantages < 0) & (loss > cap)
            loss = torch.where(dual, cap, loss)  # constant there: zero gradient
        metrics = token_ratio_metrics(ratio, mask, clipped_low, clipped_high | dual)
        metrics["dual_clip_frac"] = masked_mean(dual.float(), mask)
        return LossOutput(aggregate(loss, mask, self.aggregation, counts), metrics)


class PPO(PPOClip):
    """PPO-clip per token plus a clipped value loss on a critic's values.

        ℓ_t as in :class:`PPOClip`
        ℓ^V_t = ½ max( (V_t − R_t)², (clip(V_t, V_old,t − δ, V_old,t + δ) − R_t)² )
        loss = aggregate(ℓ) + vf_coef · aggregate(ℓ^V)          (same aggregation and Counts)

    Defaults: ε 0.2/0.2, ``token-mean``, δ (value_clip) 0.2, vf_coef 0.5; GAE advantages from the critic.
    ``value_clip_frac``: share of valid tokens whose value gradient the clip zeroes (V outside V_old ± δ
    and the clipped error the larger).
    """

    name = "ppo"
    paper_advantage = "gae"
    needs_critic = True

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
        dual_clip: float | None = None,
        value_clip: float | None = 0.2,
        vf_coef: float = 0.5,
    ):
        """
        Args:
            value_clip: δ: the value loss clips V to V_old ± δ (None: no value clip).
            vf_coef: weight of the value loss.
        """
        super().__init__(
            clip_low=clip_low,
            clip_high=clip_high,
            beta=beta,
            kl_estimator=kl_estimator,
            aggregation=aggregation,
            dual_clip=dual_clip,
        )
        if value_clip is not None and value_clip < 0:
            raise ValueError(f"value_clip must be >= 0 (or None), got {value_clip}")
        self.value_clip, self.vf_coef = value_clip, float(vf_coef)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, value_clip={self.value_clip}, vf_coef={self.vf_coef})"

    def policy_loss(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        counts: Counts,
        values: Tensor | None = None,
        old_values: Tensor | None = None,
        returns: Tensor | None = None,
        **extra,
    ) -> LossOutput:
        out = super().policy_loss(logprobs, old_logprobs, advantages, mask, counts)
        given = {"values": values, "old_values": old_values, "returns": returns}
        if any(v is not None for v in given.values()):
            missing = [k for k, v in given.items() if v is None]
            if missing:
                raise ValueError(f"the value loss needs values, old_values and returns; missing: {', '.join(missing)}")
            out.loss = out.loss + self.vf_coef * self._value_loss(
                values, old_values, returns, mask, counts, out.metrics
            )
        return out

    def _value_loss(
        self,
        values: Tensor,
        old_values: Tensor,
        returns: Tensor,
        mask: Tensor,
        counts: Counts,
        metrics: dict[str, Tensor],
    ) -> Tensor:
        unclipped = (values - returns).square()  # (B, T)
        if self.value_clip is None:
            clipped = unclipped
        else:
            # max(min(V, V_old + δ), V_old − δ) is V itself inside the band; V_old + clamp(V − V_old, ±δ) is not
            # always bit-equal to V there, and would count in-band tokens as clipped
            v_clip = torch.maximum(torch.minimum(values, old_values + self.value_clip), old_values - self.value_clip)
            clipped = (v_clip - returns).square()  # (B, T)
        value_loss = aggregate(0.5 * torch.maximum(unclipped, clipped), mask, self.aggregation, counts)
        metrics["value_loss"] = value_loss.detach()
        metrics["value_clip_frac"] = masked_mean((clipped > unclipped).float(), mask)
        return value_loss
