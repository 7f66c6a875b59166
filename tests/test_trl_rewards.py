"""TRL's reward contract (issue 29): reward functions written for TRL's ``GRPOTrainer`` run unchanged, and a reward
that fails as a whole stops the run at its first scoring instead of masking every sample for many steps.

The examples follow the semantics of TRL's GRPOTrainer docs, "Using a custom reward function", Examples 1-6
(https://huggingface.co/docs/trl/main/en/grpo_trainer#using-a-custom-reward-function); the code here is our own.
The new names are read from the module (``R.TrainerState``), so on the code before issue 29 each test fails on
its own behaviour, not all at once on an import.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

from lit_gspo.rl import rewards as R
from lit_gspo.rl.rewards import RewardSet, RewardWarning

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def no_warnings():
    """Any warning (a masked sample) inside fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def chat(text: str, role: str = "user") -> list[dict]:
    return [{"role": role, "content": text}]


def assistant(texts: list[str]) -> list[list[dict]]:
    """Completions in TRL's conversational format: one assistant message each."""
    return [chat(t, "assistant") for t in texts]


# ---------------------------------------------------------------- Examples 1 and 1.1: length in tokens and characters
STD_PROMPTS = ["The sky is", "The sun is"]
STD_COMPLETIONS = [" blue.", " in the sky."]
STD_IDS = [[6303, 13], [304, 279, 12884, 13]]


