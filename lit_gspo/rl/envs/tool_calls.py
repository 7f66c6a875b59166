"""Call formats: how a model writes tool calls in its reply, how the tools are described to it, and how
results read back when chat templating is off. Picked by name in :class:`~lit_gspo.rl.envs.ToolUse`
(``call_format: hermes`` or ``plain``) or given as an instance of your own :class:`CallFormat`.

``hermes`` (Hermes, Qwen2.5/Qwen3, SmolLM3's ``xml_tools``): a JSON object in tags, one per call::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 45"}}
    </tool_call>

``plain`` (for small models and templates that cannot express tool calls): the word ``CALL`` then a
Python-style call whose arguments are literals (strings, numbers, lists, ...), positional or by name; the
call ends at its closing parenthesis, so text may follow it::

    CALL calculator("123 * 45")
    I will CALL calculator(expression="123 * 45") and then answer.

A line that starts with ``CALL`` is always a call (one that cannot be read is reported to the model);
inside a line, ``CALL`` counts only when a name and ``(`` follow, so prose such as "no need to CALL
anything" is not a call.

Parsing never runs what the model wrote: JSON is read with :func:`json.loads`, a ``CALL`` line with
:func:`ast.parse` and :func:`ast.literal_eval` (literals only; names, operators and calls are refused).
A call that cannot be read still counts as a call: it comes back with ``error`` set, so the model is told.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and arguments, or why it could not be read (``error``)."""

    name: str
    arguments: dict = field(default_factory=dict)
    args: tuple = ()  # positional arguments (the plain format allows them)
    error: str | None = None


class CallFormat:
    """Parses calls from a reply, describes tools in plain text, renders results as text."""

    def parse(self, reply: str) -> list[ToolCall]:
        """The calls in ``reply``, in order; [] when it makes none."""
        raise NotImplementedError

    def describe(self, schemas: list[dict]) -> str:
        """Instructions for the system prompt: the tools (from their JSON schemas) and how to call them."""
        raise NotImplementedError

    def results_text(self, results: list[str]) -> str:
        """The tools' results as text appended after the reply when chat templating is off."""
        raise NotImplementedError


_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesFormat(CallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a JSON list of such objects inside
    one pair of tags (SmolLM2's function-calling data) is read as several calls. An unclosed last tag
    (a reply cut by the token limit) is read up to the end of the reply."""

    def parse(self, reply: str) -> list[ToolCall]:
        calls = []
        for body in _TOOL_CALL.findall(reply):
            try:
                value = json.loads(body)
            except json.JSONDecodeError as err:
                calls.append(ToolCall("", error=f"the tool call is not valid JSON ({err}): {body.strip()[:200]!r}"))
                continue
            calls.extend(_from_json(item) for item in (value if isinstance(value, list) else [value]))
        return calls

    def describe(self, schemas: list[dict]) -> str:
        listed = "\n".join(json.dumps(schema) for schema in schemas)
        return (
            "You can call functions to help with the user's request. Their signatures, as JSON schemas, are "
            f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call>:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>\n'
            "The results come back in the next message. When you know the answer, reply without a tool call."
        )

    def results_text(self, results: list[str]) -> str:
        return "".join(f"\n<tool_response>\n{result}\n</tool_response>" for result in results) + "\n"


def _from_json(value) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(
            "", error=f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {value!r:.200}'
        )
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(
            value["name"], error=f"the arguments of {value['name']!r} must be a JSON object, got {arguments!r:.200}"
        )
    return ToolCall(value["name"], arguments)


_CALL = re.compile(r"\bCALL[ \t]+(?=(.*))")  # the lookahead keeps a second CALL on the same line findable
_NAME_AND_PAREN = re.compile(r"[A-Za-z_]\w*\(")


class PlainFormat(CallFormat):
    """``CALL name(arg, key=value)`` with literal arguments; results read ``RESULT: ...``."""

    def parse(self, reply: str) -> list[ToolCall]:
        calls = []
        for match in _CALL.finditer(reply):
            line_start = reply.rfind("\n", 0, match.start()) + 1
            rest = match.group(1)
            if reply[line_start : match.start()].strip() == "" or _NAME_AND_PAREN.match(rest):
                calls.append(_read_call(_call_text(rest)))
        return calls

    def describe(self, schemas: list[dict]) -> str:
        lines = ["You can call these tools:"]
        for schema in schemas:
            function = schema["function"]
            properties = function["parameters"].get("properties", {})
            signature = ", ".join(f"{name}: {spec.get('type', 'any')}" for name, spec in properties.items())
            lines.append(f"{function['name']}({signature}): {function.get('description', '')}")
            lines += [f"    {name}: {spec.get('description', '')}" for name, spec in properties.items()]
        first = schemas[0]["function"]
        example = ", ".join(f'{name}="..."' for name in first["parameters"].get("required", [])[:1])
        lines += [
            "To call a tool, write a line that starts with CALL, for example:",
            f"CALL {first['name']}({example})",
            "The result comes back in the next message. When you know the answer, reply without CALL.",
        ]
        return "\n".join(lines)

    def results_text(self, results: list[str]) -> str:
        return "".join(f"\nRESULT: {result}" for result in results) + "\n"


def _call_text(line: str) -> str:
    """The shortest start of ``line`` that reads as a call (up to a closing parenthesis), else the whole line."""
    for end in (i + 1 for i, char in enumerate(line) if char == ")"):
        try:
            if isinstance(ast.parse(line[:end], mode="eval").body, ast.Call):
                return line[:end]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    return line.strip()


def _read_call(line: str) -> ToolCall:
    usage = "write CALL name(argument, key=value) with literal arguments (strings, numbers, lists, ...)"
    try:
        node = ast.parse(line, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return ToolCall("", error=f"cannot read the call {line!r:.200} ({getattr(err, 'msg', err)}); {usage}")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall("", error=f"{line!r:.200} is not a call of a tool by its name; {usage}")
    name = node.func.id
    if any(isinstance(arg, ast.Starred) for arg in node.args) or any(kw.arg is None for kw in node.keywords):
        return ToolCall(name, error=f"{line!r:.200}: *args and **kwargs are not allowed; {usage}")
    try:
        args = tuple(ast.literal_eval(arg) for arg in node.args)
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return ToolCall(name, error=f"the arguments of {name} in {line!r:.200} are not literals; {usage}")
    return ToolCall(name, arguments, args)


CALL_FORMATS: dict[str, type[CallFormat]] = {"hermes": HermesFormat, "plain": PlainFormat}


def get_call_format(call_format: str | CallFormat) -> CallFormat:
    """A :class:`CallFormat` instance from a name in ``CALL_FORMATS`` (or the instance itself)."""
    if isinstance(call_format, CallFormat):
        return call_format
    if call_format not in CALL_FORMATS:
        raise ValueError(
            f"unknown call_format {call_format!r}; use one of {sorted(CALL_FORMATS)} or a CallFormat instance"
        )
    return CALL_FORMATS[call_format]()
