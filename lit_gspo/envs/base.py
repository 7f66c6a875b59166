"""The Environment protocol: a dataset row becomes the policy's first prompt; the environment answers each reply."""

from __future__ import annotations

from dataclasses import dataclass

from lit_gspo.data import encode_prompts

Conversation = str | list[dict]  # plain text, or chat messages [{"role": ..., "content": ...}, ...]


@dataclass
class Turn:
    """The environment's answer to one reply of the policy.

    observation: what is appended for the policy's next turn (text or chat messages); None when done.
    done: the episode ends here.
    reward: a reward for this turn (added to the reward functions' score of the episode), or None.
    """

    observation: Conversation | None = None
    done: bool = True
    reward: float | None = None


class Environment:
    """What the policy talks to; picked by class path (``--model.environment SingleTurn`` or your own class).

    An episode is one row of a rollout: :meth:`prompt` gives the first prompt of a dataset row, the
    engine samples a reply, :meth:`step` answers it. The trainer trains on the token ids the engine
    sampled (loss mask 1) and the ids of what the environment appended (loss mask 0), never on a
    re-tokenised transcript. Rewards: the trainer's reward functions (``model.rewards``) score the
    episode's reply text; a turn's own ``reward`` is added to that score.

    Args:
        system_prompt: a system message put before the first prompt (or before the text, followed by a
            newline, when chat templating is off).
        chat_template: render prompts with the tokenizer's chat template (None: if it has one).
    """

    def __init__(self, system_prompt: str | None = None, chat_template: bool | None = None):
        self.system_prompt, self.chat_template = system_prompt, chat_template

    def __repr__(self) -> str:
        return f"{type(self).__name__}(system_prompt={self.system_prompt!r}, chat_template={self.chat_template!r})"

    def prompt(self, row: dict) -> Conversation:
        """The first prompt of the episode of dataset row ``row`` (default: its ``prompt`` column)."""
        return row["prompt"]

    def step(self, row: dict, reply: str) -> Turn:
        """Answer the policy's ``reply`` in the episode of ``row``."""
        raise NotImplementedError

    def encode(self, tokenizer, rows: list[dict], max_prompt_length: int) -> list[list[int]]:
        """Token ids of the first prompts of ``rows`` (rendered once, never truncated)."""
        return encode_prompts(tokenizer, [self.prompt(row) for row in rows], chat_template=self.chat_template,
                              max_prompt_length=max_prompt_length, system_prompt=self.system_prompt)


class SingleTurn(Environment):
    """One prompt, one reply, scored by the reward functions: the default environment."""

    def step(self, row: dict, reply: str) -> Turn:
        return Turn(done=True)