def test_example_1_token_length_and_1_1_character_length():
    def token_length(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    def char_length(completions, **kwargs):
        return [float(len(text)) for text in completions]

    rs = RewardSet([token_length, char_length], weights=[1.0, 0.5])
    scores = rs.score(STD_PROMPTS, STD_COMPLETIONS, {}, completion_ids=STD_IDS)
    assert scores.per_function["token_length"].tolist() == [2.0, 4.0]  # the docs' expected output
    assert scores.per_function["char_length"].tolist() == [6.0, 12.0]
    assert scores.total.tolist() == [2.0 + 3.0, 4.0 + 6.0] and scores.valid.all()


# ---------------------------------------------------------------- Example 2: conversational format
THINK_ANSWER = r"^<think>.*?</think><answer>.*?</answer>$"


def think_answer_format(completions, **kwargs):
    """Example 2's semantics: the first message's content must be <think>...</think><answer>...</answer>."""
    return [1.0 if re.match(THINK_ANSWER, completion[0]["content"]) else 0.0 for completion in completions]


CHAT_PROMPTS = [chat("What is the result of (1 + 2) * 4?"), chat("What is the result of (3 + 1) * 2?")]
CHAT_REPLIES = ["<think>3 times 4 is 12.</think><answer>12</answer>", "3 plus 1 is 4, times 2 is 8."]


def test_example_2_conversational_completions_are_message_lists():
    completions = R.conversation_completions(CHAT_PROMPTS, [[r] for r in CHAT_REPLIES])
    assert completions == assistant(CHAT_REPLIES)
    with no_warnings():
        scores = RewardSet([think_answer_format]).score(CHAT_PROMPTS, completions, {})
    assert scores.total.tolist() == [1.0, 0.0] and scores.valid.all()
    # text prompts keep text completions (TRL's standard format): the last reply
    assert R.conversation_completions(["a", "b"], [["x"], ["y", "z"]]) == ["x", "z"]


def test_a_multi_turn_chat_completion_lists_replies_and_observations():
    prompts = [chat("q")]
    got = R.conversation_completions(prompts, [["r1", "r2", "r3"]], [["try again", chat('{"x": 1}', "tool"), None]])
    assert got == [
        [
            {"role": "assistant", "content": "r1"},
            {"role": "user", "content": "try again"},
            {"role": "assistant", "content": "r2"},
            {"role": "tool", "content": '{"x": 1}'},
            {"role": "assistant", "content": "r3"},
        ]
    ]
    assert R.completion_text(got[0]) == "r3"  # what the built-ins score: the last reply


def test_builtin_rewards_read_chat_completions():
    completions = assistant([" 12 ", "13"])
    prompts = [chat("rev 21="), chat("rev 21=")]
    with no_warnings():
        scores = RewardSet([R.ExactMatch(), R.CharAccuracy(), R.FormatReward(r"\d+")]).score(
            prompts, completions, {"answer": ["12", "12"]}
        )
    assert scores.per_function["exact_match"].tolist() == [1.0, 0.0]
    assert scores.per_function["char_accuracy"].tolist() == pytest.approx([1.0, 0.5])
    assert scores.per_function["format_reward"].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------- Example 3: a dataset column by its own name
def boxed_matches_ground_truth(completions, ground_truth, **kwargs):
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    return [1.0 if m is not None and m.group(1) == gt else 0.0 for m, gt in zip(found, ground_truth)]


def test_example_3_reference_column():
    prompts = ["Solve 2x + 3 = 7.", "Solve 3x - 5 = 10."]
    completions = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    scores = RewardSet([boxed_matches_ground_truth]).score(prompts, completions, {"ground_truth": ["2", "5"]})
    assert scores.total.tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- Example 4: multi-task rewards returning None
def check_math_solution(prompt: str, completion: str) -> bool:
    a, op, b = re.search(r"(\d+)\s*([+*])\s*(\d+)", prompt).groups()
    return completion.strip() == str(int(a) + int(b) if op == "+" else int(a) * int(b))


def test_code_solution(prompt: str, completion: str) -> bool:  # noqa: PT004 — a helper, named as in the docs
    return "def " in completion and "return" in completion


test_code_solution.__test__ = False  # not a pytest test


def math_reward(prompts, completions, task, **kwargs):
    return [
        (1.0 if check_math_solution(p, c) else -1.0) if t == "math" else None
        for p, c, t in zip(prompts, completions, task)
    ]


def make_coding_reward(task_name: str):
    def coding_reward(prompts, completions, task, **kwargs):
        return [
            (1.0 if test_code_solution(p, c) else -1.0) if t == task_name else None
            for p, c, t in zip(prompts, completions, task)
        ]

    return coding_reward


TASK_ROWS = [
    ("What is 2+2?", "math", "4"),
    ("Write a function that returns the sum.", "code", "def f(a, b): return a + b"),
    ("What is 3*4?", "math", "13"),
    ("Write a function that returns the product.", "code", "def f(a, b): return a * b"),
]
TASK_PROMPTS, TASKS, TASK_COMPLETIONS = (list(x) for x in zip(*TASK_ROWS))


def test_example_4_none_leaves_a_function_out_of_the_sum():
    rs = RewardSet([math_reward, make_coding_reward("code")], weights=[1.0, 2.0])
    with no_warnings():
        scores = rs.score(TASK_PROMPTS, TASK_COMPLETIONS, {"task": TASKS}, strict=True)
    # math: +1 (4 is right), -1 (13 is wrong); code: weight 2 × 1.0, the math function's None left out
    assert scores.total.tolist() == [1.0, 2.0, -1.0, 2.0] and scores.valid.all() and scores.num_failed == 0
    assert scores.means() == {"math_reward": 0.0, "coding_reward": 1.0}  # over the samples each scored


def test_example_4_as_documented_masks_the_rows_no_function_scores():
    """The docs' coding reward checks ``task == "coding"`` while the rows say "code": TRL warns that every function
    returned None for them; here they are masked and counted, with a warning naming a sample."""
    rs = RewardSet([math_reward, make_coding_reward("coding")])
    with pytest.warns(RewardWarning, match=r"every reward function returned None for 2 of 4 samples \(e.g. sample 1\)"):
        scores = rs.score(TASK_PROMPTS, TASK_COMPLETIONS, {"task": TASKS})
    assert scores.total.tolist() == [1.0, 0.0, -1.0, 0.0]
    assert scores.valid.tolist() == [True, False, True, False] and scores.num_failed == 2


def test_none_semantics_sum_of_the_non_none_masked_only_when_all_none():
    def a(completions, **kwargs):
        return [1.0, None, None, 0.5]

    def b(completions, **kwargs):
        return [None, 3.0, None, 0.25]

    with pytest.warns(RewardWarning, match="for 1 of 4 samples"):
        scores = RewardSet([a, b], weights=[2.0, 1.0]).score(["p"] * 4, ["c"] * 4)
    assert scores.total.tolist() == [2.0, 3.0, 0.0, 1.25]
    assert scores.valid.tolist() == [True, True, False, True] and scores.num_failed == 1

    # a failure (NaN, a non-number) still masks its sample even when another function scores it
    def c(completions, **kwargs):
        return [float("nan"), 1.0, "x", 1.0]

    with pytest.warns(RewardWarning, match="'c' returned NaN/inf or a non-number for 2 of 4 samples"):
        scores = RewardSet([b, c]).score(["p"] * 4, ["c"] * 4)
    assert scores.valid.tolist() == [False, True, False, True] and scores.total.tolist() == [0.0, 4.0, 0.0, 1.25]


# ---------------------------------------------------------------- Example 5: async def rewards, awaited concurrently
async def slow_nonempty(prompts, completions, **kwargs):
    await asyncio.sleep(0.2)
    return [1.0 if c else 0.0 for c in completions]


async def slow_length(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [float(len(c)) for c in completions]


class AsyncJudge:
    """A callable class with an ``async def __call__`` (a judge client)."""

    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0.2)
        return [0.5] * len(completions)


def test_example_5_async_rewards_are_awaited_concurrently():
    def sync_one(completions, **kwargs):
        return [1.0] * len(completions)

    rs = RewardSet([slow_nonempty, sync_one, slow_length, AsyncJudge()])
    assert [c.asynchronous for c in rs.conventions] == [True, False, True, True]
    rs.score(["p"], ["x"])  # the event loop starts once
    start = time.perf_counter()
    with no_warnings():
        scores = rs.score(["p", "q"], ["ab", ""], strict=True)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.4, f"three 0.2 s async rewards took {elapsed:.2f} s: not concurrent"
    assert scores.per_function["slow_nonempty"].tolist() == [1.0, 0.0]
    assert scores.per_function["slow_length"].tolist() == [2.0, 0.0]
    assert scores.total.tolist() == [1.0 + 1.0 + 2.0 + 0.5, 0.0 + 1.0 + 0.0 + 0.5]


def test_an_async_reward_that_raises_or_times_out_masks_its_batch():
    async def down(completions, **kwargs):
        raise ConnectionError("judge unreachable")

    class Slow:
        timeout_s = 0.2

        async def __call__(self, completions, **kwargs):
            await asyncio.sleep(5)
            return [1.0] * len(completions)

    start = time.perf_counter()
    with pytest.warns(RewardWarning) as caught:
        scores = RewardSet([down, Slow(), slow_length]).score(["p"], ["abc"])
    assert time.perf_counter() - start < 2
    assert not scores.valid.any() and scores.per_function["slow_length"].tolist() == [3.0]
    messages = " | ".join(str(w.message) for w in caught)
    assert "'down' raised ConnectionError: judge unreachable" in messages
    assert "'slow' raised RewardTimeout: no result within timeout_s=0.2 s" in messages


# ---------------------------------------------------------------- Example 6: log_extra and log_metric
def boxed_with_logs(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in found]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def test_example_6_log_extra_and_log_metric():
    scores = RewardSet([boxed_with_logs]).score(["a", "b"], [r"so \boxed{2}", "no idea"], {"ground_truth": ["2", "5"]})
    assert scores.total.tolist() == [1.0, 0.0]
    assert scores.extra == {"golden_answer": ["2", "5"], "extracted_answer": ["2", "[none]"]}
    assert scores.metrics == {"accuracy": 0.5}


# ---------------------------------------------------------------- trainer_state
def curriculum(completions, trainer_state, **kwargs):
    """Full credit late in training only: the weight of the score grows with the step."""
    progress = trainer_state.global_step / trainer_state.max_steps if trainer_state.max_steps else 0.0
    return [progress * len(c) for c in completions]


def test_trainer_state_is_given():
    rs = RewardSet([curriculum])
    assert rs.score(["p"], ["abcd"]).total.tolist() == [0.0]  # the default state: step 0 of an unknown number
    state = R.TrainerState(global_step=5, max_steps=10, epoch=0.5)
    assert rs.score(["p"], ["abcd"], trainer_state=state).total.tolist() == [2.0]
    rs.check(["prompt"])  # trainer_state, log_extra and log_metric are inputs now


# ---------------------------------------------------------------- TRL's own reward functions
def test_trl_rewards_run_unchanged_on_chat_completions():
    pytest.importorskip("trl")
    from trl.rewards import think_format_reward

    completions = R.conversation_completions([chat("q"), chat("q")], [["<think>\nhmm\n</think>\n7"], ["7"]])
    with no_warnings():
        scores = RewardSet([think_format_reward]).score([chat("q"), chat("q")], completions, strict=True)
    assert scores.total.tolist() == [1.0, 0.0]


def test_trl_accuracy_reward_with_its_solution_column():
    pytest.importorskip("trl")
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    prompts = [chat("1/3?"), chat("1/3?")]
    completions = assistant([r"My answer is \boxed{\frac{1}{3}}", r"My answer is \boxed{\frac{1}{2}}"])
    scores = RewardSet([accuracy_reward]).score(prompts, completions, {"solution": [r"\frac{1}{3}"] * 2}, strict=True)
    assert scores.total.tolist() == [1.0, 0.0] and scores.valid.all()  # the docstring's expected output
    assert scores.extra["solution"] == [r"\frac{1}{3}"] * 2  # its log_extra calls arrive


# ---------------------------------------------------------------- the first scoring call fails at once
async def async_scores(completions, **kwargs):
    return [1.0] * len(completions)


def boom(completions, **kwargs):
    raise RuntimeError("reward server down")


def short(completions, **kwargs):
    return [1.0]


def scalar(completions, **kwargs):
    return 1.0


def not_awaited(completions, **kwargs):  # a plain function handing back a coroutine
    return async_scores(completions)


def all_none(completions, **kwargs):
    return [None] * len(completions)


def words(completions, **kwargs):
    return ["yes"] * len(completions)


@pytest.mark.parametrize(
    "fn, said",
    [
        (boom, "'boom' raised RuntimeError: reward server down"),
        (short, "'short' returned 1 scores for 3 completions: list of 1: [1.0]"),
        (scalar, "'scalar' returned float 1.0"),
        (not_awaited, "'not_awaited' returned coroutine <coroutine object async_scores"),
        (all_none, "every reward function returned None for every one of the 3 samples"),
        (words, "'words' returned no number for any of the 3 samples: list of 3: ['yes', 'yes', 'yes']"),
    ],
)
def test_a_reward_failing_on_every_sample_of_the_first_call_raises(fn, said):
    rs = RewardSet([fn])
    with pytest.raises(R.RewardFunctionError) as err:
        rs.score(["p"] * 3, ["a", "b", "c"], strict=True)
    message = str(err.value)
    assert said in message, message
    assert "Expected from each function: a list of 3 floats, one per completion" in message
    assert isinstance(err.value, ValueError)
    if fn is boom:
        assert isinstance(err.value.__cause__, RuntimeError)  # the traceback shows where the reward raised
    # after the first call (strict=False), the same failure is masked, counted and warned about, as before
    with pytest.warns(RewardWarning):
        scores = rs.score(["p"] * 3, ["a", "b", "c"])
    assert scores.num_failed == 3 and not scores.valid.any()


def test_the_first_call_names_every_function_that_failed_as_a_whole():
    with pytest.raises(
        R.RewardFunctionError, match=r"'boom' raised RuntimeError.*; reward function 'short' returned 1"
    ):
        RewardSet([boom, async_scores, short]).score(["p"] * 3, ["a", "b", "c"], strict=True)


def test_partial_failures_and_a_function_for_another_task_pass_the_first_call():
    def half(completions, **kwargs):
        return [1.0, None, "x"]

    with pytest.warns(RewardWarning, match="'half' returned NaN/inf or a non-number for 1 of 3"):
        scores = RewardSet([half, async_scores]).score(["p"] * 3, ["a", "b", "c"], strict=True)
    assert scores.valid.tolist() == [True, True, False]
    # only math rows in the first batch: the coding reward's None everywhere is legitimate
    with no_warnings():
        scores = RewardSet([math_reward, make_coding_reward("code")]).score(
            ["What is 2+2?", "What is 3*4?"], ["4", "12"], {"task": ["math", "math"]}, strict=True
        )
    assert scores.total.tolist() == [1.0, 1.0]
    # the documented Example 4 on a first batch of code rows only: nothing is scored
    with pytest.raises(R.RewardFunctionError, match="every reward function returned None for every one of the 2"):
        RewardSet([math_reward, make_coding_reward("coding")]).score(
            TASK_PROMPTS[1::2], TASK_COMPLETIONS[1::2], {"task": ["code", "code"]}, strict=True
        )


# ---------------------------------------------------------------- through the collector (chat template, scripted replies)
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_policy():
    from lit_gspo.models.loading import load_policy

    policy, tokenizer = load_policy("tiny-llama", seed=0)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TEMPLATE
    return policy, tokenizer


def scripted_engine(tokenizer, replies: list[str]):
    """An engine whose sampled replies are ``replies`` (one per row and generation), each ended by EOS."""
    from lit_gspo.rl.engines import RolloutEngine

    class Scripted(RolloutEngine):
        def generate(
            self,
            policy,
            input_ids,
            attention_mask,
            *,
            num_generations,
            max_new_tokens,
            pad_id,
            eos_id,
            sampling,
            synced_gpus,
            return_logprobs,
        ):
            rows = input_ids.repeat_interleave(num_generations, 0)
            end = eos_id if isinstance(eos_id, int) else eos_id[0]
            ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [end] for r in replies]
            out = torch.full((len(rows), max_new_tokens), pad_id, dtype=torch.long)
            for i, reply in enumerate(ids):
                out[i, : len(reply)] = torch.tensor(reply[:max_new_tokens])
            return torch.cat([rows, out], 1), None

    return Scripted()


