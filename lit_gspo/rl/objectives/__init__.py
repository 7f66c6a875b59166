"""Policy objectives: one small class per algorithm, one registry.

from lit_gspo.rl.objectives import get_objective
loss = get_objective("gspo")(logprobs, old_logprobs, advantages, mask).loss
"""

from lit_gspo.rl.objectives.base import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    MAX_LOG_RATIO,
    OBJECTIVES,
    Aggregation,
    Counts,
    KLEstimator,
    LossOutput,
    Objective,
    aggregate,
    clipped_surrogate,
    get_objective,
    kl_penalty,
    log_ratio,
    masked_mean,
    masked_sum,
    sequence_ratio_metrics,
    token_ratio_metrics,
)
from lit_gspo.rl.objectives.cispo import CISPO
from lit_gspo.rl.objectives.clip_cov import ClipCov
from lit_gspo.rl.objectives.dapo import DAPO
from lit_gspo.rl.objectives.dppo import DPPO
from lit_gspo.rl.objectives.dr_grpo import DrGRPO
from lit_gspo.rl.objectives.gmpo import GMPO
from lit_gspo.rl.objectives.grpo import GRPO
from lit_gspo.rl.objectives.gspo import GSPO, GSPOToken
from lit_gspo.rl.objectives.kl_cov import KLCov
from lit_gspo.rl.objectives.luspo import LUSPO
from lit_gspo.rl.objectives.ppo import PPO, PPOClip
from lit_gspo.rl.objectives.sapo import SAPO
from lit_gspo.rl.objectives.vespo import VESPO

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "Aggregation",
    "KLEstimator",
    "OBJECTIVES",
    "Counts",
    "LossOutput",
    "Objective",
    "aggregate",
    "get_objective",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "MAX_LOG_RATIO",
    "clipped_surrogate",
    "log_ratio",
    "sequence_ratio_metrics",
    "token_ratio_metrics",
    "PPO",
    "PPOClip",
    "GRPO",
    "DAPO",
    "GSPO",
    "GSPOToken",
    "DrGRPO",
    "CISPO",
    "GMPO",
    "SAPO",
    "DPPO",
    "ClipCov",
    "KLCov",
    "VESPO",
    "LUSPO",
]
