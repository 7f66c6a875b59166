"""DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale")."""

from __future__ import annotations

from lit_gspo.rl.objectives.ppo import PPOClip


class DAPO(PPOClip):
    """GRPO with clip-higher, token-level averaging over the whole step and dynamic sampling.

        ℓ_{i,t} = −min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε_low, 1 + ε_high) Â_i )
        loss = Σ_i Σ_t ℓ_{i,t} / Σ_i |y_i|                            (``token-mean``)

    ε_low = 0.2, ε_high = 0.28. Dynamic sampling (drop groups whose rewards are all equal, refill the
    batch) is the collect stage's ``model.sampling.dynamic``, on by default with DAPO
    (``paper_dynamic_sampling``); overlong reward shaping is the reward ``lit_gspo.rl.rewards.OverlongPenalty``.
    """

    name = "dapo"
    default_clip_low = 0.2
    default_clip_high = 0.28
    default_aggregation = "token-mean"
    paper_dynamic_sampling = True
