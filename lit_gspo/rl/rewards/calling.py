"""How to call a reward function: lit_gspo's positional convention or TRL's keyword one, read from its signature.

- **positional** (lit_gspo): ``fn(prompts, completions, **columns)``.
- **keyword** (TRL's ``GRPOTrainer``): ``fn(prompts=..., completions=..., completion_ids=..., **columns)``,
  e.g. ``def f(completions, answer, **kwargs)`` or ``def f(prompts, completions, ground_truth, **kwargs)``.

A function is called by keyword when its first parameter is ``completions`` or ``completion_ids``, when
it has parameters named both ``prompts`` and ``completions`` (in any order), or when it cannot take two
positional arguments (e.g. ``def f(**kwargs)``); otherwise positionally. In both conventions a function
without ``**kwargs`` gets only the inputs it names, so an unused column never breaks the call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

#: inputs every call can supply besides the dataset's columns (trainer columns included)
CALL_INPUTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
TRAINER_COLUMNS = ("completion_lengths", "max_completion_length", "turns", "replies")
#: TRL passes this too (with ``environment_factory``); lit_gspo has no equivalent, so a function must not require it
TRL_ONLY = ("environments",)


@dataclass
class TrainerState:
    """What TRL's ``trainer_state`` input (a ``transformers.TrainerState``) tells a reward about training progress,
    e.g. for a curriculum: ``trainer_state.global_step / trainer_state.max_steps``.

    Attributes:
        global_step: RL steps done so far (0 at the first step and at the validation before it).
        max_steps: the run's planned RL steps (0: not known, as in ``transformers.TrainerState``).
        epoch: epochs over the training prompts done so far (fractional).
        num_train_epochs: the planned epochs (0: not known).
    """

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0


def is_conversational(prompts: list) -> bool:
    """Whether ``prompts`` are chat conversations (TRL's test: the first is a list of ``{"role", "content"}`` dicts)."""
    first = prompts[0] if prompts else None
    return isinstance(first, list) and bool(first) and isinstance(first[0], dict) and "role" in first[0]


def as_messages(conversation) -> list[dict]:
    """Text as one user message (how an environment's text observation is rendered), messages as they are."""
    return [{"role": "user", "content": conversation}] if isinstance(conversation, str) else list(conversation)


def conversation_completions(prompts: list, replies: list[list[str]], observations: list[list] | None = None) -> list:
    """The ``completions`` a reward gets, as TRL gives them: with chat prompts (:func:`is_conversational`) each
    completion is the messages after the prompt, ``[{"role": "assistant", "content": reply}]`` for one reply (so
    ``completion[0]["content"]`` is the text); a multi-turn episode lists every reply with, between them, the
    observations appended after it (text as a user message). With text prompts: the last reply as a string.

    Args:
        prompts: one prompt per completion (text or a list of messages).
        replies: each episode's replies, in order.
        observations: each episode's observations after its replies but the last (None: none).
    """
    if not is_conversational(prompts):
        return [r[-1] for r in replies]
    out = []
    for i, episode in enumerate(replies):
        messages = []
        for k, reply in enumerate(episode):
            messages.append({"role": "assistant", "content": reply})
            if observations is not None and k < len(episode) - 1 and observations[i][k] is not None:
                messages += as_messages(observations[i][k])
        out.append(messages)
    return out


def completion_text(completion) -> str:
    """A completion's text: a string as is; a message list's last assistant message (what a built-in reward scores)."""
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if m.get("role", "assistant") == "assistant"]
    if not replies:
        raise ValueError(f"a conversational completion holds no assistant message: {completion!r}")
    return replies[-1].get("content") or ""


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Convention:
    """A reward function's calling convention, read once from its signature.

    Attributes:
        keyword: True for TRL's keyword convention, False for ``fn(prompts, completions, **columns)``.
        signature: the function's signature; None when it cannot be read (then it is called
            positionally with every column, and ``missing`` finds nothing to check).
    """

    keyword: bool
    signature: inspect.Signature | None
    asynchronous: bool = False  # an ``async def`` function (or a callable with an ``async def __call__``)

    @property
    def var_keyword(self) -> bool:
        """Whether the function takes ``**kwargs`` (an unreadable signature counts as taking them)."""
        return self.signature is None or any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())

    def accepts(self, name: str) -> bool:
        """Whether ``name`` can be passed by keyword."""
        if self.var_keyword:
            return True
        p = self.signature.parameters.get(name)
        return p is not None and p.kind is not p.POSITIONAL_ONLY

    def call(self, fn: Callable, prompts: list, completions: list, columns: dict, completion_ids: list | None = None):
        """Call ``fn`` in its convention; columns it neither names nor can take in ``**kwargs`` are left out."""
        inputs = dict(columns)
        if completion_ids is not None:
            inputs["completion_ids"] = completion_ids
        if not self.keyword:
            if self.signature is None:  # unknown: exactly the historic call
                return fn(prompts, completions, **columns)
            slots = self._positional_names()[:2]
            return fn(prompts, completions, **{k: v for k, v in inputs.items() if k not in slots and self.accepts(k)})
        inputs.update(prompts=prompts, completions=completions)
        return fn(**{k: v for k, v in inputs.items() if self.accepts(k)})

    def _positional_names(self) -> list[str]:
        return [p.name for p in self.signature.parameters.values() if p.kind in _POSITIONAL]

    def missing(self, available: set[str]) -> list[str]:
        """The required parameters no call can fill from ``available`` input names (always [] for an unreadable signature)."""
        if self.signature is None:
            return []
        params = list(self.signature.parameters.values())
        if not self.keyword:
            if len(self._positional_names()) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
                return ["(two positional parameters for prompts, completions)"]
            params = [p for p in params if p.name not in self._positional_names()[:2]]
        required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return [p.name for p in required if p.kind is p.POSITIONAL_ONLY or p.name not in available]

    def describe(self) -> str:
        """The parameter names, e.g. ``(completions, answer, **kwargs)``; ``(...)`` when unreadable."""
        if self.signature is None:
            return "(...)"
        stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        return "(" + ", ".join(stars.get(p.kind, "") + p.name for p in self.signature.parameters.values()) + ")"


def convention(fn: Callable) -> Convention:
    """Read ``fn``'s calling convention (functions, lambdas, partials and instances of classes with ``__call__``)."""
    asynchronous = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (the method)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return Convention(keyword=False, signature=None, asynchronous=asynchronous)
    params = list(signature.parameters.values())
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in params if p.kind in _POSITIONAL]
    if any(p.kind is p.POSITIONAL_ONLY for p in positional[:2]):
        return Convention(keyword=False, signature=signature, asynchronous=asynchronous)
    takes_two = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
    keyword = (
        (bool(names) and names[0] in ("completions", "completion_ids"))
        or {"prompts", "completions"} <= set(names)
        or not takes_two
    )
    return Convention(keyword=keyword, signature=signature, asynchronous=asynchronous)
