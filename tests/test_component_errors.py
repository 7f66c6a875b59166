"""Issue 39: a value a component's own ``__init__`` refuses (``--model.rewards.cache_len -2``) is reported by the CLI in
one line naming the option as typed, the value and the class's message — checked by enumerating every component
class of every class-typed setting of ``RLModule`` and probing each of its parameters with values it refuses
(``lit_gspo/lightning/component_errors.py``)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from jsonargparse import Namespace

import lit_gspo.lightning.cli  # noqa: F401  (registers every built-in stage)
from lit_gspo.lightning.cli import cli_main
from lit_gspo.lightning.component_errors import class_specs, describe, find_spec
from lit_gspo.lightning.module import RLModule
from lit_gspo.rl import rewards as reward_module
from lit_gspo.runtime.user_errors import SettingsError, option_value

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["--config", str(ROOT / "configs/quickstart.yaml"), "--model.policy.warm_start.steps", "0"]
PROBES = {int: (-1, 0), float: (-1.0, 0.0), str: ("bogus", "(")}
PLACEHOLDERS = {int: 4, float: 1.0, str: "x"}


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def concrete_subclasses(base: type) -> list[type]:
    found, todo = set(), [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("lit_gspo.") and not inspect.isabstract(sub):
                found.add(sub)
    return sorted(found, key=qualified)


def reward_classes() -> list[type]:
    """The reward function classes lit_gspo ships (a ``__call__`` taking the completions)."""
    return [
        cls
        for cls in vars(reward_module).values()
        if inspect.isclass(cls)
        and "__call__" in vars(cls)
        and "completions" in inspect.signature(cls.__call__).parameters
    ]


def setting_classes() -> list[tuple[str, bool, type]]:
    """(setting, whether it is a list, class) for every class-typed setting of ``RLModule`` (objectives, rewards,
    engines, environments, advantages, the mismatch group and its corrections), inside the settings groups of
    ``lit_gspo/rl/config.py`` too (``update.mismatch``); the groups' plain values are checked before any class is built
    (``check_settings_groups``), the optimiser and the schedule are torch's."""
    return list(_classes_of(typing.get_type_hints(RLModule.__init__), "model"))


def _classes_of(hints: dict, prefix: str):
    for name, hint in hints.items():
        for kind in typing.get_args(hint) or (hint,):
            setting = f"{prefix}.{name}"
            if typing.get_origin(kind) is list and typing.get_args(kind) == (Callable,):
                yield from ((setting, True, cls) for cls in reward_classes())
            elif dataclasses.is_dataclass(kind) and kind.__module__ == "lit_gspo.rl.config":
                yield from _classes_of(typing.get_type_hints(kind), setting)  # a settings group: its fields
            elif dataclasses.is_dataclass(kind):
                yield setting, False, kind
                for field in dataclasses.fields(kind):  # a group's list of classes (mismatch.corrections)
                    inner = typing.get_args(typing.get_type_hints(kind)[field.name])
                    if inner and inspect.isclass(inner[0]) and not dataclasses.is_dataclass(inner[0]):
                        yield from ((f"{setting}.{field.name}", True, c) for c in concrete_subclasses(inner[0]))
            elif (
                inspect.isclass(kind) and kind.__module__.startswith("lit_gspo.") and not dataclasses.is_dataclass(kind)
            ):
                yield from ((setting, False, cls) for cls in concrete_subclasses(kind))


def _kind(param: inspect.Parameter) -> type | None:
    """int, float or str: the parameter's plain type (from its default, else its annotation)."""
    if isinstance(param.default, (int, float, str)) and not isinstance(param.default, bool):
        return type(param.default)
    plain = re.fullmatch(r"(int|float|str)(?: \| None)?", str(param.annotation))
    return {"int": int, "float": float, "str": str}[plain.group(1)] if plain else None


def refused_values(cls: type):
    """(parameter, value, required settings, message) for each parameter of ``cls`` whose first refused probe value
    raises a ValueError when ``cls`` is built with it (every other parameter at its default or a placeholder)."""
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    required = {p.name: PLACEHOLDERS[_kind(p)] for p in params if p.default is p.empty and _kind(p)}
    for param in params:
        for value in PROBES.get(_kind(param), ()):
            try:
                cls(**{**required, param.name: value})
            except ValueError as err:
                yield param.name, value, {k: v for k, v in required.items() if k != param.name}, str(err)
                break
            except Exception:  # e.g. an optional package missing: not a value refused
                break


