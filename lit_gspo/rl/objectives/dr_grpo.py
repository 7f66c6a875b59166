"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective")."""

from __future__ import annotations

from lit_gspo.rl.objectives.base import Aggregation, KLEstimator
from lit_gspo.rl.objectives.ppo import PPOClip


class DrGRPO(PPOClip):
    """GRPO without its two biases: no std division, no per-sequence length normalisation.

        Â_i = R_i − mean_group R                                     (``group_mean`` estimator)
        ℓ_{i,t} = −min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε, 1 + ε) Â_i )
        loss = Σ_i Σ_t ℓ_{i,t} / (N_seqs · L)                        (``seq-mean-token-sum-norm``)

    ε = 0.2; L is the constant ``Counts.max_len`` (pass the generation budget, not the padded width).
    """

    name = "dr_grpo"
    paper_advantage = "group_mean"

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-sum-norm",
        dual_clip: float | None = None,
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation, dual_clip)
