import math
import warnings

import pytest
import torch

from lit_gspo.rl.rewards import (
    AnswerMatch,
    CharAccuracy,
    ExactMatch,
    FormatReward,
    OverlongPenalty,
    RewardSet,
    RewardWarning,
    last_number,
    overlong_penalty,
)


def call(fn, completions, answers=None, **columns):
    if answers is not None:
        columns["answer"] = answers
    return fn([""] * len(completions), completions, **columns)


def test_math_verify_accepts_equivalent_forms():
    completions = ["\\boxed{7}", "7.0", "The answer is 7.", "$7$", "8", "", "seven", "12 or 7 or 13"]
    assert call(AnswerMatch(), completions, ["7"] * len(completions)) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert call(AnswerMatch(), ["0.5", "-3"], ["1/2", "-3"]) == [1.0, 1.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("12 or 13", 0.0),
        ("13 or 12", 1.0),
        ("12 or 13.0", 0.0),
        ("the answer is 12.", 1.0),
        ("12.0", 1.0),
        ("+12", 1.0),
        ("-12", 0.0),
        ("x12", 1.0),
        ("no idea", 0.0),
        ("", 0.0),
        ("1,212", 0.0),
        ("\\boxed{12}", 1.0),
    ],
)
def test_last_number_is_strict(completion, expected):
    assert call(AnswerMatch(mode="last_number"), [completion], ["12"]) == [expected]


def test_last_number_rule():
    assert last_number("12 or 13") == "13"
    assert last_number("3-5") == "5" and last_number("it is -5") == "-5"
    assert last_number("7.") == "7" and last_number("0.25 kg") == "0.25" and last_number("none") is None
    assert call(AnswerMatch(mode="last_number"), ["-4", "3-4"], ["-4", "-4"]) == [1.0, 0.0]


def test_last_number_rejects_non_numeric_answer():
    with pytest.raises(ValueError, match="numeric answers.*'abc'"):
        call(AnswerMatch(mode="last_number"), ["1"], ["abc"])
    with pytest.raises(ValueError, match="mode must be"):
        AnswerMatch(mode="regex")


def test_missing_answer_column_names_it():
    with pytest.raises(KeyError, match="answer"):
        ExactMatch()([""], ["1"])


def test_exact_match():
    assert call(ExactMatch(), [" 19\n", "19 ", "191"], ["19"] * 3) == [1.0, 1.0, 0.0]
    assert call(ExactMatch(strip=False), [" 19", "19"], ["19", "19"]) == [0.0, 1.0]


def test_char_accuracy_partial_credit_and_overlong():
    scores = call(CharAccuracy(), ["123", "124", "1234", "12", "", "321", "x23"], ["123"] * 7)
    assert scores == pytest.approx([1.0, 2 / 3, 3 / 4, 2 / 3, 0.0, 1 / 3, 2 / 3])
    assert call(CharAccuracy(), [""], [""]) == [1.0]


def test_a_missing_answer_is_a_failed_sample_never_the_string_none():
    assert CharAccuracy()(["p"], ["x"], answer=[None]) == [None]
    assert CharAccuracy()(["p"], ["None"], answer=[None]) == [None]  # not 1.0 against "None"
    assert call(ExactMatch(), ["None", "7"], [None, "7"]) == [None, 1.0]
    assert call(AnswerMatch(mode="last_number"), ["7", "7"], [None, "7"]) == [None, 1.0]  # no ValueError
    assert call(AnswerMatch(), ["None", "7"], [None, "7"]) == [None, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardWarning)
        scores = RewardSet([CharAccuracy()]).score(["p", "q"], ["None", "12"], {"answer": [None, "12"]})
    assert scores.valid.tolist() == [False, True] and scores.num_failed == 1