PROBED = [(setting, is_list, cls, list(refused_values(cls))) for setting, is_list, cls in setting_classes()]
#: every refused value: the class's message must name the parameter (the CLI names the option from it)
REFUSED = [
    pytest.param(setting, cls, param, value, required, message, id=f"{cls.__name__}.{param}={value}")
    for setting, _, cls, refused in PROBED
    for param, value, required, message in refused
]


def parsed_as_typed(cls: type, param: str) -> bool:
    """Whether the CLI hands ``param``'s value to ``cls`` as typed (a Literal's other values are the parser's to refuse:
    ``test_a_bad_value_of_a_components_parameter_is_one_line``)."""
    hint = typing.get_type_hints(cls.__init__).get(param)
    return typing.get_origin(hint) is not typing.Literal


#: the first refused value of each class that reaches the class, through the CLI
CASES = [
    pytest.param(setting, is_list, cls, *first[:3], id=f"{cls.__name__}.{first[0]}={first[1]}")
    for setting, is_list, cls, refused in PROBED
    for first in [next((r for r in refused if parsed_as_typed(cls, r[0])), None)]
    if first
]


def test_the_enumeration_covers_every_class_typed_setting():
    """The probe finds refused values for classes of each of these settings, and none of them is left out."""
    settings = {setting for setting, *_ in setting_classes()}
    assert {
        "model.objective",
        "model.rewards",
        "model.engine",
        "model.environment",
        "model.advantage",
        "model.update.mismatch",
        "model.update.mismatch.corrections",
    } <= settings
    assert settings <= {case.values[0] for case in CASES}
    assert len(CASES) >= 30 and len(REFUSED) >= 100, (len(CASES), len(REFUSED))


@pytest.mark.parametrize("setting, cls, param, value, required, message", REFUSED)
def test_every_refused_value_is_described_by_its_option(setting, cls, param, value, required, message):
    """Each parameter of each class, refused with the class's own message: :func:`describe` names the option and the
    value (it finds the parameter in the message) — what the CLI reports (the test below runs one per class)."""
    init_args = {**{k: v for k, v in inspect.signature(cls).parameters.items()}, **required, param: value}
    init_args = {k: (v.default if isinstance(v, inspect.Parameter) else v) for k, v in init_args.items()}
    init_args = {k: v for k, v in init_args.items() if v is not inspect.Parameter.empty and not k.startswith("*")}
    spec = (
        Namespace(init_args)
        if dataclasses.is_dataclass(cls)
        else Namespace(class_path=qualified(cls), init_args=Namespace(init_args))
    )
    text = describe(setting, spec, cls, message)
    assert text.startswith(f"--{setting}.") and f"--{setting}.{param} {option_value(value)}" in text, text


def command_line(setting: str, is_list: bool, cls: type, params: dict) -> list[str]:
    """How a user selects ``cls`` for ``setting`` and sets its parameters on the command line."""
    if dataclasses.is_dataclass(cls) and setting == f"model.{setting.split('.')[1]}" and not is_list:
        chosen = []  # a settings group: its fields alone
    else:
        chosen = [f"--{setting}+={qualified(cls)}"] if is_list else [f"--{setting}", qualified(cls)]
    return chosen + [a for k, v in params.items() for a in (f"--{setting}.{k}", str(v))]


@pytest.mark.parametrize("setting, is_list, cls, param, value, required", CASES)
def test_a_value_a_component_refuses_is_one_line_naming_the_option(
    setting, is_list, cls, param, value, required, tmp_path
):
    args = [*QUICKSTART, "--trainer.default_root_dir", str(tmp_path)]
    args += command_line(setting, is_list, cls, {**required, param: value})
    with pytest.raises(SettingsError) as err:
        cli_main(args, run=False)
    message = str(err.value)
    assert "\n" not in message, message
    given = re.search(rf"--{re.escape(setting)}\.{param} (\S+)", message)
    assert given, message
    assert yaml.safe_load(given.group(1).removesuffix(":")) == value, message
    if is_list:  # the option sets the last item given: the config's place says which
        assert re.search(rf"\({re.escape(setting)}\[\d+\], {cls.__name__}\)", message), message


