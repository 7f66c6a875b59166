"""A parameter where an int is a count and a float a fraction (Lightning's ``limit_*_batches``) gets what was written.

Lightning annotates ``limit_train_batches``, ``limit_val_batches``, ... as ``Optional[Union[int, float]]``: an int is a
number of batches, a float a fraction of them. jsonargparse tries a union's members in the order of its ``__args__``,
and a float accepts an int (``1`` → ``1.0``). ``typing`` caches unions and treats two with the same members in another
order as equal, so the annotation Lightning gets is whichever of ``Union[int, float, None]`` and
``Union[float, int, None]`` some import created first. With torch 2.11 (a GPU machine's) it is the float-first one, and
``--trainer.limit_val_batches 1`` (one batch) became ``1.0`` (every batch), silently; ``2`` became ``2.0``, refused
(Lightning's issue #21259 reports the same for ``val_check_interval``).

:func:`int_before_float` rebuilds such an annotation with ``int`` before ``float`` as ``int | float | ...``
(``types.UnionType``, which keeps the order it is written in), and :func:`int_or_float_parameters` finds the
parameters of a class that need it, so that ``RLArgumentParser`` adds them with that type and :func:`parameter_doc`'s
help.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
import typing


def int_before_float(hint):
    """``hint``, a union holding both ``int`` and ``float``, as ``int | float | <its other members>``."""
    members = [m for m in typing.get_args(hint) if m not in (int, float)]
    return functools.reduce(operator.or_, [int, float, *members])


def int_or_float_parameters(cls: type) -> dict[str, tuple[object, object]]:
    """``{name: (annotation, default)}`` of the parameters of ``cls.__init__`` annotated with a union holding both
    ``int`` and ``float``, in either order; ``{}`` for a class whose annotations do not resolve."""
    try:
        hints = typing.get_type_hints(cls.__init__)
        parameters = inspect.signature(cls.__init__).parameters
    except (NameError, TypeError, ValueError):
        return {}
    return {
        name: (hints[name], parameter.default)
        for name, parameter in parameters.items()
        if name in hints and _holds_int_and_float(hints[name])
    }


def _holds_int_and_float(hint) -> bool:
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    return int in members and float in members


def parameter_doc(cls: type, name: str) -> str | None:
    """The description of ``cls.__init__``'s parameter ``name`` in its docstring (or the class's), as jsonargparse's
    help shows it."""
    try:
        import docstring_parser  # jsonargparse's, for the help of every other parameter
    except ImportError:
        return None
    for doc in (cls.__init__.__doc__, cls.__doc__):
        for param in docstring_parser.parse(doc or "").params:
            if param.arg_name == name:
                return param.description
    return None
