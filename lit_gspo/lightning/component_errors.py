"""A component's own check of its settings, reported as the option a user types.

The CLI builds every class its config names (``--model.rewards+=OverlongPenalty``, an objective, an engine, a
mismatch correction, a settings group, a callback) through jsonargparse's instantiators. :class:`NamingInstantiator`
is one of them: when a class's ``__init__`` refuses a value (a ``ValueError``, a ``TypeError`` raised by the class's
own code, or Lightning's ``MisconfigurationException``), it finds where the config holds that class and raises a
:class:`ComponentError` naming the option, the value given and the class's message, in one line::

    --model.objective.clip_low -1.0: clip_low and clip_high must be >= 0, got -1.0 and 0.0004
    --model.rewards.cache_len -2 (model.rewards[1], OverlongPenalty): OverlongPenalty cache_len must be > 0 tokens, got -2

A list item is named by its place in the config (``model.rewards[1]``) beside the option (which sets the last item
given on the command line). The classes are not changed: their messages say what is valid.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from jsonargparse import Namespace

from lit_gspo.runtime import user_errors
from lit_gspo.runtime.imports import import_path
from lit_gspo.runtime.user_errors import SettingsError


class ComponentError(SettingsError):
    """A class built from the config refused one of its settings (the message names the option)."""


def class_specs(node, path: str = "") -> Iterator[tuple[str, Namespace]]:
    """``(path, spec)`` of every class spec (``class_path`` and ``init_args``) and settings group (a Namespace without
    ``class_path``) in a parsed config, parents first: ``model.rewards[1]``, ``model.update.mismatch.corrections[0]``."""
    if isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from class_specs(item, f"{path}[{i}]")
        return
    if not isinstance(node, Namespace):
        return
    if path:
        yield path, node
    args = node.get("init_args") if "class_path" in node else node
    for key, value in (args or Namespace()).items(branches=True, nested=False):
        if not key.startswith("__"):  # jsonargparse's metadata (__path__)
            yield from class_specs(value, f"{path}.{key}" if path else key)


def _arguments(spec: Namespace) -> Namespace:
    return (spec.get("init_args") or Namespace()) if "class_path" in spec else spec


def _builds(spec: Namespace, cls: type, kwargs: dict) -> bool:
    """Whether ``spec`` names ``cls`` (a class spec) or holds exactly its keyword arguments (a settings group)."""
    if "class_path" in spec:
        try:
            return import_path(str(spec["class_path"])) is cls
        except (ImportError, AttributeError, ValueError):
            return False
    return set(spec.keys(nested=False)) - {k for k in spec.keys(nested=False) if k.startswith("__")} == set(kwargs)


def _plain(value) -> bool:
    return isinstance(value, (str, int, float, bool, type(None)))


def _agrees(spec: Namespace, kwargs: dict) -> bool:
    """Whether the spec's plain values are the ones the class was called with."""
    args = _arguments(spec)
    return all(args.get(k) == v for k, v in kwargs.items() if _plain(v) and _plain(args.get(k)))


def find_spec(config: Namespace, cls: type, kwargs: dict) -> tuple[str, Namespace] | None:
    """Where ``config`` holds the class ``cls`` called with ``kwargs``: the first spec of that class whose values agree,
    else the first of that class; None when the config holds none (a class built otherwise)."""
    found = [(path, spec) for path, spec in class_specs(config) if _builds(spec, cls, kwargs)]
    return next((f for f in found if _agrees(f[1], kwargs)), found[0] if found else None)


def _defaults(cls: type) -> dict:
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _names(key: str, message: str) -> bool:
    """Whether ``message`` names the setting ``key`` (a word, maybe after its group's name: ``mismatch.old_logprobs``)."""
    return re.search(rf"(?<!\w){re.escape(key)}(?!\w)", message, re.IGNORECASE) is not None


