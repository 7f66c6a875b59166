"""A reward for the shape of a completion."""

from __future__ import annotations

import re

from lit_gspo.rl.rewards.calling import completion_text


class FormatReward:
    """1.0 when the whole completion matches ``pattern``, else 0.0.

    The match is ``re.fullmatch(pattern, completion.strip(), re.DOTALL)``: the pattern must cover
    the entire completion (leading and trailing whitespace ignored), and ``.`` also matches newlines.
    To reward a pattern appearing anywhere, wrap it: ``".*<answer>.*</answer>.*"``. A chat completion
    (a message list) is matched on its last assistant message.

    Args:
        pattern: a Python regular expression, e.g. ``"<think>.*</think>\\s*<answer>.*</answer>"``.
        weight: the weight ``RewardSet`` gives this function.
    """

    def __init__(self, pattern: str, weight: float = 1.0) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ValueError(f"FormatReward pattern {pattern!r} is not a valid regular expression: {err}") from None
        self.pattern = pattern
        self.weight = weight

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        return [float(self.regex.fullmatch(completion_text(c).strip()) is not None) for c in completions]
