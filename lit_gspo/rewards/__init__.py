"""Reward functions and their combination.

A reward function returns one score (or None) per completion. Two signatures are accepted, told
apart once from the function's parameters:

- lit_gspo's, called positionally: ``def f(prompts, completions, **columns)``;
- TRL's (``GRPOTrainer``), called by keyword: ``def f(completions, **kwargs)``,
  ``def f(completions, answer, **kwargs)``, ``def f(prompts, completions, ground_truth, **kwargs)``,
  ``def f(completion_ids, **kwargs)``.

Inputs are ``prompts``, ``completions``, ``completion_ids`` (token ids), the dataset columns per
sample (``answer=[...]``) and trainer-provided ones (``completion_lengths=[...]`` in tokens,
``max_completion_length=int``). ``RewardSet`` sums the functions with weights, masks failures, and
``RewardSet.check(columns)`` fails at the start of a run when a function needs an input that no
call will give it.
"""

from lit_gspo.rewards.format import FormatReward
from lit_gspo.rewards.match import AnswerMatch, CharAccuracy, ExactMatch, last_number
from lit_gspo.rewards.overlong import OverlongPenalty, overlong_penalty
from lit_gspo.rewards.reward_model import RewardModel
from lit_gspo.rewards.reward_set import RewardScores, RewardSet, RewardTimeout, RewardWarning, function_name

__all__ = [
    "AnswerMatch",
    "CharAccuracy",
    "ExactMatch",
    "FormatReward",
    "OverlongPenalty",
    "RewardModel",
    "RewardScores",
    "RewardSet",
    "RewardTimeout",
    "RewardWarning",
    "function_name",
    "last_number",
    "overlong_penalty",
]
