"""Reward functions and their combination.

A reward function returns one score (or None) per completion. Two signatures are accepted, told
apart once from the function's parameters:

- lit_gspo's, called positionally: ``def f(prompts, completions, **columns)``;
- TRL's (``GRPOTrainer``), called by keyword: ``def f(completions, **kwargs)``,
  ``def f(completions, answer, **kwargs)``, ``def f(prompts, completions, ground_truth, **kwargs)``,
  ``def f(completion_ids, **kwargs)``.

Inputs follow TRL's contract: ``prompts``, ``completions`` (message lists with chat prompts),
``completion_ids`` (token ids), every dataset column under its own name (``answer=[...]``),
``trainer_state``, ``log_extra``, ``log_metric``, and trainer-provided ones (``completion_lengths=[...]``
in tokens, ``max_completion_length=int``); ``async def`` functions are awaited concurrently.
``RewardSet`` sums the functions with weights (None: left out of that sample's sum), masks failures,
``RewardSet.check(columns)`` fails at the start of a run when a function needs an input that no
call will give it, and the run's first scoring fails at once when a function fails as a whole.
"""

from lit_gspo.rl.rewards.calling import TrainerState, completion_text, conversation_completions, is_conversational
from lit_gspo.rl.rewards.format import FormatReward
from lit_gspo.rl.rewards.match import AnswerMatch, CharAccuracy, ExactMatch, last_number
from lit_gspo.rl.rewards.overlong import OverlongPenalty, overlong_penalty
from lit_gspo.rl.rewards.reward_model import RewardModel
from lit_gspo.rl.rewards.reward_set import (
    RewardFunctionError,
    RewardScores,
    RewardSet,
    RewardTimeout,
    RewardWarning,
    function_name,
)

__all__ = [
    "AnswerMatch",
    "CharAccuracy",
    "ExactMatch",
    "FormatReward",
    "OverlongPenalty",
    "RewardFunctionError",
    "RewardModel",
    "RewardScores",
    "RewardSet",
    "RewardTimeout",
    "RewardWarning",
    "TrainerState",
    "completion_text",
    "conversation_completions",
    "function_name",
    "is_conversational",
    "last_number",
    "overlong_penalty",
]