def test_describe_names_the_item_of_a_list_and_the_given_setting():
    config = Namespace(
        model=Namespace(
            rewards=[
                Namespace(class_path="lit_gspo.rl.rewards.CharAccuracy", init_args=Namespace(strip=True, weight=1.0)),
                Namespace(
                    class_path="lit_gspo.rl.rewards.OverlongPenalty",
                    init_args=Namespace(max_len=3, cache_len=5, weight=1.0),
                ),
            ]
        )
    )
    assert [p for p, _ in class_specs(config)] == ["model", "model.rewards[0]", "model.rewards[1]"]
    found = find_spec(config, reward_module.OverlongPenalty, {"max_len": 3, "cache_len": 5, "weight": 1.0})
    assert found[0] == "model.rewards[1]"
    text = describe(*found, reward_module.OverlongPenalty, "cache_len (5) must be <= max_len (3)")
    assert text == (
        "--model.rewards.max_len 3 --model.rewards.cache_len 5 (model.rewards[1], OverlongPenalty): "
        "cache_len (5) must be <= max_len (3)"
    )
    assert option_value(-1.0) == "-1.0"


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--model.objective", "GSPO", "--model.objective.kl_estimator", "bogus"],
            "--model.objective.kl_estimator bogus: expected one of 'k1', 'k2', 'k3'",
        ),
        (
            ["--model.rewards+=lit_gspo.rl.rewards.AnswerMatch", "--model.rewards.mode", "bogus"],
            "--model.rewards.mode bogus: expected one of 'math_verify', 'last_number'",
        ),
        (
            [
                "--model.update.mismatch.corrections+=lit_gspo.rl.learn.mismatch.TIS",
                "--model.update.mismatch.corrections.cap",
                "x",
            ],
            "--model.update.mismatch.corrections.cap x: expected a float",
        ),
        (
            ["--model.objective", "GSPO", "--model.objective.clip_lo", "1"],
            "--model.objective.clip_lo: not a parameter of GSPO; its parameters: clip_low, clip_high, beta, "
            "kl_estimator, aggregation (did you mean --model.objective.clip_low?)",
        ),
        (
            ["--model.engine", "lit_gspo.rl.engines.VLLMEngine", "--model.engine.gpu_memory_utilization", "0.5"],
            "--model.engine.gpu_memory_utilization: not a parameter of VLLMEngine; its parameters: dtype, "
            "max_model_len, kv_cache_gb, num_threads, enforce_eager, llm_kwargs",
        ),
    ],
)
def test_a_bad_value_of_a_components_parameter_is_one_line(extra, expected, capsys):
    """The parser's own refusal (a type, a Literal, an unknown parameter of the class a setting names): one line naming
    the full option, not the setting's union errors."""
    with pytest.raises(SystemExit):
        cli_main([*QUICKSTART, *extra], run=False)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {expected}") and "\n" not in err, err


def test_eval_names_the_option_too(tmp_path):
    """``lit-gspo eval`` builds the config's classes with the same instantiator."""
    from lit_gspo.tools.eval import load

    rewards = ["--model.rewards+=lit_gspo.rl.rewards.OverlongPenalty", "--model.rewards.max_len", "3"]
    with pytest.raises(SettingsError, match=r"^--model.rewards.cache_len -2 \(model.rewards\[1\], OverlongPenalty\): "):
        load([*QUICKSTART, *rewards, "--model.rewards.cache_len", "-2"])


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--model.optimizer.lr", "-1"], "error: --model.optimizer.lr -1.0: Invalid learning rate: -1.0"),
        (
            [
                *("--model.lr_scheduler", "lightning.pytorch.cli.ReduceLROnPlateau"),
                *("--model.lr_scheduler.monitor", "val/reward", "--model.lr_scheduler.factor", "2"),
            ],
            "error: --model.lr_scheduler.factor 2.0: Factor should be < 1.0.",
        ),
    ],
    ids=["optimizer", "scheduler"],
)
def test_a_value_the_optimiser_or_schedule_refuses_is_one_line_before_the_first_validation(
    extra, expected, tmp_path, capsys
):
    """Torch's classes, built by the fit only after the step-0 validation: built once at start on a placeholder."""
    from lit_gspo.tools.main import main

    with pytest.raises(SystemExit):
        main(["fit", *QUICKSTART, "--trainer.default_root_dir", str(tmp_path), *extra])
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    assert not list(tmp_path.rglob("metrics.csv"))


@pytest.mark.parametrize("given", ["OverlongPenalty", "CharAccuracy"])
def test_a_reward_given_by_its_short_name_is_refused_naming_its_full_path(given, capsys):
    """Objectives and engines take short names (``--model.objective DAPO``); a reward is any callable, by dotted path."""
    with pytest.raises(SystemExit):
        cli_main([*QUICKSTART, f"--model.rewards+={given}"], run=False)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --model.rewards {given}: expected a dot import path such as ") and "\n" not in err
    path = err.split("such as ", 1)[1].split(" ", 1)[0]
    assert getattr(reward_module, given).__module__.startswith("lit_gspo.rl.rewards") and path.endswith(f".{given}")
