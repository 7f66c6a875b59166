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
CALL_INPUTS = ("prompts", "completions", "completion_ids")
TRAINER_COLUMNS = ("completion_lengths", "max_completion_length", "turns", "replies")
#: TRL passes these too; lit_gspo has no equivalent, so a function must not require them
TRL_ONLY = ("trainer_state", "log_extra", "log_metric", "environments")

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
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return Convention(keyword=False, signature=None)
    params = list(signature.parameters.values())
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in params if p.kind in _POSITIONAL]
    if any(p.kind is p.POSITIONAL_ONLY for p in positional[:2]):
        return Convention(keyword=False, signature=signature)
    takes_two = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
    keyword = (bool(names) and names[0] in ("completions", "completion_ids")) or {"prompts", "completions"} <= set(names) \
        or not takes_two
    return Convention(keyword=keyword, signature=signature)
