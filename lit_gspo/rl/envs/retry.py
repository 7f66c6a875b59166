"""Try again after feedback: the environment marks which characters of a wrong reply are wrong."""

from __future__ import annotations

from lit_gspo.rl.envs.base import Environment, Turn
from lit_gspo.rl.rewards import CharAccuracy


class RetryWithFeedback(Environment):
    """A task with an exact ``answer`` column, where a wrong reply is answered with a hint and a new try.

    The hint is the reply with each wrong character replaced by ``blank`` (positions compared with the
    answer; characters missing at the end are blanks too), e.g. answer ``283``, reply ``293`` → ``2_3``.
    The observation is ``feedback.format(hint=...)``; the policy replies again, up to ``max_turns`` replies.

        turn reward:  −(1 − acc_k) − retry_penalty for a wrong reply k that gets another try, else 0
        acc_k:        the share of reply k's characters in the right place (``CharAccuracy``)
        success:      reply.strip() == answer  (ends the episode)

    The reward functions (``model.rewards``) score the last reply, so with ``CharAccuracy`` an episode
    of K replies earns acc_K − Σ_{k<K} (1 − acc_k + retry_penalty): 1 when the first reply is right, and
    each wrong try costs what it got wrong. Every reply's return-to-go thus depends on its own accuracy
    (``TurnGroupNormalized`` credits it per turn).

    Args:
        feedback: the observation after a wrong reply; ``{hint}`` is replaced by the hint.
        blank: the character marking a wrong position.
        retry_penalty: subtracted once more for each wrong reply that is given another try (≥ 0).
        max_turns: the most replies per episode (the first try included).
    """

    def __init__(
        self, feedback: str = " {hint}=", blank: str = "_", retry_penalty: float = 0.0, max_turns: int = 3, **kwargs
    ):
        super().__init__(max_turns=max_turns, **kwargs)
        if "{hint}" not in feedback:
            raise ValueError(f"feedback must contain '{{hint}}', got {feedback!r}")
        if len(blank) != 1:
            raise ValueError(f"blank must be one character, got {blank!r}")
        if retry_penalty < 0:
            raise ValueError(f"retry_penalty must be >= 0 (it is subtracted), got {retry_penalty}")
        self.feedback, self.blank, self.retry_penalty = feedback, blank, retry_penalty

    def __repr__(self) -> str:
        return (
            f"RetryWithFeedback(feedback={self.feedback!r}, blank={self.blank!r}, "
            f"retry_penalty={self.retry_penalty}, max_turns={self.max_turns})"
        )

    def hint(self, reply: str, answer: str) -> str:
        """``reply`` aligned to ``answer``'s length, each wrong character replaced by the blank."""
        return "".join(r if r == a else self.blank for r, a in zip(reply.ljust(len(answer), self.blank), answer))

    def step(self, row: dict, reply: str, state: dict) -> Turn:
        answer = row.get("answer")
        if answer is None:
            raise ValueError(f"RetryWithFeedback needs an 'answer' column; the row has {sorted(row)}")
        reply, answer = reply.strip(), str(answer)
        if reply == answer:
            return Turn(done=True, success=True)
        if state["turn"] >= self.max_turns:
            return Turn(done=True, success=False)
        return Turn(
            observation=self.feedback.format(hint=self.hint(reply, answer)),
            done=False,
            reward=CharAccuracy(strip=False).score(reply, answer) - 1.0 - self.retry_penalty,
            success=False,
        )
