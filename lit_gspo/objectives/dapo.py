"""DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale")."""

from __future__ import annotations

from lit_gspo.objectives.ppo import PPO


class DAPO(PPO):
    """GRPO with clip-higher, token-level averaging over the whole step and dynamic sampling.

        ℓ_{i,t} = −min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε_low, 1 + ε_high) Â_i )
        loss = Σ_i Σ_t ℓ_{i,t} / Σ_i |y_i|                            (``token-mean``)

    ε_low = 0.2, ε_high = 0.28; ``dynamic_sampling``: the trainer drops groups whose rewards are all
    equal and refills the batch. Overlong reward shaping is ``lit_gspo.advantages.overlong_penalty``.
    """

    name = "dapo"
    default_clip_low = 0.2
    default_clip_high = 0.28
    default_aggregation = "token-mean"
    advantage_estimator = "group"
    needs_critic = False
    dynamic_sampling = True
