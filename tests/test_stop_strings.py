"""Stop strings (lit_gspo.rl.stop_strings): a reply ends with the token that completes the first stop string it writes,
in every engine, in the loss mask, in the text the rewards and the environment read, and in the clipped ratio."""

from __future__ import annotations

import pytest
import torch
from test_stop_tokens import replying
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.config import Generation
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler
from lit_gspo.rl.envs import Environment, SingleTurn, Turn
from lit_gspo.rl.rewards import RewardSet
from lit_gspo.rl.stop_strings import StopStrings

ENGINES = [LeanSampler, StaticCacheSampler, HFGenerate]
ROWS = [{"prompt": "rev 12=", "answer": "21"}, {"prompt": "rev 345=", "answer": "543"}]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_reply_ends_with_the_token_completing_the_first_string_it_writes():
    tok = char_tokenizer()
    stop = StopStrings(tok, ["cd", "</a>"])
    assert stop.end(ids(tok, "ab</a>cd")) == 6  # '</a>' completes at the 6th character, before 'cd'
    assert stop.end(ids(tok, "abcd</a>")) == 4
    assert stop.end(ids(tok, "ab</a")) is None and stop.end([]) is None
    assert stop.end(ids(tok, "c") + [tok.eos_token_id] + ids(tok, "d")) == 3  # special tokens are not text: 'cd'


def words_tokenizer() -> PreTrainedTokenizerFast:
    """Whole words as tokens, one of which writes past a stop string ('</a>bar')."""
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "foo", "</a>bar", "x"])}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def test_the_token_that_completes_a_string_is_kept_whole():
    tok = words_tokenizer()
    assert StopStrings(tok, ["</a>"]).end(ids(tok, "foo x </a>bar foo")) == 3


def test_cut_masks_after_the_string_and_keeps_an_earlier_eos():
    tok = char_tokenizer()
    stop = StopStrings(tok, ["ab"])
    rows = [ids(tok, "xxabyy"), ids(tok, "x") + [tok.eos_token_id] + ids(tok, "abyy"), ids(tok, "xxxxxx")]
    completions = torch.tensor(rows)
    through_eos = torch.tensor([[True] * 6, [True, True] + [False] * 4, [True] * 6])
    cut = stop.cut(completions, through_eos)
    assert cut.sum(1).tolist() == [4, 2, 6]
    assert through_eos.sum(1).tolist() == [6, 2, 6]  # the mask given is left as it was


def test_written_reads_the_tail_the_newest_tokens_can_complete_a_string_in():
    tok = char_tokenizer()
    stop = StopStrings(tok, ["ab"])
    replies = torch.tensor([ids(tok, t) for t in ["x" * 15 + "ab", "ab" + "x" * 15, "x" * 17]])
    assert stop.window + 1 < replies.shape[1]
    assert stop.written(replies).tolist() == [True, False, False]  # the second's was written long before: seen then
    assert stop.written(replies, new=17).tolist() == [True, True, False]


def test_bad_stop_settings_name_the_value():
    with pytest.raises(ValueError, match=r"stop must be a list of strings, e\.g\. \['</answer>'\].*got '</a>'"):
        Generation(stop="</a>")
    with pytest.raises(ValueError, match=r"stop strings must be non-empty strings; got \[''\]"):
        Generation(stop=["</a>", ""])
    assert Generation(stop=["</a>", "</a>"]).stop == ["</a>", "</a>"]


def collector(engine, stop, env=None, max_new=12, G=4, scored=None):
    tok = char_tokenizer()

    def score(prompts, completions, **kw):
        if scored is not None:
            scored.extend(completions)
        return [0.0] * len(completions)

    return tok, Collector(
        env or SingleTurn(),
        engine,
        RewardSet([score]),
        tok,
        Generation(num_generations=G, max_new_tokens=max_new, temperature=1.0, stop=stop),
    )


