"""Every precision Lightning's Trainer takes, for RLModule: honoured, or refused at start in one line
(``lit_gspo/lightning/precisions.py``), enumerated from the Trainer's signature so that a new value fails here until it
is classified."""

import inspect
import re
import typing

import lightning as L
import pytest
import torch
from test_module_hooks import build, data
from test_predict import trainer

from lit_gspo.lightning.precisions import FITS_ONLY, PRECISIONS, check_precision
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED
from lit_gspo.runtime.user_errors import SettingsError


def literal_values(annotation) -> set[str]:
    """The values of every ``Literal`` inside ``annotation`` (an ``Optional``/``Union`` of them), as text."""
    if typing.get_origin(annotation) is typing.Literal:
        return {str(value) for value in typing.get_args(annotation)}
    return set().union(*(literal_values(arg) for arg in typing.get_args(annotation)))


def test_every_precision_the_trainer_takes_is_classified():
    annotation = inspect.signature(L.Trainer.__init__).parameters["precision"].annotation
    assert sorted(PRECISIONS) == sorted(literal_values(annotation))
    assert {flag.kind for flag in PRECISIONS.values()} == {HONOURED, REFUSED}


@pytest.mark.parametrize("precision", sorted(name for name, flag in PRECISIONS.items() if flag.kind == REFUSED))
def test_a_refused_precision_is_one_error_saying_what_to_use(precision):
    expected = (
        rf"^--trainer\.precision {precision}: not supported by lit_gspo: {re.escape(PRECISIONS[precision].note)}$"
    )
    with pytest.raises(SettingsError, match=expected):
        check_precision(precision, "fit")
    for stage in ("validate", "test", "predict"):
        if precision in FITS_ONLY:
            check_precision(precision, stage)
        else:
            with pytest.raises(SettingsError, match=expected):
                check_precision(precision, stage)


def test_fp16_weights_turn_infinite_at_adam_s_first_step_with_a_policy_gradient_s_magnitude():
    """Why ``16-true`` fits are refused: a gradient of 1e-3 (its squared moment underflows, eps=1e-8 is 0 in fp16)."""
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    weight.grad = torch.full_like(weight, 1e-3)
    torch.optim.AdamW([weight], lr=1e-3).step()
    assert not torch.isfinite(weight).any()


def test_a_16_true_fit_is_refused_before_its_warm_start_and_a_16_true_validation_runs(tmp_path):
    model = build()
    with pytest.raises(SettingsError, match=r"^--trainer\.precision 16-true: not supported by lit_gspo: fp16 weights"):
        trainer(tmp_path, precision="16-true", max_steps=1).fit(model, datamodule=data())
    assert model.rl_step == 0 and not model.warm_started
    [metrics] = trainer(tmp_path, precision="16-true").validate(build(), datamodule=data())
    assert 0.0 <= metrics["val/reward"] <= 1.0
