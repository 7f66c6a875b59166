"""DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale")."""

from __future__ import annotations

from lit_gspo.rl.objectives.base import Aggregation, KLEstimator
from lit_gspo.rl.objectives.ppo import PPOClip


class DAPO(PPOClip):
    """GRPO with clip-higher, token-level averaging over the whole step and dynamic sampling.

        ℓ_{i,t} = −min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε_low, 1 + ε_high) Â_i )
        loss = Σ_i Σ_t ℓ_{i,t} / Σ_i |y_i|                            (``token-mean``)

    ε_low = 0.2, ε_high = 0.28. Dynamic sampling (drop groups whose rewards are all equal, refill the
    batch) is the collect stage's ``model.generation.dynamic_sampling``, on by default with DAPO
    (``paper_dynamic_sampling``); overlong reward shaping is the reward ``lit_gspo.rl.rewards.OverlongPenalty``, and
    overlong filtering (the loss of truncated samples masked) is ``model.update.mask_truncated_completions``.
    """

    name = "dapo"
    paper_dynamic_sampling = True

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "token-mean",
        dual_clip: float | None = None,
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation, dual_clip)
