"""One validation pass at start: a setting out of range, or a combination that learns nothing, fails at
construction with an error naming the value and what is valid."""

import pytest

from lit_gspo.lightning.module import RLModule
from lit_gspo.rl.advantages import GAE, RLOO, BatchNormalized, GroupMean, GroupNormalized
from lit_gspo.rl.config import Generation, Policy, Update, Validation
from lit_gspo.rl.objectives import PPO


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, r"top_k must be >= 0 \(0: no top-k\), got -1"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\] \(0: no min-p cut\), got -0.1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\] \(0: no min-p cut\), got 1.5"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 \(1: none\), got 0.0"),
        ({"max_prompt_length": 0}, r"max_prompt_length must be >= 1, got 0"),
    ],
)
def test_generation_ranges(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Generation(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_grad_norm": -1.0}, r"max_grad_norm must be > 0 or null \(no clipping\), got -1.0"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm must be > 0 or null \(no clipping\), got 0.0"),
        ({"max_nonfinite_steps": 0}, r"max_nonfinite_steps must be >= 1, got 0"),
    ],
)
def test_update_ranges(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Update(**kwargs)
    Update(max_grad_norm=None)  # no clipping stays valid


def test_group_estimators_say_they_need_groups():
    assert all(cls.needs_groups for cls in (GroupNormalized, GroupMean, BatchNormalized, RLOO))
    assert not GAE.needs_groups


@pytest.mark.parametrize("advantage", [GroupNormalized(), GroupMean(), BatchNormalized(), RLOO(), None])
def test_one_generation_per_prompt_with_a_group_estimator_is_refused(advantage):
    with pytest.raises(ValueError, match=r"num_generations=1.*>= 2"):
        RLModule(advantage=advantage, generation=Generation(num_generations=1))


def test_one_generation_per_prompt_is_fine_without_groups():
    module = RLModule(
        objective=PPO(), advantage=GAE(), generation=Generation(num_generations=1), policy=Policy(kl_to_ref=False)
    )
    assert module.generation.num_generations == 1


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: Validation(every_n_steps=-1),
            r"validation.every_n_steps must be >= 0 \(0: only before and after training\), got -1",
        ),
        (
            lambda: Validation(num_logged_completions=-1),
            r"validation.log_completions_every_n_steps and "
            r"validation.num_logged_completions must be >= 0, got None and -1",
        ),
        (
            lambda: Validation(num_generations=-1),
            r"validation.num_generations must be >= 0 \(0: greedy, n: n samples per prompt\), got -1",
        ),
        (
            lambda: Validation(temperature=0.7),
            r"validation.temperature=0.7 samples nothing: validation decodes greedily unless "
            r"validation.num_generations >= 1",
        ),
        (
            lambda: Validation(num_generations=4, temperature=0.0),
            r"validation.temperature must be > 0 or null, got 0.0",
        ),
        (
            lambda: Validation(pass_at_k=[1]),
            r"validation.pass_at_k=\[1\] counts sampled completions, but validation decodes greedily unless "
            r"validation.num_generations >= 1",
        ),
        (
            lambda: Validation(pass_threshold=0.5),
            r"validation.pass_threshold=0.5 counts sampled completions",
        ),
        (
            lambda: Validation(num_generations=4, pass_at_k=[1, 8]),
            r"validation.pass_at_k must hold k in \[1, validation.num_generations=4\], got \[1, 8\]",
        ),
        (
            lambda: Validation(num_generations=4, pass_at_k=[0]),
            r"validation.pass_at_k must hold k in \[1, validation.num_generations=4\], got \[0\]",
        ),
        (lambda: Generation(max_skipped_steps=0), r"max_skipped_steps must be >= 1, got 0"),
        (lambda: Generation(max_sampling_rounds=0), r"max_sampling_rounds must be >= 1, got 0"),
        (lambda: Generation(dump_every_n_steps=-2), r"dump_every_n_steps must be >= 0 \(0: never\), got -2"),
    ],
)
def test_module_ranges(make, message):
    with pytest.raises(ValueError, match=message):
        make()
