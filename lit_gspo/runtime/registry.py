"""Registries of classes by name (objectives, advantage estimators): a subclass registers itself when it is defined.

A name belongs to one class: a second class under a taken name is refused, naming both, rather than silently
replacing the first (verl's registries refuse too). Defining the same class again (a module reloaded, a notebook
cell run twice) replaces it.
"""

from __future__ import annotations


def snake_case(name: str) -> str:
    """``GSPOToken`` → ``gspo_token``, ``DrGRPO`` → ``dr_grpo``."""
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (not name[i - 1].isupper() or (i + 1 < len(name) and name[i + 1].islower())):
            out.append("_")
        out.append(ch.lower())
    return "".join(out).replace("__", "_")


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(registry: dict[str, type], cls: type, kind: str) -> None:
    """``registry[cls.name] = cls``, unless another class holds that name."""
    taken = registry.get(cls.name)
    if taken is not None and qualified(taken) != qualified(cls):
        raise ValueError(
            f"{kind} name {cls.name!r} is taken by {qualified(taken)}; {qualified(cls)} cannot register under it. Give "
            f"it a name of its own (class attribute name = \"...\"), or define it with register=False "
            f"(class {cls.__name__}(..., register=False)) to use it by class path only")
    registry[cls.name] = cls
