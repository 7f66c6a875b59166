"""A reply ends at every token that ends one (lit_gspo.rl.stop_tokens): the chat template's turn closing and the
model's generation_config eos ids, not the tokenizer's eos alone — in every engine, in multi-turn episodes, in the
warm start's demonstrations, and from a checkpoint directory as a user loads one."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from transformers import GenerationConfig

from lit_gspo.models.builders import build_from_config, tiny_llama_config
from lit_gspo.models.loading import load_policy
from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.config import Generation, Policy, Update
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler
from lit_gspo.rl.envs import Environment, SingleTurn, Turn
from lit_gspo.rl.objectives import GRPO
from lit_gspo.rl.rewards import CharAccuracy, RewardSet
from lit_gspo.rl.stages import build_stages
from lit_gspo.rl.stop_tokens import stop_token_ids, turn_closing_token
from lit_gspo.rl.warm_start import demonstration_batch

# Gemma's shape: the template closes a turn with <end_of_turn>, which the tokenizer does not call eos (<eos>)
GEMMA_LIKE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
ROWS = [{"prompt": "rev 12=", "answer": "21"}, {"prompt": "rev 345=", "answer": "543"}]


def gemma_like_tokenizer(template: str | None = GEMMA_LIKE):
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = template
    tok.padding_side = "left"
    return tok


def eot(tok) -> int:
    return tok.convert_tokens_to_ids("<end_of_turn>")


def replying(tok, logits: dict[str, float]) -> nn.Module:
    """A tiny Llama whose next-token logits are ``logits`` (token → logit, the rest −30) at every position: its
    replies are runs of those tokens, whatever the prompt."""
    model = build_from_config(tiny_llama_config(vocab_size=len(tok), tie_word_embeddings=False), seed=0)
    head = nn.Linear(model.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        for token, value in logits.items():
            head.bias[tok.convert_tokens_to_ids(token)] = value
    model.lm_head = head
    return model.eval()


def test_the_stop_ids_are_the_template_closing_the_tokenizer_eos_and_the_generation_config_eos_in_order():
    tok = gemma_like_tokenizer()
    model = replying(tok, {})
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, eot(tok), 5])
    assert turn_closing_token(tok) == eot(tok)
    assert stop_token_ids(tok, model, chat_template=True) == [eot(tok), tok.eos_token_id, 5]
    assert stop_token_ids(tok, model) == [tok.eos_token_id, eot(tok), 5]  # raw prompts: no template's closing
    model.generation_config = GenerationConfig(eos_token_id=7)
    assert stop_token_ids(tok, model) == [tok.eos_token_id, 7]
    assert stop_token_ids(tok, None, chat_template=True) == [eot(tok), tok.eos_token_id]


def turns(opening: str, closing: str) -> str:
    """A template writing each message as ``opening`` (with ``ROLE``) + content + ``closing``."""
    head = opening.replace("ROLE", "' + m.role + '")
    return (
        f"{{% for m in messages %}}{{{{ '{head}' + m.content + '{closing}' }}}}{{% endfor %}}"
        f"{{% if add_generation_prompt %}}{{{{ '{opening.replace('ROLE', 'assistant')}' }}}}{{% endif %}}"
    )


#: the ways chat templates close an assistant turn (each family's shape, written here): a special token of its own,
#: the tokenizer's eos, text, nothing
TEMPLATE_SHAPES = {
    "chatml (Qwen, SmolLM2)": (
        turns("<|im_start|>ROLE\\n", "<|im_end|>\\n"),
        ["<|im_start|>", "<|im_end|>"],
        "<|im_end|>",
    ),
    "llama 3": (
        turns("<|start_header_id|>ROLE<|end_header_id|>\\n\\n", "<|eot_id|>"),
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
    ),
    "phi-3": (turns("<|ROLE|>\\n", "<|end|>\\n"), ["<|user|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    "gemma": (GEMMA_LIKE, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "deepseek": (turns("<｜ROLE｜>", "<｜end▁of▁sentence｜>"), ["<｜end▁of▁sentence｜>"], "<｜end▁of▁sentence｜>"),
    "zephyr: the eos": (turns("<|ROLE|>\\n", "<eos>\\n"), ["<|user|>", "<|assistant|>"], "<eos>"),
    "text": (turns("ROLE: ", "\\n\\n"), [], None),
    "nothing": (turns("", ""), [], None),
}


@pytest.mark.parametrize("shape", TEMPLATE_SHAPES)
def test_the_turn_closing_of_each_template_shape_is_the_first_stop_id_and_the_eos_counts_once(shape):
    template, specials, closing = TEMPLATE_SHAPES[shape]
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    expected = None if closing is None else tok.convert_tokens_to_ids(closing)
    assert turn_closing_token(tok) == expected
    stops = stop_token_ids(tok, chat_template=True)
    assert stops == ([] if expected in (None, tok.eos_token_id) else [expected]) + [tok.eos_token_id]


def test_a_template_that_cannot_render_a_reply_leaves_the_eos_and_says_so():
    tok = gemma_like_tokenizer(
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no replies here') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    with pytest.warns(RuntimeWarning, match="cannot render a user turn and an assistant reply .*no replies here"):
        assert stop_token_ids(tok, chat_template=True) == [tok.eos_token_id]


def collector(tok, engine, env=None, max_new=12, G=4):
    return Collector(
        env or SingleTurn(),
        engine,
        RewardSet([CharAccuracy()]),
        tok,
        Generation(num_generations=G, max_new_tokens=max_new, temperature=1.0),
    )


@pytest.mark.parametrize("engine", [LeanSampler, StaticCacheSampler, HFGenerate], ids=lambda e: e.__name__)
def test_every_engine_ends_a_reply_at_the_templates_turn_closing(engine):
    """Replies are 'a's, each followed by <end_of_turn> with probability ~0.4: each must stop at its first one, the
    loss mask through it and no further, the reply text the 'a's before it (with the tokenizer's eos alone, a reply
    ran on past the turn's end to the token budget)."""
    tok = gemma_like_tokenizer()
    policy = replying(tok, {"a": 0.0, "<end_of_turn>": -0.4})
    torch.manual_seed(0)
    batch, replies, stats = collector(tok, engine()).sample(policy, ROWS)
    assert stats["clipped_ratio"] == 0.0  # every reply ended, none was cut by the budget
    completions = batch.input_ids[:, batch.prompt_length :]
    lengths = batch.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # replies of several lengths: the stop decided where each ended
    for row, mask, n, reply in zip(completions, batch.completion_mask, lengths.tolist(), replies):
        assert mask[:n].all() and not mask[n:].any()
        assert row[n - 1] == eot(tok) and (row[: n - 1] == tok.convert_tokens_to_ids("a")).all()
        assert reply == "a" * (n - 1)


def test_the_share_of_replies_the_budget_cut_is_logged_as_trls_clipped_ratio():
    tok = gemma_like_tokenizer()
    endless = replying(tok, {"a": 0.0})  # never a stop token: every reply runs to max_new_tokens
    _, replies, stats = collector(tok, LeanSampler(), max_new=5).sample(endless, ROWS)
    assert stats["clipped_ratio"] == 1.0 and replies == ["aaaaa"] * 8
    half = replying(tok, {"a": 0.0, "<end_of_turn>": 0.0})
    torch.manual_seed(3)
    batch, _, stats = collector(tok, LeanSampler(), max_new=3).sample(half, ROWS)
    ends = batch.input_ids[:, batch.prompt_length :].gather(1, batch.completion_mask.sum(1, keepdim=True) - 1)
    assert stats["clipped_ratio"] == float((ends != eot(tok)).float().mean())
    assert 0.0 < stats["clipped_ratio"] < 1.0


class Talker(Environment):
    def step(self, row, reply, state):
        return Turn(observation="more", done=state["turn"] == 2)


@pytest.mark.parametrize("engine", [LeanSampler, HFGenerate], ids=lambda e: e.__name__)
def test_a_turn_closed_by_the_reply_is_not_closed_again_by_the_next_observation(engine):
    tok = gemma_like_tokenizer()
    policy = replying(tok, {"a": 0.0, "<end_of_turn>": -0.4})
    torch.manual_seed(0)
    batch, _, _ = collector(tok, engine(), Talker(max_turns=2)).sample(policy, ROWS)
    P = batch.prompt_length
    for ids, real in zip(batch.input_ids[:, P:], batch.attention_mask[:, P:]):
        text = tok.decode(ids[real.bool()])
        assert re.fullmatch(
            r"a*<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\na*<end_of_turn>", text
        ), text


def test_a_demonstration_ends_with_the_turn_closing_and_its_observation_goes_on_after_it():
    tok = gemma_like_tokenizer()

    class Demonstrated(Talker):
        def demonstration(self, row):
            return ["ab", "cd"]

    env = Demonstrated(max_turns=2)
    rows = ROWS[:1]
    batch = demonstration_batch(env, tok, rows, env.encode(tok, rows, 100), end_id=eot(tok))
    ids = batch.input_ids[0, batch.prompt_length :][batch.attention_mask[0, batch.prompt_length :].bool()]
    expected = "ab<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\ncd<end_of_turn>"
    assert tok.decode(ids) == expected


def test_a_checkpoint_directorys_generation_config_adds_its_eos_ids_to_the_runs_stop_ids(tmp_path):
    """As a user loads a model (``model.policy.name: <dir>``): generation_config.json's eos ids are where replies
    end, beside the template's closing and the tokenizer's eos."""
    tok = gemma_like_tokenizer()
    model = build_from_config(tiny_llama_config(vocab_size=len(tok)), seed=0)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, eot(tok), 4])
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, _ = load_policy(str(tmp_path))
    assert loaded.generation_config.eos_token_id == [tok.eos_token_id, eot(tok), 4]
    stages = build_stages(
        Policy(name=str(tmp_path)),
        GRPO(),
        LeanSampler(),
        Generation(num_generations=2, max_new_tokens=4),
        Update(),
        rewards=None,
        reward_weights=None,
        environment=None,
        mismatch=None,
        seed=0,
    )
    assert stages.collector.stop_ids == [eot(tok), tok.eos_token_id, 4]


