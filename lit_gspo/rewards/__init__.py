"""Reward functions and their combination.

A reward function is any callable ``(prompts: list[str], completions: list[str], **columns) ->
list[float | None]``; ``columns`` carries dataset columns per sample (``answer=[...]``) and
trainer-provided ones (``completion_lengths=[...]`` in tokens, ``max_completion_length=int``).
``RewardSet`` sums them with weights and masks failures.
"""

from lit_gspo.rewards.format import FormatReward
from lit_gspo.rewards.match import AnswerMatch, CharAccuracy, ExactMatch, last_number
from lit_gspo.rewards.overlong import OverlongPenalty, overlong_penalty
from lit_gspo.rewards.reward_set import RewardScores, RewardSet, RewardWarning, function_name

__all__ = [
    "AnswerMatch",
    "CharAccuracy",
    "ExactMatch",
    "FormatReward",
    "OverlongPenalty",
    "RewardScores",
    "RewardSet",
    "RewardWarning",
    "function_name",
    "last_number",
    "overlong_penalty",
]
