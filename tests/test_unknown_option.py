"""An option or a YAML key the parser does not know: the error says where a setting of that name is.

TRL's name (every field of GRPOConfig and of TrainingArguments), vLLM's and transformers' (the engine's and the
sampling's), the same name in another group (a setting typed one
level too high, a class's parameter without its setting), else the close spellings. Enumerated: every TRL field and
every lit_gspo option, at every level a user may type it, in each form the parser's error takes (the command line,
a YAML group, a top-level YAML key); the real parser's errors of each form are checked first."""

from __future__ import annotations

import pytest
from test_trainer_flags import QUICKSTART, fit_parser

from lit_gspo.lightning.cli import _unknown_parameter
from lit_gspo.lightning.foreign_names import (
    ALWAYS_ON,
    NOT_SUPPORTED,
    TABLES,
    VLLM_LLM,
    foreign_option,
    generation_config,
    training_arguments,
)
from lit_gspo.lightning.unknown_option import class_fields, every_option, leaf, unknown_key, unknown_option_hint
from lit_gspo.runtime.imports import import_path
from lit_gspo.tools.main import main


def errors(capsys, *args: str) -> list[str]:
    """The error lines of ``lit-gspo fit --config configs/quickstart.yaml <args>`` (exit code 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *QUICKSTART, *args])
    assert exit_info.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def yaml_file(tmp_path, text: str) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------ the real parser, each form of its error
def test_a_foreign_option_on_the_command_line_names_lit_gspos(capsys):
    assert errors(capsys, "--model.beta", "0.1") == [
        "error: unrecognized arguments: --model.beta 0.1",
        "  TRL's GRPOConfig beta is --model.objective.beta here (docs/from_trl.md says how they differ)",
    ]


def test_a_trl_key_in_a_yaml_group_names_lit_gspos(capsys, tmp_path):
    extra = yaml_file(tmp_path, "model:\n  update:\n    num_iterations: 2\n")
    assert errors(capsys, "--config", extra)[1:] == [
        "  TRL's GRPOConfig num_iterations is --model.update.epochs here (docs/from_trl.md says how they differ)"
    ]


def test_a_top_level_yaml_key_of_training_arguments_names_lit_gspos(capsys, tmp_path):
    extra = yaml_file(tmp_path, "learning_rate: 1.0e-5\n")
    assert errors(capsys, "--config", extra) == [
        "error: Subcommand 'fit' does not accept option 'learning_rate'",
        "  TRL's TrainingArguments learning_rate is --model.optimizer.lr here (docs/from_trl.md says how they differ)",
    ]


def test_a_trl_parameter_of_the_objective_names_lit_gspos_in_the_same_line(capsys, tmp_path):
    extra = yaml_file(tmp_path, "model:\n  objective:\n    init_args:\n      epsilon: 0.2\n")
    (line,) = errors(capsys, "--config", extra)
    assert line.startswith("error: --model.objective.epsilon: not a parameter of GSPO; its parameters: clip_low, ")
    assert line.endswith(
        "; TRL's GRPOConfig epsilon is --model.objective.clip_low here (docs/from_trl.md says how they differ) (--help lists every option)"
    )


def test_a_setting_one_level_too_high_names_every_option_of_that_name(capsys):
    assert errors(capsys, "--model.lr", "1e-5")[1:] == [
        "  --model.policy.warm_start.lr and --model.optimizer.lr have that name"
    ]


def test_vllms_argument_as_the_engines_names_lit_gspos(capsys):
    (line,) = errors(capsys, "--model.engine", "VLLMEngine", "--model.engine.init_args.gpu_memory_utilization", "0.5")
    assert line.startswith("error: --model.engine.gpu_memory_utilization: not a parameter of VLLMEngine; its param")
    assert line.endswith(
        "; vLLM's LLM gpu_memory_utilization is --model.engine.init_args.kv_cache_gb here "
        "(docs/from_trl.md says how they differ) (--help lists every option)"
    )


def test_a_generation_setting_of_transformers_is_named_as_one(capsys):
    assert errors(capsys, "--model.generation.output_scores", "true")[1:] == [
        "  output_scores is one of transformers' GenerationConfig settings, which lit_gspo does not read: the engines "
        "sample with --model.generation.temperature, top_p, top_k, min_p, repetition_penalty and stop"
    ]


def test_a_misspelling_still_gets_the_close_spellings(capsys, tmp_path):
    extra = yaml_file(tmp_path, "data:\n  prompts_per_stp: 3\n")
    assert errors(capsys, "--config", extra)[1:] == [
        "  Did you mean: --data.prompts_per_step, --data.prompt_column, --data.train_split?"
    ]


# ------------------------------------------------------------------------ enumerated
@pytest.fixture(scope="module")
def parser_options() -> list[str]:
    return fit_parser().option_names()


def forms(key: str) -> list[str]:
    """The parser's error about the unknown ``key`` (``model.update.beta``), in each form it takes."""
    group, _, name = key.rpartition(".")
    yaml = (
        f"Group '{group}' does not accept option '{name}'"
        if group
        else f"Subcommand 'fit' does not accept option '{name}'"
    )
    return [f"unrecognized arguments: --{key} 1", yaml]