def make_collector(tokenizer, engine, functions, G=2):
    from lit_gspo.rl.collect import Collector
    from lit_gspo.rl.config import Generation
    from lit_gspo.rl.envs import SingleTurn

    return Collector(
        SingleTurn(), engine, RewardSet(functions), tokenizer, Generation(num_generations=G, max_new_tokens=64)
    )


def test_the_collector_gives_chat_prompts_and_message_completions(chat_policy):
    policy, tok = chat_policy
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, trainer_state=kwargs["trainer_state"])
        return think_answer_format(completions)

    rows = [{"prompt": CHAT_PROMPTS[0], "answer": "12"}, {"prompt": CHAT_PROMPTS[1], "answer": "8"}]
    replies = CHAT_REPLIES + ["<think>x</think><answer>8</answer>", "8"]  # G=2: rows 0, 0, 1, 1
    collector = make_collector(tok, scripted_engine(tok, replies), [spy, think_answer_format, boxed_with_logs_or_none])
    collector.trainer_state = R.TrainerState(global_step=3, max_steps=6)
    with no_warnings():
        batch, texts, stats = collector.sample(policy, rows)
    assert texts == replies
    assert seen["prompts"] == [CHAT_PROMPTS[0]] * 2 + [CHAT_PROMPTS[1]] * 2  # the message lists, as TRL passes them
    assert seen["completions"] == assistant(replies)
    assert seen["trainer_state"].global_step == 3
    assert batch.rewards.tolist() == [2.0, 0.0, 2.0, 0.0]  # spy + format; the third function gives None
    assert stats["rewards/spy/mean"] == 0.5 and stats["answers_logged"] == 4.0  # log_metric → train/answers_logged
    assert stats["rewards/spy/std"] == pytest.approx((4 * 0.25 / 3) ** 0.5)  # TRL's: Bessel-corrected, of 1, 0, 1, 0
    assert math.isnan(stats["rewards/boxed_with_logs_or_none/mean"]) and math.isnan(
        stats["rewards/boxed_with_logs_or_none/std"]
    )
    assert collector.last_extra == {"answer_seen": ["12", "12", "8", "8"]}