class Forwards:
    """Counts a model's forwards."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(lambda *args: setattr(self, "calls", self.calls + 1))


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_every_engine_ends_each_reply_at_its_first_stop_string_and_stops_sampling_it(engine):
    """Replies are random a's and b's; with the stop string 'ab' each must end at its first 'ab' (or run to the
    budget without one), the loss mask through its last character, the rewards reading that text. The engines stop
    sampling once every row has written it (the static-cache sampler within its check cadence)."""
    scored = []
    tok, c = collector(engine(), ["ab"], max_new=40, scored=scored)
    policy = replying(tok, {"a": 0.0, "b": 0.0})
    forwards = Forwards(policy)
    torch.manual_seed(0)
    batch, replies, stats = c.sample(policy, ROWS)
    lengths = batch.completion_mask.sum(1).tolist()
    assert all(r.endswith("ab") and r.index("ab") == len(r) - 2 for r in replies), replies
    assert [len(r) for r in replies] == lengths and scored == replies
    assert len(set(lengths)) > 1 and stats["clipped_ratio"] == 0.0
    for row, n, reply in zip(batch.input_ids[:, batch.prompt_length :], lengths, replies):
        assert tok.decode(row[:n]) == reply
    cadence = 8 if engine is StaticCacheSampler else 1
    assert forwards.calls <= -(-max(lengths) // cadence) * cadence + 1 < 40


def test_without_stop_strings_the_same_greedy_tokens_run_on():
    """The cut is a prefix of what the engine samples without it: greedy tokens with and without a stop string agree
    up to the string."""
    tok, plain = collector(LeanSampler(), None, max_new=10, G=1)
    policy = replying(tok, {"a": 0.0, "b": -0.1})  # greedy: 'aaaa…'
    _, (full,), _ = plain.sample(policy, ROWS[:1], greedy=True)
    _, stopped = collector(LeanSampler(), ["aaa"], max_new=10, G=1)
    _, (cut,), stats = stopped.sample(policy, ROWS[:1], greedy=True)
    assert full == "a" * 10 and cut == "aaa" and stats["clipped_ratio"] == 0.0


class Search(Environment):
    """A ReAct-style loop without a chat template: the reply stops at 'ab', the observation goes on right after it."""

    def step(self, row, reply, state):
        return Turn(observation="[x]", done=state["turn"] == 2)


@pytest.mark.parametrize("engine", [LeanSampler, HFGenerate], ids=lambda e: e.__name__)
def test_a_multi_turn_episode_goes_on_right_after_the_string(engine):
    tok, c = collector(engine(), ["ab"], env=Search(max_turns=2, chat_template=False), max_new=30)
    policy = replying(tok, {"a": 0.0, "b": 0.0})
    torch.manual_seed(1)
    batch, replies, stats = c.sample(policy, ROWS)
    P = batch.prompt_length
    for row, real in zip(batch.input_ids[:, P:], batch.attention_mask[:, P:]):
        first, rest = tok.decode(row[real.bool()]).split("[x]")
        assert first.endswith("ab") and first.index("ab") == len(first) - 2
        assert rest.endswith("ab") and rest.index("ab") == len(rest) - 2
    assert stats["clipped_ratio"] == 0.0


def test_a_fit_takes_its_stop_strings_from_the_command_line(tmp_path, caplog):
    import logging

    from test_trainer import tiny_args

    from lit_gspo.tools.main import cli_main

    args = tiny_args(tmp_path, "--trainer.max_steps", "1", "--model.generation.max_new_tokens", "12")
    with caplog.at_level(logging.INFO):
        cli = cli_main([*args, "--model.generation.stop", "['1', '2']"], run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    assert "replies also end at the strings ['1', '2']" in caplog.text
    torch.manual_seed(0)
    rows = cli.datamodule.train_rows[:4]
    batch, replies, _ = cli.model.collector.sample(cli.model.policy, rows)
    ended = [r for r in replies if "1" in r or "2" in r]
    assert ended and all(r[-1] in "12" and "1" not in r[:-1] and "2" not in r[:-1] for r in ended)


def test_a_demonstration_ends_at_its_stop_string_as_a_sampled_reply_does():
    """A ReAct demonstration without a chat template: each reply ends with its string (no end token after it, and
    what it writes after the string dropped), the observation right after it; a reply without one gets the end token."""
    from lit_gspo.rl.warm_start import demonstration_batch

    tok = char_tokenizer()

    class Demonstrated(Search):
        def demonstration(self, row):
            return ["q ab tail", "no string"]

    env = Demonstrated(max_turns=2, chat_template=False)
    rows = ROWS[:1]
    batch = demonstration_batch(env, tok, rows, env.encode(tok, rows, 100), stop=StopStrings(tok, ["ab"]))
    P = batch.prompt_length
    real = batch.attention_mask[0, P:].bool()
    assert tok.decode(batch.input_ids[0, P:][real]) == "q ab[x]no string<eos>"
    trained = batch.input_ids[0, P:][batch.completion_mask[0]]
    assert tok.decode(trained) == "q abno string<eos>"
