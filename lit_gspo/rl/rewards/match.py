"""Rewards that compare a completion with the reference ``answer`` column.

A row whose answer is None (a missing value in the data) has nothing to compare with: these rewards
return None for it, never a score against the string "None"; ``RewardSet`` leaves it out of that
sample's sum (the sample is masked and counted in ``reward_failed`` when no other function scores it).
Completions may be text or chat message lists (the last assistant message is compared).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Literal

from lit_gspo.rl.rewards.calling import completion_text

# A number: optional sign, digits, optional "." followed by at least one digit. The sign only counts
# when it is not glued to a preceding letter or digit, so in "3-5" the numbers are 3 and 5, not 3 and -5.
NUMBER = re.compile(r"(?:(?<![0-9A-Za-z])[+-])?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """Return the last number in ``text`` (see ``NUMBER``), or None when there is none."""
    found = NUMBER.findall(text)
    return found[-1] if found else None


def _answers(answer: list | None, n: int, who: str) -> list:
    if answer is None:
        raise KeyError(f"{who} needs an 'answer' column; pass answer=[...] (one reference answer per completion)")
    if len(answer) != n:
        raise ValueError(f"{who}: got {len(answer)} answers for {n} completions")
    return answer


class AnswerMatch:
    """1.0 when the completion's final answer equals the reference ``answer``, else 0.0.

    Modes:

    - ``"math_verify"``: ``math_verify.verify(parse(answer), parse(completion))``. math-verify
      extracts the answer from LaTeX or plain text (``\\boxed{7}``, ``$7$``, ``7.0``, ``"The answer
      is 7."`` all match ``"7"``; ``"1/2"`` matches ``"0.5"``) and compares symbolically. When it
      finds several candidates, it uses the last one ("12 or 7 or 13" → 13).
    - ``"last_number"``: a strict rule. The number nearest the end of the completion must equal the
      answer numerically, and nothing else is checked. A number is an optional sign (counted only
      when not directly after a letter or digit), one or more digits, and an optional fraction
      ("." then at least one digit): ``-3``, ``+4``, ``7``, ``7.0``, ``0.25``. ``.5``, ``1e3``,
      ``1/2`` and thousands separators are not numbers (``"1,234"`` reads as 1 then 234). Numbers
      are compared as decimals, so ``"7.0"`` equals ``"7"``. "12 or 13" → 13; "no idea" → 0.0.
      The answer itself must be such a number, or the call raises ``ValueError``.

    Args:
        mode: ``"math_verify"`` or ``"last_number"``.
        weight: the weight ``RewardSet`` gives this function.
    """

    def __init__(self, mode: Literal["math_verify", "last_number"] = "math_verify", weight: float = 1.0) -> None:
        if mode not in ("math_verify", "last_number"):
            raise ValueError(f"AnswerMatch mode must be 'math_verify' or 'last_number', got {mode!r}")
        self.mode = mode
        self.weight = weight

    def __call__(
        self, prompts: list[str], completions: list[str], answer: list | None = None, **columns
    ) -> list[float | None]:
        answers = _answers(answer, len(completions), "AnswerMatch")
        completions = [completion_text(c) for c in completions]
        if self.mode == "last_number":
            return [None if a is None else self._last_number(c, a) for c, a in zip(completions, answers)]
        return self._math_verify(completions, answers)

    @staticmethod
    def _last_number(completion: str, answer) -> float:
        try:
            gold = Decimal(str(answer).strip())
        except InvalidOperation:
            raise ValueError(f"AnswerMatch(mode='last_number') needs numeric answers, got {answer!r}") from None
        found = last_number(completion)
        return float(found is not None and Decimal(found) == gold)

    @staticmethod
    def _math_verify(completions: list[str], answers: list) -> list[float | None]:
        from math_verify import parse, verify

        # math-verify's timeouts use SIGALRM, which only the main thread may set.
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        scores = []
        for completion, answer in zip(completions, answers):
            if answer is None:
                scores.append(None)
                continue
            gold = parse(str(answer), parsing_timeout=timeout)
            pred = parse(completion, parsing_timeout=timeout)
            scores.append(float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)))
        return scores


class ExactMatch:
    """1.0 when the completion equals the reference ``answer`` string, else 0.0.

    Args:
        strip: compare after stripping leading and trailing whitespace from both.
        weight: the weight ``RewardSet`` gives this function.
    """

    def __init__(self, strip: bool = True, weight: float = 1.0) -> None:
        self.strip = strip
        self.weight = weight

    def __call__(
        self, prompts: list[str], completions: list[str], answer: list | None = None, **columns
    ) -> list[float | None]:
        answers = _answers(answer, len(completions), "ExactMatch")
        completions = [completion_text(c) for c in completions]
        norm = (lambda s: str(s).strip()) if self.strip else str
        return [None if a is None else float(norm(c) == norm(a)) for c, a in zip(completions, answers)]


class CharAccuracy:
    """Partial credit: the share of characters in the right place.

    ``score = #{i < min(len(a), len(c)) : c[i] == a[i]} / max(len(a), len(c))`` for answer ``a`` and
    completion ``c``. Dividing by the longer of the two penalises completions that run on past the
    answer: "123" vs "123" → 1.0, "124" → 2/3, "1234" → 3/4, "12" → 2/3, "" → 0.0. Two empty strings
    score 1.0.

    Args:
        strip: strip leading and trailing whitespace from both before comparing.
        weight: the weight ``RewardSet`` gives this function.
    """

    def __init__(self, strip: bool = True, weight: float = 1.0) -> None:
        self.strip = strip
        self.weight = weight

    def __call__(
        self, prompts: list[str], completions: list[str], answer: list | None = None, **columns
    ) -> list[float | None]:
        answers = _answers(answer, len(completions), "CharAccuracy")
        completions = [completion_text(c) for c in completions]
        return [None if a is None else self.score(c, a) for c, a in zip(completions, answers)]

    def score(self, completion: str, answer) -> float:
        """Score one completion against one answer (the formula above)."""
        c, a = str(completion), str(answer)
        if self.strip:
            c, a = c.strip(), a.strip()
        longest = max(len(a), len(c))
        if longest == 0:
            return 1.0
        return sum(x == y for x, y in zip(c, a)) / longest