def boxed_with_logs_or_none(completions, answer, log_extra, log_metric, **kwargs):
    """Scores nothing (None for every sample) but logs a column and a metric: a TRL logging-only function."""
    log_extra("answer_seen", list(answer))
    log_metric("answers_logged", float(len(answer)))
    return [None] * len(completions)


def test_the_collector_is_strict_on_its_first_scoring_only(chat_policy):
    policy, tok = chat_policy
    calls = []

    def down_on_call(completions, **kwargs):  # raises on the call numbers in ``failing``
        calls.append(len(completions))
        if len(calls) in failing:
            raise RuntimeError(f"down on call {len(calls)}")
        return [1.0] * len(completions)

    rows = [{"prompt": "rev 12="}]
    failing = {2}
    collector = make_collector(tok, scripted_engine(tok, ["21", "12"]), [down_on_call])
    collector.sample(policy, rows)  # first call succeeds
    with pytest.warns(RewardWarning, match="down on call 2"):
        batch, _, stats = collector.sample(policy, rows)  # a later failure is masked, as before
    assert stats["reward_failed"] == 2.0 and not batch.completion_mask.any()

    calls.clear()
    failing = {1}
    collector = make_collector(tok, scripted_engine(tok, ["21", "12"]), [down_on_call])
    with pytest.raises(R.RewardFunctionError, match=r"'down_on_call' raised RuntimeError: down on call 1"):
        collector.sample(policy, rows)


# ---------------------------------------------------------------- end to end: the run stops at its first scoring
def test_a_fit_with_a_reward_that_always_raises_stops_at_the_first_scoring(tmp_path):
    from lit_gspo.tools.main import cli_main

    calls = []

    def server_down(completions, **kwargs):
        calls.append(len(completions))
        raise ConnectionError("reward server at localhost:9 refused the connection")

    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.max_steps",
            "2",
            "--model.policy.warm_start.steps",
            "0",
            "--data.num_train",
            "16",
            "--data.num_val",
            "4",
            "--data.prompts_per_step",
            "2",
            "--model.generation.num_generations",
            "2",
            "--model.generation.max_new_tokens",
            "4",
            "--trainer.enable_progress_bar",
            "false",
        ],
        run=False,
    )
    cli.model.collector.rewards = RewardSet([server_down])  # given through the Python API
    with pytest.raises(Exception) as err:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert type(err.value).__name__ == "RewardFunctionError", repr(err.value)
    assert "'server_down' raised ConnectionError: reward server at localhost:9 refused" in str(err.value)
    assert len(calls) == 1  # the step-0 validation's call: no RL step ran
