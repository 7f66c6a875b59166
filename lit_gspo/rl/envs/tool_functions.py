"""Plain Python functions as tools: resolving them, their JSON schemas, checked calls with a time limit.

A tool is a typed function with a Google-style docstring (an ``Args:`` section describing every
argument); its schema comes from ``transformers.utils.get_json_schema``. Every failure of a call (an
unknown name, bad arguments, an exception, running past the time limit) becomes a
:class:`ToolError` whose message is meant for the model, so one bad call never stops training.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable

from lit_gspo.runtime.imports import import_path

JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": (list, tuple),
    "object": dict,
    "null": type(None),
}


class ToolError(Exception):
    """A call that failed; the message is what the model is told."""


def resolve_tool(tool: str | Callable) -> Callable:
    """The function behind an import path such as ``"lit_gspo.rl.envs.calculator.calculator"`` (or ``tool`` itself)."""
    if callable(tool):
        return tool
    if not isinstance(tool, str) or "." not in tool:
        raise ValueError(
            f"a tool is a function or the import path of one (e.g. 'lit_gspo.rl.envs.calculator.calculator'), "
            f"got {tool!r}"
        )
    try:
        function = import_path(tool)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import the tool {tool!r}: {err}") from None
    if not callable(function):
        raise ValueError(f"the tool {tool!r} is a {type(function).__name__}, not a function")
    return function


def tool_schema(function: Callable) -> dict:
    """The function's JSON schema for the chat template; ``ValueError`` naming the function and what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as err:  # noqa: BLE001 — TypeHintParsingException, DocstringParsingException, ...
        name = getattr(function, "__qualname__", repr(function))
        raise ValueError(
            f"the tool {name} (from {getattr(function, '__module__', '?')}) has no usable JSON schema: {err}. "
            "A tool needs a type hint on every argument and a Google-style docstring with a description "
            "and an Args: section describing each argument"
        ) from None


def bind_arguments(function: Callable, schema: dict, args: tuple, arguments: dict) -> inspect.BoundArguments:
    """The call's arguments by name, checked against the signature and the schema's JSON types."""
    name = schema["function"]["name"]
    try:
        bound = inspect.signature(function).bind(*args, **arguments)
    except TypeError as err:
        raise ToolError(f"bad arguments for {name}: {err}") from None
    properties = schema["function"]["parameters"].get("properties", {})
    for key, value in bound.arguments.items():
        problem = _type_problem(value, properties.get(key, {}))
        if problem:
            raise ToolError(f"bad argument {key}={value!r:.100} for {name}: {problem}")
    return bound


def _type_problem(value, spec: dict) -> str | None:
    """Why ``value`` does not fit the JSON schema ``spec`` (its type and enum only), or None."""
    types = spec.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if spec.get("nullable"):
            types.append("null")
        known = [t for t in types if t in JSON_TYPES]
        fits = any(
            isinstance(value, JSON_TYPES[t]) and not (isinstance(value, bool) and t in ("integer", "number"))
            for t in known
        )
        if known and not fits:
            return f"expected {' or '.join(known)}, got {type(value).__name__}"
    if "enum" in spec and value not in spec["enum"]:
        return f"expected one of {spec['enum']}"
    return None


def call_with_timeout(function: Callable, bound: inspect.BoundArguments, timeout: float, name: str):
    """``function(*bound.args, **bound.kwargs)`` in a daemon thread, waiting at most ``timeout`` seconds.

    Python cannot stop a thread: a call that runs past the limit is abandoned (it finishes, or not, in
    the background without holding up exit), and the model is told it timed out. Tools that might run
    for ever should bound their own work, as the calculator does.
    """
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*bound.args, **bound.kwargs)
        except BaseException as err:  # noqa: BLE001 — whatever the tool raises is reported to the model
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolError(f"{name} timed out after {timeout:g} s")
    if "error" in outcome:
        err = outcome["error"]
        raise ToolError(f"{name} failed: {type(err).__name__}: {err}")
    return outcome["value"]


def result_text(value, max_chars: int) -> str:
    """A tool's return value as text (strings as they are, anything else as JSON), cut to ``max_chars``."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= max_chars else text[:max_chars] + f"... [cut: {len(text)} characters]"
