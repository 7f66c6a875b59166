"""Registries of classes by name (objectives, advantage estimators): a subclass registers itself when it is defined.

A name belongs to one class: a second class under a taken name is refused, naming both, rather than silently
replacing the first (verl's registries refuse too). Defining the same class again (a module reloaded, a notebook
cell run twice) replaces it.
"""

from __future__ import annotations

from typing import ClassVar


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


def register_class(registry: dict[str, type], cls: type, kind: str) -> None:
    """``registry[cls.name] = cls``, unless another class holds that name."""
    taken = registry.get(cls.name)
    if taken is not None and qualified(taken) != qualified(cls):
        raise ValueError(
            f"{kind} name {cls.name!r} is taken by {qualified(taken)}; {qualified(cls)} cannot register under it. Give "
            f'it a name of its own (class attribute name = "..."), or define it with register=False '
            f"(class {cls.__name__}(..., register=False)) to use it by class path only"
        )
    registry[cls.name] = cls


class Registered:
    """Base of a registry's classes (objectives, advantage estimators): a subclass registers itself in ``registry``
    under ``name`` (default: its class name in snake_case) when it is defined, unless it says ``register=False``."""

    registry: ClassVar[dict[str, type]]
    kind: ClassVar[str]  # what the registry holds, for its messages
    name: ClassVar[str]

    def __init_subclass__(cls, register: bool = True, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = snake_case(cls.__name__)
        if register:
            register_class(cls.registry, cls, cls.kind)