def test_the_forms_are_read_as_the_key():
    assert [unknown_key(message) for message in forms("model.update.beta")] == ["model.update.beta"] * 2
    assert unknown_key("Subcommand 'fit' does not accept option 'learning_rate'") == "learning_rate"
    assert unknown_key("Group 'model' does not accept option 'update.num_iterations'") == "model.update.num_iterations"
    assert unknown_key("--data.num_val -1: must be >= 0") is None


PLACES = ["", "model.", "model.update.", "model.generation.", "trainer.", "data."]


def says_where(name: str, hint: str) -> bool:
    """Whether ``hint`` says where another library's setting ``name`` is here (or that nothing reads it)."""
    whose, where = next(((whose, table[name]) for whose, table in TABLES.items() if name in table), (None, None))
    if whose is None:
        library = "TrainingArguments" if name in training_arguments() else "GenerationConfig settings"
        return f"{name} is one of transformers' {library}, which lit_gspo does not read" in hint
    if foreign_option(name) is not None or where == NOT_SUPPORTED:
        return f"{whose} {name} is {where} here" in hint
    assert where == ALWAYS_ON
    return f"{whose} {name}: {where} here" in hint


def foreign_names() -> list[str]:
    return sorted({*(name for table in TABLES.values() for name in table), *training_arguments(), *generation_config()})


def test_every_foreign_name_typed_anywhere_says_where_it_is(parser_options):
    unhelped = []
    for name in foreign_names():
        for place in PLACES:
            if f"--{place}{name}" in parser_options:  # a lit_gspo option of the same name, in the same place
                continue
            for message in forms(place + name):
                hint = unknown_option_hint(message, parser_options)
                if not says_where(name, hint):
                    unhelped.append(f"{message!r} → {hint!r}")
    assert not unhelped, f"{len(unhelped)} errors do not say where the setting is, e.g. {unhelped[:5]}"


@pytest.mark.parametrize(
    "setting, class_path",
    [("model.engine", "lit_gspo.rl.engines.VLLMEngine"), ("model.objective", "lit_gspo.rl.objectives.GSPO")],
)
def test_every_foreign_name_as_a_classs_parameter_says_where_it_is(setting, class_path):
    """``--model.engine.init_args.gpu_memory_utilization``: jsonargparse's error names the class, not the option."""
    own = class_fields(import_path(class_path))
    names = [name for name in foreign_names() if name not in own]
    unhelped = [name for name in names if not says_where(name, _unknown_parameter(setting, name, class_path) or "")]
    assert not unhelped, f"not a parameter of {class_path}, without saying where: {unhelped[:5]}"
    assert set(VLLM_LLM) <= set(names)


def test_every_option_typed_one_level_too_high_or_at_the_top_is_named(parser_options):
    options = every_option(parser_options)
    unnamed = []
    for option in options:
        parts = option.removeprefix("--").split(".")
        if len(parts) < 2:
            continue
        for key in {".".join([*parts[:-2], parts[-1]]), parts[-1]}:  # one level up; the name alone
            if f"--{key}" in options:
                continue
            for message in forms(key):
                hint = unknown_option_hint(message, parser_options)
                if option not in hint.replace(",", " ").split():
                    unnamed.append(f"{message!r} → {hint!r}")
    assert not unnamed, f"{len(unnamed)} errors do not name the option of that name, e.g. {unnamed[:5]}"


def test_the_enumeration_covers_the_class_parameters(parser_options):
    """Parameters of the classes a setting names are not the parser's options; the hints know them anyway."""
    options = every_option(parser_options)
    assert "--model.objective.clip_low" not in parser_options
    assert {"--model.objective.clip_low", "--model.objective.tau_neg", "--model.engine.kv_cache_gb"} <= set(options)
    assert [option for option in options if leaf(option) == "help"] == []
