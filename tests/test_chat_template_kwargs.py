"""``chat_template_kwargs`` (TRL's option of that name): template variables every rendering of an environment passes
to the chat template — the first prompt, each observation's continuation, the turn closing the stop ids are read
from, the tools check — and from the command line as a TRL user sets Qwen3's ``enable_thinking``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_gspo.models.builders import build_from_config, tiny_llama_config
from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.config import Generation
from lit_gspo.rl.engines import LeanSampler
from lit_gspo.rl.envs import Environment, SingleTurn, ToolUse, Turn
from lit_gspo.rl.rewards import CharAccuracy, RewardSet
from lit_gspo.rl.stop_tokens import stop_token_ids

# Qwen3's shape: thinking off, the generation prompt carries an empty think block; a variable also changes the closing
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'assistant' and closing_token is defined %}{{ closing_token }}{% else %}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
NO_THINKING = {"enable_thinking": False}


def qwen3_like_tokenizer():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.chat_template = QWEN3_LIKE
    tok.padding_side = "left"
    return tok


class Asker(Environment):
    def step(self, row, reply, state):
        return Turn(observation="again", done=False)


def test_the_first_prompt_and_every_observation_render_with_the_variables():
    tok = qwen3_like_tokenizer()
    off, on = Asker(max_turns=2, chat_template_kwargs=NO_THINKING), Asker(max_turns=2)
    (prompt,) = off.encode(tok, [{"prompt": "hi"}], 100)
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(on.encode(tok, [{"prompt": "hi"}], 100)[0]).endswith("<|im_start|>assistant\n")
    observation = tok.decode(off.encode_observation(tok, "again", reply_end="<|im_end|>"))
    assert observation == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_the_stop_ids_read_the_turn_closing_rendered_with_the_variables():
    tok = qwen3_like_tokenizer()
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    closing_by = {"closing_token": "<|endoftext|>"}
    assert stop_token_ids(tok, chat_template=True, template_kwargs=closing_by)[0] == endoftext
    assert stop_token_ids(tok, chat_template=True)[0] == tok.convert_tokens_to_ids("<|im_end|>")
    env = SingleTurn(chat_template_kwargs=closing_by)
    collector = Collector(env, LeanSampler(), RewardSet([CharAccuracy()]), tok, Generation(num_generations=2))
    assert collector.stop_ids[0] == endoftext


def test_tool_use_passes_them_to_the_tools_check_and_the_prompt():
    tok = qwen3_like_tokenizer()
    tok.chat_template = "{% if tools and enable_thinking is defined %}TOOLS {% endif %}" + QWEN3_LIKE
    env = ToolUse(chat_template_kwargs=NO_THINKING)
    assert not env.describes_tools_in_text(tok)  # the template writes tools only with the variable set
    assert ToolUse().describes_tools_in_text(tok)  # without the variable it does not: the tools go in as text
    (ids,) = env.encode(tok, [{"prompt": "Q"}], 1000)
    assert tok.decode(ids).startswith("TOOLS <|im_start|>user\nQ")


@pytest.mark.parametrize(
    "value, message",
    [
        ("enable_thinking=False", "must map template variable names to values"),
        ({1: True}, "must map template variable names to values"),
        ({"tools": []}, "['tools'] are apply_chat_template's own arguments"),
        ({"add_generation_prompt": False, "x": 1}, "['add_generation_prompt'] are apply_chat_template's own"),
    ],
)
def test_a_bad_value_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SingleTurn(chat_template_kwargs=value)


def test_from_the_command_line_as_a_trl_user_sets_it(tmp_path):
    from lit_gspo.tools.main import cli_main

    tok = qwen3_like_tokenizer()
    checkpoint = tmp_path / "qwen3-like"
    build_from_config(tiny_llama_config(vocab_size=len(tok)), seed=0).save_pretrained(checkpoint)
    tok.save_pretrained(checkpoint)
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    args = ["fit", "--config", str(config), "--model.policy.name", str(checkpoint), "--model.policy.config", "{}"]
    args += [
        "--model.environment",
        "SingleTurn",
        "--model.environment.chat_template_kwargs",
        "{enable_thinking: false}",
    ]
    args += ["--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "runs")]
    args += ["--trainer.enable_progress_bar", "false", "--model.policy.warm_start.steps", "0"]
    args += ["--data.num_val", "4", "--data.num_train", "16", "--data.prompts_per_step", "2"]
    cli = cli_main(args)
    assert cli.trainer.global_step == 1
    assert cli.model.collector.environment.chat_template_kwargs == NO_THINKING
    (ids,) = cli.model.collector.encode(cli.model.policy, [{"prompt": "rev 12="}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
