"""An option or a YAML key the parser does not know: the error says where a setting of that name is.

TRL's name (every field of GRPOConfig and of TrainingArguments), the same name in another group (a setting typed one
level too high, a class's parameter without its setting), else the close spellings. Enumerated: every TRL field and
every lit_gspo option, at every level a user may type it, in each form the parser's error takes (the command line,
a YAML group, a top-level YAML key); the real parser's errors of each form are checked first."""

from __future__ import annotations

import dataclasses

import pytest
from test_trainer_flags import QUICKSTART, fit_parser
from transformers import TrainingArguments

from lit_gspo.lightning.trl_names import ALWAYS_ON, GRPO_CONFIG, NOT_SUPPORTED, TRAINING_ARGUMENTS, trl_option
from lit_gspo.lightning.unknown_option import every_option, leaf, unknown_key, unknown_option_hint
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
def test_a_trl_option_on_the_command_line_names_lit_gspos(capsys):
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


def test_a_trl_parameter_of_the_objective_names_lit_gspos(capsys, tmp_path):
    extra = yaml_file(tmp_path, "model:\n  objective:\n    init_args:\n      epsilon: 0.2\n")
    (line, hint) = errors(capsys, "--config", extra)
    assert line.startswith("error: --model.objective.epsilon: not a parameter of GSPO; its parameters: clip_low, ")
    assert (
        hint == "  TRL's GRPOConfig epsilon is --model.objective.clip_low here (docs/from_trl.md says how they differ)"
    )


def test_a_setting_one_level_too_high_names_every_option_of_that_name(capsys):
    assert errors(capsys, "--model.lr", "1e-5")[1:] == [
        "  --model.policy.warm_start.lr and --model.optimizer.lr have that name"
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


@pytest.mark.parametrize("table", ["GRPOConfig", "TrainingArguments"])
def test_every_trl_field_typed_anywhere_says_where_it_is(table, parser_options):
    names = list(GRPO_CONFIG) if table == "GRPOConfig" else [f.name for f in dataclasses.fields(TrainingArguments)]
    unhelped = []
    for name in names:
        for place in PLACES:
            if f"--{place}{name}" in parser_options:  # a lit_gspo option of the same name, in the same place
                continue
            for message in forms(place + name):
                hint = unknown_option_hint(message, parser_options)
                pointer = trl_option(name)
                where = GRPO_CONFIG.get(name) or TRAINING_ARGUMENTS.get(name)
                if pointer is not None:
                    helped = f"{name} is {where} here" in hint
                elif where in (NOT_SUPPORTED, ALWAYS_ON):
                    helped = f"{name} is {where} here" in hint or f"{name}: {where} here" in hint
                else:  # a TrainingArguments field without a row: named as one
                    helped = f"{name} is one of transformers' TrainingArguments" in hint
                if not helped:
                    unhelped.append(f"{message!r} → {hint!r}")
    assert not unhelped, f"{len(unhelped)} errors do not say where TRL's setting is, e.g. {unhelped[:5]}"


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
