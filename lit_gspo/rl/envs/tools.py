"""``ToolUse``: the policy may call plain Python functions before it answers.

    reply with calls    → each call runs (time-limited); observation = one tool message per call, done=False
    reply without calls → done=True; the reward functions score this last reply

How the tools reach the model: when chat templating is on and the template renders ``tools=`` (Qwen,
Hermes, SmolLM3, ...), the schemas go there and the template's own instructions apply. Otherwise (a
template that ignores ``tools=``, such as SmolLM2's, or templating off) the call format's plain-text
description is added to the system prompt. ``tools_in_system_prompt=True`` forces the latter.

Observations are ``{"role": "tool", "name": ..., "content": ...}`` messages. With templating off they
are appended as the call format's text instead (e.g. ``RESULT: 5535``), rendered in
:meth:`ToolUse.encode_observation`, which is the one place that knows whether templating is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lit_gspo.data import encode_prompts
from lit_gspo.data.prompts import template_arguments
from lit_gspo.rl.envs.base import Conversation, Environment, Turn
from lit_gspo.rl.envs.tool_calls import CallFormat, ToolCall, get_call_format
from lit_gspo.rl.envs.tool_functions import (
    ToolError,
    bind_arguments,
    call_with_timeout,
    resolve_tool,
    result_text,
    tool_schema,
)


class ToolUse(Environment):
    """Offers typed, documented Python functions to the policy as tools.

    Args:
        tools: functions, or their import paths (``"lit_gspo.rl.envs.calculator.calculator"``, usable from YAML).
            Each needs a type hint on every argument and a Google-style docstring with an ``Args:`` section.
        call_format: how calls are written: ``"hermes"`` (``<tool_call>{json}</tool_call>``), ``"plain"``
            (``CALL name(args)`` lines), or a :class:`~lit_gspo.rl.envs.tool_calls.CallFormat`.
        timeout: seconds one call may run before the model is told it timed out.
        max_calls_per_turn: calls run per reply; further calls are answered with an error.
        max_result_chars: a longer result is cut to this many characters.
        tools_in_system_prompt: describe the tools in the system prompt (True), through the template's
            ``tools=`` (False), or whichever the template supports (None).
        demonstration: the replies of a right episode for the supervised warm start, each formatted with the
            row's columns, e.g. ``['CALL calculator("{expression}")', "{answer}"]``; None: the answer alone.
        system_prompt, chat_template, max_turns, max_episode_tokens: as in :class:`Environment`.
    """

    metric_names = ("tool_calls", "tool_errors")

    def __init__(
        self,
        tools: Sequence[str | Callable] = ("lit_gspo.rl.envs.calculator.calculator",),
        call_format: str | CallFormat = "hermes",
        timeout: float = 5.0,
        max_calls_per_turn: int = 4,
        max_result_chars: int = 2000,
        tools_in_system_prompt: bool | None = None,
        system_prompt: str | None = None,
        chat_template: bool | None = None,
        max_turns: int = 3,
        max_episode_tokens: int | None = None,
        demonstration: Sequence[str] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        super().__init__(
            system_prompt=system_prompt,
            chat_template=chat_template,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            demonstration=demonstration,
            chat_template_kwargs=chat_template_kwargs,
        )
        if isinstance(tools, (str, bytes)) or not tools:
            raise ValueError(f"ToolUse needs a non-empty list of tools (functions or import paths), got {tools!r}")
        if timeout <= 0 or max_calls_per_turn < 1 or max_result_chars < 1:
            raise ValueError(
                f"need timeout > 0, max_calls_per_turn >= 1 and max_result_chars >= 1, got timeout={timeout}, "
                f"max_calls_per_turn={max_calls_per_turn}, max_result_chars={max_result_chars}"
            )
        functions = [resolve_tool(tool) for tool in tools]
        self.schemas = [tool_schema(function) for function in functions]
        names = [schema["function"]["name"] for schema in self.schemas]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"two tools share the name(s) {duplicates}; tool names must be unique")
        self.functions, self._schema = dict(zip(names, functions)), dict(zip(names, self.schemas))
        self.call_format = get_call_format(call_format)
        self.timeout, self.max_calls_per_turn, self.max_result_chars = timeout, max_calls_per_turn, max_result_chars
        self.tools_in_system_prompt = tools_in_system_prompt

    def __repr__(self) -> str:
        return (
            f"ToolUse(tools={list(self.functions)}, call_format={type(self.call_format).__name__}, "
            f"timeout={self.timeout}, max_turns={self.max_turns})"
        )

    def tools(self) -> list[dict]:
        return self.schemas

    def step(self, row: dict, reply: str, state: dict) -> Turn:
        calls = self.call_format.parse(reply)
        if not calls:
            return Turn(done=True, metrics={"tool_calls": 0.0, "tool_errors": 0.0})
        answers = [self.call(call) for call in calls[: self.max_calls_per_turn]]
        skipped = (f"Error: only {self.max_calls_per_turn} tool calls are run per reply; this one was not", False)
        answers += [skipped] * (len(calls) - len(answers))
        observation = [{"role": "tool", "name": call.name, "content": text} for call, (text, _) in zip(calls, answers)]
        errors = sum(not ok for _, ok in answers)
        return Turn(
            observation=observation, done=False, metrics={"tool_calls": float(len(calls)), "tool_errors": float(errors)}
        )

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """Run one call: (the text the model reads, whether it succeeded). Never raises for the tool's faults."""
        try:
            if call.error:
                raise ToolError(call.error)
            if call.name not in self.functions:
                raise ToolError(f"unknown tool {call.name!r}; the tools are {sorted(self.functions)}")
            function = self.functions[call.name]
            bound = bind_arguments(function, self._schema[call.name], call.args, call.arguments)
            value = call_with_timeout(function, bound, self.timeout, call.name)
        except ToolError as err:
            return f"Error: {err}", False
        return result_text(value, self.max_result_chars), True

    def describes_tools_in_text(self, tokenizer) -> bool:
        """Whether the tools go into the system prompt as text (else through the template's ``tools=``)."""
        if self.tools_in_system_prompt is not None:
            return self.tools_in_system_prompt
        return not (
            self.uses_chat_template(tokenizer)
            and template_renders_tools(tokenizer, self.schemas, self.chat_template_kwargs)
        )

    def encode(self, tokenizer, rows: list[dict], max_prompt_length: int) -> list[list[int]]:
        if not self.describes_tools_in_text(tokenizer):
            if not self.uses_chat_template(tokenizer):
                raise ValueError(
                    "tools_in_system_prompt=False but chat templating is off, so the model would never "
                    "see the tools; use tools_in_system_prompt=None or True"
                )
            return super().encode(tokenizer, rows, max_prompt_length)
        instructions = self.call_format.describe(self.schemas)
        system = instructions if self.system_prompt is None else f"{self.system_prompt}\n\n{instructions}"
        prompts = [_with_system(self.prompt(row), instructions) for row in rows]
        return encode_prompts(
            tokenizer,
            prompts,
            chat_template=self.chat_template,
            max_prompt_length=max_prompt_length,
            system_prompt=system,
            template_kwargs=self.chat_template_kwargs,
        )

    def encode_observation(self, tokenizer, observation: Conversation, reply_end: str) -> list[int]:
        if isinstance(observation, list) and not self.uses_chat_template(tokenizer):
            observation = self.call_format.results_text([message["content"] for message in observation])
        return super().encode_observation(tokenizer, observation, reply_end)


def template_renders_tools(tokenizer, schemas: list[dict], template_kwargs: dict | None = None) -> bool:
    """True when the tokenizer's chat template writes ``tools=`` into the prompt (SmolLM2's ignores them)."""
    messages = [{"role": "user", "content": "x"}]
    with_tools = tokenizer.apply_chat_template(messages, tokenize=False, **template_arguments(schemas, template_kwargs))
    return with_tools != tokenizer.apply_chat_template(
        messages, tokenize=False, **template_arguments(None, template_kwargs)
    )


def _with_system(prompt: Conversation, instructions: str) -> Conversation:
    """A message-list prompt with its own system message gets the instructions appended to it (``encode_prompts``
    adds the system prompt only to prompts without one)."""
    if isinstance(prompt, str) or not any(m.get("role") == "system" for m in prompt):
        return prompt
    return [{**m, "content": f"{m['content']}\n\n{instructions}"} if m.get("role") == "system" else m for m in prompt]