def _quotes(value, message: str) -> bool:
    """Whether ``message`` quotes the number or text ``value`` (``-1.0`` in ``rate: -1.0.``, not in ``-1.05``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or value == "":
        return False
    return re.search(rf"(?<![\w.-]){re.escape(str(value))}(?!\w|\.\d)", message) is not None


def named_settings(cls: type, args: Namespace, message: str) -> list[str]:
    """The settings of ``args`` that ``message`` names (as words), those given other than their default first: of
    ``clip_low and clip_high must be >= 0`` with clip_low given, ``clip_low``. A message naming none (torch's
    ``Invalid learning rate: -1.0``): the settings given other than their default whose value it quotes."""
    defaults = _defaults(cls)
    keys = [k for k in args.keys(nested=False) if not k.startswith("__")]
    changed = [k for k in keys if k not in defaults or args.get(k) != defaults[k]]
    named = [k for k in keys if _names(k, message)]
    if named:
        return [k for k in named if k in changed] or named
    return [k for k in changed if _quotes(args.get(k), message)]


def _typed(value):
    """A parsed value as a user types it (a class spec as its class path, a group as a mapping)."""
    if isinstance(value, Namespace):
        return value["class_path"] if "class_path" in value else _typed(value.as_dict())
    if isinstance(value, (list, tuple)):
        return [_typed(v) for v in value]
    if isinstance(value, dict):
        return {k: v["class_path"] if isinstance(v, dict) and "class_path" in v else v for k, v in value.items()}
    return value


def describe(path: str, spec: Namespace, cls: type, message: str) -> str:
    """``--<option> <value>[ (<config path>, <class>)]: <message>``: the option as typed (``init_args`` and list
    places left out), with the config path beside it when the option alone does not say which item."""
    option = re.sub(r"\[\d+\]|\.init_args\b", "", path)
    args = _arguments(spec)
    keys = named_settings(cls, args, message)
    if keys:
        head = " ".join(user_errors.option(f"{option}.{k}", _typed(args.get(k))) for k in keys)
    elif "class_path" in spec:
        head = user_errors.option(option, spec["class_path"])
    else:
        head = user_errors.option(option)
    where = f" ({path}, {cls.__name__})" if "[" in path else ""
    return f"{head}{where}: {message}"


def refuses_a_value(exc: BaseException, cls: type) -> bool:
    """Whether ``exc``, raised by ``cls(...)``, is the class refusing a value (not a bug to show with its traceback): a
    ``ValueError`` or Lightning's ``MisconfigurationException``, or a ``TypeError`` raised by the class's own code; never
    an error that already is a user error (it names what to do)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(exc, user_errors.UserError):
        return False
    if isinstance(exc, (ValueError, MisconfigurationException)):
        return True
    return isinstance(exc, TypeError) and _raised_in(exc, cls)


def _raised_in(exc: BaseException, cls: type) -> bool:
    """Whether the innermost frame of ``exc`` is in the file of ``cls`` or of one of its bases."""
    frames = inspect.getinnerframes(exc.__traceback__) if exc.__traceback__ else []
    files = set()
    for base in cls.__mro__:
        try:
            files.add(Path(inspect.getfile(base)).resolve())
        except (TypeError, OSError):
            continue
    return bool(frames) and Path(frames[-1].filename).resolve() in files


class NamingInstantiator:
    """A jsonargparse instantiator (``parser.add_instantiator(NamingInstantiator(...), object)``): builds the class, and
    turns its refusal of a value into a :class:`ComponentError` naming the option (:func:`describe`).

    ``config`` gives the parsed config the classes are built from (the subcommand's). ``last`` is the last error
    raised, for a caller whose exception jsonargparse wrapped without its cause."""

    def __init__(self, config: Callable[[], Namespace]):
        self.config = config
        self.last: ComponentError | None = None

    def __call__(self, cls: type, *args, **kwargs):
        try:
            return cls(*args, **kwargs)
        except Exception as exc:
            if not refuses_a_value(exc, cls):
                raise
            found = find_spec(self.config(), cls, kwargs)
            if found is None:
                raise
            self.last = ComponentError(describe(*found, cls, str(exc).strip().replace("\n", " ")))
            raise self.last from exc


def component_error(exc: BaseException, instantiator: NamingInstantiator | None) -> ComponentError | None:
    """The :class:`ComponentError` that ``exc`` carries (itself, its causes, or the instantiator's last one when
    jsonargparse's message quotes it), or None."""
    inner: BaseException | None = exc
    while inner is not None:
        if isinstance(inner, ComponentError):
            return inner
        inner = inner.__cause__ or inner.__context__
    last = instantiator.last if instantiator is not None else None
    return last if last is not None and str(last) in str(exc) else None
