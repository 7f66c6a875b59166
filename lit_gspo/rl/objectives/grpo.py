"""GRPO (Shao et al., 2024, "DeepSeekMath")."""

from __future__ import annotations

from lit_gspo.rl.objectives.base import Aggregation, KLEstimator
from lit_gspo.rl.objectives.ppo import PPOClip


class GRPO(PPOClip):
    """PPO-clip per token with the group-relative advantage and no critic.

        Â_i = (R_i − mean_group R) / (std_group R + eps)              (every token of y_i)
        ℓ_{i,t} = −min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε, 1 + ε) Â_i ),  r_{i,t} = π_θ / π_old
        loss = (1/N_seqs) Σ_i (1/|y_i|) Σ_t ℓ_{i,t}                 (``seq-mean-token-mean``)

    ε = 0.2. The paper adds a k3 KL penalty with β = 0.04; here β defaults to 0 (pass ``beta``).
    """

    name = "grpo"

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-mean",
        dual_clip: float | None = None,
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation, dual_clip)
