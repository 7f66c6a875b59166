"""Policy objectives: one small class per algorithm, one registry.

    from lit_gspo.objectives import get_objective
    loss = get_objective("gspo")(logprobs, old_logprobs, advantages, mask).loss
"""

from lit_gspo.objectives.base import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    OBJECTIVES,
    Counts,
    LossOutput,
    Objective,
    aggregate,
    get_objective,
    kl_penalty,
    masked_mean,
    masked_sum,
)
from lit_gspo.objectives.gspo import GSPO, GSPOToken

__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "OBJECTIVES", "Counts", "LossOutput", "Objective", "aggregate",
    "get_objective", "kl_penalty", "masked_mean", "masked_sum", "GSPO", "GSPOToken",
]
