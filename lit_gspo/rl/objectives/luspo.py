"""LUSPO (Liu, Yin et al., 2026, "Length-Unbiased Sequence Policy Optimization: Revealing and Controlling
Response Length Variation in RLVR", arXiv:2602.05261)."""

from __future__ import annotations

from lit_gspo.rl.objectives.base import Aggregation, KLEstimator
from lit_gspo.rl.objectives.gspo import GSPO


class LUSPO(GSPO):
    """GSPO with each sequence's loss multiplied by its length: GSPO's ratio and clip, another aggregation.

        s_i = exp( Σ_t m_t (logp_t − old_logp_t) / |y_i| )
        ℓ_i = −min( s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i )
        loss = Σ_i |y_i| · ℓ_i / N_seqs                                 (= GSPO with ``seq-mean-token-sum``)

    GSPO's per-sequence mean gives every sequence the same total gradient, so each token of a long
    answer weighs less than one of a short answer and response length collapses; the |y_i| factor
    removes that bias. It is nothing but an aggregation: ``GSPO(aggregation="seq-mean-token-sum")``
    with these ε computes the same loss, clipping and gradient.

    Defaults ε_low 2e-3, ε_high 2.5e-3 (the paper's Section 5.1, as TRL's docs quote). TRL's
    ``loss_type="luspo"`` divides by its micro-batch's sequence count (and the accumulation steps);
    here N_seqs is the whole step's.
    """

    name = "luspo"

    def __init__(
        self,
        clip_low: float = 2e-3,
        clip_high: float = 2.5e-3,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        aggregation: Aggregation = "seq-mean-token-sum",
    ):
        super().__init__(clip_low, clip_high, beta, kl_estimator, aggregation)
