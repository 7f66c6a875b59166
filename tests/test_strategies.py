"""Every strategy Lightning names, for an RL fit: honoured, or refused at start in one line that says what to use
(``lit_gspo/lightning/strategy.py``), by name, class path, class or instance, from the command line and from Python;
enumerated from Lightning's registry and ``lightning.pytorch.strategies``, so that a new one fails here until it is
classified."""

import re

import lightning.pytorch.strategies as S
import pytest
from lightning.pytorch.strategies import StrategyRegistry
from test_module_hooks import build, data
from test_predict import trainer
from test_user_errors import QUICKSTART, exit_code_and_error

from lit_gspo.lightning.strategy import STRATEGIES, check_strategy
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED
from lit_gspo.runtime.user_errors import SettingsError

REFUSED_NAMES = sorted(name for name, flag in STRATEGIES.items() if flag.kind == REFUSED)


def refusal(name: str) -> str:
    return rf"strategy {name}: not supported by lit_gspo: {re.escape(STRATEGIES[name].note)}$"


def test_every_strategy_lightning_names_is_classified():
    assert sorted(STRATEGIES) == sorted({"auto", *StrategyRegistry.available_strategies(), *S.__all__})
    assert {flag.kind for flag in STRATEGIES.values()} == {HONOURED, REFUSED}


@pytest.mark.parametrize("name", sorted(name for name, flag in STRATEGIES.items() if flag.kind == HONOURED))
def test_an_honoured_strategy_passes_the_check(name):
    check_strategy(name)


@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_a_refused_strategy_name_is_one_error_saying_what_to_use(name):
    with pytest.raises(SettingsError, match=rf"^{refusal(name)}"):
        check_strategy(name)


def test_a_refused_strategy_given_as_class_path_class_or_subclass_is_refused_as_its_registry_name():
    with pytest.raises(SettingsError, match=rf"^{refusal('DeepSpeedStrategy')}"):
        check_strategy("lightning.pytorch.strategies.DeepSpeedStrategy")
    xla = StrategyRegistry["xla"]["strategy"]
    with pytest.raises(SettingsError, match=rf"^{refusal('xla')}"):
        check_strategy(type("MyXLA", (xla,), {}))
    with pytest.raises(SettingsError, match=rf"^{refusal('fsdp')}"):
        check_strategy(S.FSDPStrategy)
    check_strategy(S.DDPStrategy())  # started by popen: honoured
    check_strategy(S.ModelParallelStrategy)


@pytest.mark.parametrize("name", ["ddp_spawn", "ddp_notebook", "deepspeed_stage_2", "xla"])
def test_the_command_line_refuses_it_at_start_in_one_line(name, tmp_path, capsys):
    code, errors, err = exit_code_and_error(
        capsys, ["fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy", name]
    )
    assert code == 2 and len(errors) == 1 and re.match(rf"^error: {refusal(name)}", errors[0]), err[-3000:]
    assert {path.name for path in tmp_path.iterdir()} <= {".lit_gspo.lock"}  # no run began


def test_a_fit_under_ddp_fork_from_python_is_refused_in_the_process_it_started(tmp_path):
    """``Trainer(strategy="ddp_notebook")`` in a notebook: the module Lightning hands back after the fit would hold
    the trained weights at RL step 0, its warm start still to make. Refused before any RL step."""
    model = build()
    forked = trainer(tmp_path, strategy="ddp_notebook", max_steps=1)
    with pytest.raises(
        Exception, match=re.escape(f"strategy ddp_fork: not supported by lit_gspo: {STRATEGIES['ddp_fork'].note}")
    ):
        forked.fit(model, datamodule=data())
    assert model.rl_step == 0 and not model.warm_started