def test_a_fit_from_a_gemma_like_checkpoint_says_where_replies_end_and_which_settings_it_ignores(tmp_path, caplog):
    """`lit-gspo fit --model.policy.name <dir>` as a user runs it: the run's log names the stop tokens and the
    checkpoint's sampling settings no engine applies; the warm start and an RL step run on them."""
    import logging
    from pathlib import Path

    from lit_gspo.tools.main import cli_main

    tok = gemma_like_tokenizer()
    model = build_from_config(tiny_llama_config(vocab_size=len(tok)), seed=0)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, eot(tok)], repetition_penalty=1.05)
    checkpoint = tmp_path / "gemma-like"
    model.save_pretrained(checkpoint)
    tok.save_pretrained(checkpoint)
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    args = ["fit", "--config", str(config), "--model.policy.name", str(checkpoint), "--model.policy.config", "{}"]
    args += ["--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "runs")]
    args += ["--trainer.enable_progress_bar", "false", "--model.policy.warm_start.steps", "1"]
    args += ["--data.num_val", "4", "--data.num_train", "16", "--data.prompts_per_step", "2"]
    with caplog.at_level(logging.INFO):
        cli = cli_main(args)
    assert cli.trainer.global_step == 1
    assert cli.model.collector.stop_ids == [eot(tok), tok.eos_token_id]
    log = caplog.text
    assert f"replies end at any of <end_of_turn> ({eot(tok)}), <eos> ({tok.eos_token_id})" in log
    assert "the model's generation_config sets {'repetition_penalty': 1.05}; no engine applies them" in log
    import csv

    rows = list(csv.DictReader(open(next((tmp_path / "runs").rglob("metrics.csv")))))
    for name in ("train/clipped_ratio", "val/clipped_ratio"):  # every RL step's, every validation's (2: before, after)
        values = [float(r[name]) for r in rows if r.get(name)]
        assert len(values) == (1 if name.startswith("train") else 2) and all(0.0 <= v <= 1.0 for v in values)
