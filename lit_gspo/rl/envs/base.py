"""The Environment protocol: a dataset row becomes the policy's first prompt; the environment answers each reply.

state = environment.reset(row)                       once per episode (one row of the rollout)
prompt = environment.prompt(row)                     rendered through the chat template once
repeat:  reply  = the policy's sampled tokens        (loss mask 1)
         turn   = environment.step(row, reply, state)
         turn.observation, if not done               rendered and tokenised once (loss mask 0)
until turn.done, ``max_turns`` replies, or the episode's token budget is spent
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lit_gspo.data import encode_prompts
from lit_gspo.data.prompts import check_template_kwargs, template_arguments

Conversation = str | list[dict]  # plain text, or chat messages [{"role": ..., "content": ...}, ...]


@dataclass
class Turn:
    """The environment's answer to one reply of the policy.

    observation: what is appended before the policy's next reply: text (a user message when chat
        templating is on; appended as is when it is off) or chat messages (e.g. ``{"role": "tool", ...}``).
    done: the episode ends here.
    reward: a reward for this turn; the episode's reward is the sum of its turns' rewards plus the
        reward functions' score of the last reply. None: 0.
    success: whether this reply solved the task (logged as ``success_turn{k}``); None: not known.
    metrics: counts for this turn (e.g. ``{"tool_calls": 1}``), summed over the episode and logged as
        ``train/<key>`` (mean per episode).
    """

    observation: Conversation | None = None
    done: bool = True
    reward: float | None = None
    success: bool | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Environment:
    """What the policy talks to; picked by class path (``--model.environment SingleTurn`` or your own class).

    An episode is one row of a rollout: :meth:`reset` makes its state, :meth:`prompt` gives its first
    prompt, the engine samples a reply, :meth:`step` answers it, and so on until a turn is ``done``,
    ``max_turns`` replies were sampled, or ``max_episode_tokens`` are used. The trainer trains on the
    token ids the engine sampled (loss mask 1) and the ids of what the environment appended (loss
    mask 0, rendered and tokenised once), never on a re-tokenised transcript. Rewards: the trainer's
    reward functions (``model.rewards``) score the last reply (the columns ``replies`` and ``turns``
    carry the whole episode); each turn's own ``reward`` is added to the episode's reward.

    Args:
        system_prompt: a system message put before the first prompt (or before the text, followed by a
            newline, when chat templating is off).
        chat_template: render prompts with the tokenizer's chat template (None: if it has one).
        chat_template_kwargs: extra variables every rendering passes to the template, as TRL's option of this name
            and ``apply_chat_template(**kwargs)`` take them (Qwen3: ``{"enable_thinking": False}``).
        max_turns: the most replies the policy gives in one episode.
        max_episode_tokens: the most tokens after the first prompt (replies and observations together);
            None: what the model's context leaves. A turn never starts without room for one token.
        demonstration: the replies of an episode for the supervised warm start, each formatted with the
            row's columns, e.g. ``['CALL calculator("{expression}")', "{answer}"]``; None: the answer alone.
    """

    #: the keys of ``Turn.metrics`` this environment reports; validation logs them as ``val/<key>`` too
    metric_names: tuple[str, ...] = ()
    chat_template_kwargs: dict | None = None  # set by __init__; a subclass that skips it renders without any

    def __init__(
        self,
        system_prompt: str | None = None,
        chat_template: bool | None = None,
        max_turns: int = 1,
        max_episode_tokens: int | None = None,
        demonstration: Sequence[str] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        self.chat_template_kwargs = check_template_kwargs(chat_template_kwargs)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_episode_tokens is not None and max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be >= 1 or None, got {max_episode_tokens}")
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        if isinstance(demonstration, str):
            raise ValueError(f"demonstration must be a list of reply templates, got the string {demonstration!r}")
        self.demonstration_templates = None if demonstration is None else list(demonstration)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(system_prompt={self.system_prompt!r}, chat_template={self.chat_template!r}, "
            f"max_turns={self.max_turns})"
        )

    def reset(self, row: dict) -> dict:
        """The state of a new episode on ``row`` (passed to every :meth:`step`; the trainer adds ``turn``)."""
        return {}

    def prompt(self, row: dict) -> Conversation:
        """The first prompt of the episode of dataset row ``row`` (default: its ``prompt`` column)."""
        return row["prompt"]

    def step(self, row: dict, reply: str, state: dict) -> Turn:
        """Answer the policy's ``reply`` (``state["turn"]``: its 1-based index) in the episode of ``row``."""
        raise NotImplementedError

    def demonstration(self, row: dict) -> list[str] | None:
        """The replies of an episode on ``row`` for the supervised warm start: the ``demonstration`` templates
        formatted with the row's columns, else the row's ``answer``; None: ``row`` has none."""
        if self.demonstration_templates is None:
            return None if row.get("answer") is None else [str(row["answer"])]
        try:
            return [template.format(**row) for template in self.demonstration_templates]
        except KeyError as err:
            raise ValueError(
                f"{type(self).__name__} demonstration {self.demonstration_templates!r} names the column "
                f"{err}, which the row does not have; its columns are {sorted(row)}"
            ) from None

    def tools(self) -> list[dict] | None:
        """JSON schemas of the tools offered to the policy (passed to the chat template's ``tools=``), or None."""
        return None

    def uses_chat_template(self, tokenizer) -> bool:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        return has_template if self.chat_template is None else self.chat_template

    def encode(self, tokenizer, rows: list[dict], max_prompt_length: int) -> list[list[int]]:
        """Token ids of the first prompts of ``rows`` (rendered once, never truncated)."""
        return encode_prompts(
            tokenizer,
            [self.prompt(row) for row in rows],
            chat_template=self.chat_template,
            max_prompt_length=max_prompt_length,
            system_prompt=self.system_prompt,
            tools=self.tools(),
            template_kwargs=self.chat_template_kwargs,
        )

    def encode_observation(self, tokenizer, observation: Conversation, reply_end: str) -> list[int]:
        """Token ids appended after a reply: the observation and, with a chat template, the turn's closing
        and the next generation prompt, rendered once and tokenised once.

        reply_end: the text of the stop token the reply ended with ("" when it ran out of tokens); where the
        template's closing starts with it, the reply already closed the turn and the closing goes on after it.
        """
        if not self.uses_chat_template(tokenizer):
            if not isinstance(observation, str):
                raise ValueError(
                    f"{type(self).__name__} returned chat messages as an observation, but chat "
                    f"templating is off (chat_template={self.chat_template!r}); return text"
                )
            return list(tokenizer(observation, add_special_tokens=False)["input_ids"])
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        closing, text = chat_continuation(tokenizer, messages, self.tools(), self.chat_template_kwargs)
        if reply_end and closing.startswith(reply_end):
            closing = closing[len(reply_end) :]
        return list(tokenizer(closing + text, add_special_tokens=False)["input_ids"])