def test_format_reward_fullmatch():
    fn = FormatReward(r"<answer>\d+</answer>")
    assert call(
        fn, ["<answer>12</answer>", " <answer>12</answer>\n", "so <answer>12</answer>", "<answer>x</answer>"]
    ) == [1, 1, 0, 0]
    assert call(FormatReward(r".*<answer>.*</answer>.*"), ["so\n<answer>a\nb</answer> done"]) == [1.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        FormatReward("(")


def test_overlong_penalty_boundaries():
    # L_max = 100, L_cache = 20: 0 up to 80, linear to -1 at 100, -1 beyond.
    lengths = [0, 79, 80, 81, 90, 99, 100, 101, 1000]
    expected = [0, 0, 0, -0.05, -0.5, -0.95, -1, -1, -1]
    assert overlong_penalty(torch.tensor(lengths), 100, 20).tolist() == pytest.approx(expected)
    assert call(OverlongPenalty(100, 20), ["x"] * 9, completion_lengths=lengths) == pytest.approx(expected)
    # max_len None falls back to the trainer's max_completion_length
    assert call(
        OverlongPenalty(None, 20), ["x", "x"], completion_lengths=[90, 100], max_completion_length=100
    ) == pytest.approx([-0.5, -1])
    with pytest.raises(ValueError, match="cache_len"):
        OverlongPenalty(10, 20)
    with pytest.raises(KeyError, match="completion_lengths"):
        call(OverlongPenalty(10, 2), ["x"])


def test_reward_set_weights_and_names():
    def always_one(prompts, completions, **kw):
        return [1.0] * len(completions)

    rs = RewardSet([ExactMatch(weight=2.0), CharAccuracy(weight=0.5), always_one, ExactMatch()])
    assert rs.names == ["exact_match", "char_accuracy", "always_one", "exact_match_2"]
    scores = rs.score(["p", "p"], ["12", "13"], {"answer": ["12", "12"], "completion_lengths": [2, 2]})
    assert scores.total.dtype == torch.float32 and scores.valid.all() and scores.num_failed == 0
    assert scores.total.tolist() == pytest.approx([2 + 0.5 + 1 + 1, 0 + 0.25 + 1 + 0])
    assert scores.per_function["char_accuracy"].tolist() == pytest.approx([1.0, 0.5])
    # explicit weights override the functions' own
    rs = RewardSet([ExactMatch(weight=2.0), always_one], weights=[1.0, -1.0])
    assert rs.score(["p"], ["12"], {"answer": ["12"]}).total.tolist() == [0.0]
    with pytest.raises(
        ValueError,
        match=r"--model.reward_weights \[1.0, 2.0\] gives 2 weights for the 1 reward function of --model.rewards",
    ):
        RewardSet([always_one], weights=[1.0, 2.0])


def test_reward_set_masks_failures_and_never_crashes():
    def raises(prompts, completions, **kw):
        raise RuntimeError("boom")

    def holes(prompts, completions, **kw):
        return [1.0, None, float("nan"), float("inf"), "oops"]

    def short(prompts, completions, **kw):
        return [1.0]

    prompts, completions = ["p"] * 5, ["a"] * 5
    with pytest.warns(RewardWarning, match="'raises' raised RuntimeError: boom"):
        s = RewardSet([ExactMatch(), raises]).score(prompts, completions, {"answer": ["a"] * 5})
    assert s.num_failed == 5 and not s.valid.any() and (s.total == 0).all()
    assert torch.isnan(s.per_function["raises"]).all() and s.per_function["exact_match"].tolist() == [1.0] * 5

    with pytest.warns(RewardWarning) as caught:  # NaN, inf, "oops" fail; None leaves the only function out: unscored
        s = RewardSet([holes]).score(prompts, completions, {})
    assert [str(w.message).split(" (the affected")[0] for w in caught] == [
        "reward function 'holes' returned NaN/inf or a non-number for 3 of 5 samples",
        "every reward function returned None for 1 of 5 samples (e.g. sample 1): no function scores them",
    ]
    assert s.valid.tolist() == [True, False, False, False, False] and s.num_failed == 4
    assert s.total.tolist() == [1.0, 0, 0, 0, 0]

    rs = RewardSet([short])
    with pytest.warns(RewardWarning, match="'short' returned 1 scores for 5 completions"):
        s = rs.score(prompts, completions, {})
    assert s.num_failed == 5
    with warnings.catch_warnings():  # logged once per function and kind
        warnings.simplefilter("error")
        assert rs.score(prompts, completions, {}).num_failed == 5

    # a built-in missing its column fails softly too
    with pytest.warns(RewardWarning, match="needs an 'answer' column"):
        s = RewardSet([ExactMatch()]).score(["p"], ["a"], {})
    assert s.num_failed == 1 and math.isnan(s.means()["exact_match"])


# ---------------------------------------------------------------- calling conventions: lit_gspo's positional, TRL's keyword
# Copied unchanged from TRL's GRPOTrainer docs, "Using a custom reward function", Examples 1, 1.1 and 3:
# https://huggingface.co/docs/trl/main/en/grpo_trainer#using-a-custom-reward-function
# (source: https://github.com/huggingface/trl/blob/main/docs/source/grpo_trainer.md). Each sits in its
# own factory because the docs name all three `reward_func`.
def trl_example_1():
    def reward_func(completion_ids, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    return reward_func


def trl_example_1_1():
    def reward_func(completions, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of character count)."""
        return [float(len(completion)) for completion in completions]

    return reward_func


def trl_example_3():
    import re

    def reward_func(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    return reward_func


TRL_PROMPTS = ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."]
TRL_COMPLETIONS = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
TRL_COLUMNS = {"ground_truth": ["2", "5"], "completion_lengths": [6, 6], "max_completion_length": 16}


def test_trl_doc_examples_score_through_reward_set():
    rs = RewardSet([trl_example_3(), trl_example_1_1(), trl_example_1()], weights=[1.0, 0.0, 0.0])
    assert [c.keyword for c in rs.conventions] == [True, True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no function may fail
        s = rs.score(TRL_PROMPTS, TRL_COMPLETIONS, TRL_COLUMNS, completion_ids=[[1, 2], [3, 4, 5, 6]])
    assert s.valid.all() and s.num_failed == 0
    assert s.per_function["reward_func"].tolist() == [1.0, 0.0]  # the docs' expected output
    assert s.per_function["reward_func_2"].tolist() == [float(len(c)) for c in TRL_COMPLETIONS]
    assert s.per_function["reward_func_3"].tolist() == [2.0, 4.0]
    assert s.total.tolist() == [1.0, 0.0]
    rs.check(["prompt", "ground_truth"])  # every parameter can be filled


def test_trl_style_without_kwargs_gets_only_what_it_names():
    def accuracy(prompts, completions, answer):
        assert len(prompts) == len(completions) == len(answer)
        return [float(c == a) for c, a in zip(completions, answer)]

    def length(completions):
        return [float(len(c)) for c in completions]

    s = RewardSet([accuracy, length]).score(
        ["p", "p"], ["1", "22"], {"answer": ["1", "2"], "completion_lengths": [1, 2]}, completion_ids=[[1], [2, 2]]
    )
    assert (
        s.valid.all()
        and s.per_function["accuracy"].tolist() == [1.0, 0.0]
        and s.per_function["length"].tolist() == [1, 2]
    )


def test_positional_functions_still_work():
    def short_names(p, c, **kw):
        return [float(len(x) == len(a)) for x, a in zip(c, kw["answer"])]

    def no_kwargs(prompts_, completions_, answer):  # takes no **columns: unused columns are not forced on it
        return [float(x == a) for x, a in zip(completions_, answer)]

    def wants_ids(p, c, completion_ids, **kw):
        return [float(len(i)) for i in completion_ids]

    variadic = lambda *args, **kw: [float(len(args[1][0]))] * len(args[1])  # noqa: E731
    rs = RewardSet([short_names, no_kwargs, wants_ids, variadic, ExactMatch()])
    assert [c.keyword for c in rs.conventions] == [
        False,
        False,
        False,
        False,
        True,
    ]  # ExactMatch names prompts, completions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = rs.score(
            ["a", "b"], ["12", "3"], {"answer": ["12", "4"], "completion_lengths": [2, 1]}, completion_ids=[[5, 6], [7]]
        )
    assert s.valid.all()
    assert [s.per_function[n].tolist() for n in rs.names] == [[1, 1], [1, 0], [2, 1], [2, 2], [1, 0]]
    rs.check(["prompt", "answer"])


def test_callable_classes_in_both_conventions():
    class TrlStyle:
        def __call__(self, completions, answer, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]

    class Positional:
        weight = 0.5

        def __call__(self, prompts_, completions_, **columns):
            return [float(p in c) for p, c in zip(prompts_, completions_)]

    rs = RewardSet([TrlStyle(), Positional()])
    assert rs.names == ["trl_style", "positional"] and [c.keyword for c in rs.conventions] == [True, False]
    s = rs.score(["1", "x"], [" 1", "2"], {"answer": ["1", "3"]})
    assert s.valid.all() and s.total.tolist() == [1.5, 0.0]
    rs.check(["answer"])


def test_check_names_function_parameter_and_columns():
    def accuracy_reward(completions, solution, **kwargs):
        return [1.0] * len(completions)

    rs = RewardSet([ExactMatch(), accuracy_reward])
    with pytest.raises(ValueError) as err:
        rs.check(["prompt", "answer", "level"])
    msg = str(err.value)
    assert "'accuracy_reward' (completions, solution, **kwargs)" in msg and "cannot be given ['solution']" in msg
    assert (
        "the columns ['answer', 'level', 'completion_lengths', 'max_completion_length', 'turns', 'replies']" in msg
        and "exact_match" not in msg
    )
    rs.check(["prompt", "answer", "solution"])  # passes once the column exists

    def curriculum(completions, trainer_state, **kwargs):  # TRL's trainer_state is given (a TrainerState)
        return [1.0] * len(completions)

    def multi_env(completions, environments, **kwargs):
        return [1.0] * len(completions)

    def positional_extra(p, c, difficulty):
        return [1.0] * len(c)

    def one_slot(x):
        return [1.0]

    with pytest.raises(
        ValueError,
        match=r"'multi_env'.*\['environments'\] \(\['environments'\] exist only in TRL\)"
        r".*'positional_extra' \(p, c, difficulty\) \[positional style.*\['difficulty'\]",
    ):
        RewardSet([curriculum, multi_env, positional_extra]).check(["answer"])
    RewardSet([curriculum]).check([])
    RewardSet([positional_extra]).check(["difficulty"])
    with pytest.raises(ValueError, match=r"'one_slot' \(x\) \[TRL keyword style\] cannot be given \['x'\]"):
        RewardSet([one_slot]).check([])