class SingleTurn(Environment):
    """One prompt, one reply, scored by the reward functions: the default environment."""

    def step(self, row: dict, reply: str, state: dict) -> Turn:
        return Turn(done=True)


_SENTINEL = "\u2063lit_gspo_reply\u2063"


def chat_continuation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> tuple[str, str]:
    """How the chat template continues after an assistant reply: (closing, text).

    closing: what the template writes after the reply's content (e.g. ``<|im_end|>\\n``); text: ``messages``
    rendered, followed by the generation prompt of the next assistant turn. Found by rendering a
    conversation with and without ``messages``; raises when the template does not render the shorter
    conversation as a prefix of the longer one (then no appended text can be exact).
    """
    kwargs = template_arguments(tools, template_kwargs)
    before = tokenizer.apply_chat_template(_REPLIED, tokenize=False, **kwargs)
    after = tokenizer.apply_chat_template(_REPLIED + messages, tokenize=False, add_generation_prompt=True, **kwargs)
    if not after.startswith(before):
        raise ValueError(
            "the tokenizer's chat template does not render a conversation as a prefix of its continuation, "
            "so observations cannot be appended token-exactly; set the environment's chat_template=False "
            "and return text observations"
        )
    return _after_reply(before), after[len(before) :]


def assistant_closing(tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """What the chat template writes after an assistant reply's content (e.g. ``<|im_end|>\\n``, ``<end_of_turn>\\n``)."""
    return _after_reply(
        tokenizer.apply_chat_template(_REPLIED, tokenize=False, **template_arguments(tools, template_kwargs))
    )


_REPLIED = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]


def _after_reply(rendered: str) -> str:
    return rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL) :]
