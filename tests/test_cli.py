"""The `lit-gspo` entry point: one front door for LightningCLI's subcommands and `ablate`, without an import cycle."""

import ast
from pathlib import Path

import pytest

from lit_gspo.tools.ablate import make_parser
from lit_gspo.tools.main import cli_main, main

PACKAGE = Path(__file__).resolve().parents[1] / "lit_gspo"


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    return exit_info.value.code, out + err


def test_help_lists_eval_and_ablate_beside_fit(capsys):
    code, out = run_main(["--help"], capsys)
    assert code == 0
    assert "{fit,validate,test,predict,eval,ablate,compare}" in out
    assert "Every arm × seed" in out  # ablate's one-line description, as fit's is listed
    assert "pass@k" in out  # eval's


def test_every_subcommand_of_lightnings_cli_is_one_of_ours():
    """Enumerated from LightningCLI: a subcommand a new Lightning adds fails here until lit_gspo runs it."""
    from lightning.pytorch.cli import LightningCLI

    from lit_gspo.lightning.cli import RLCLI

    assert RLCLI.subcommands() == LightningCLI.subcommands()


def test_no_subcommand_names_ablate_among_the_choices(capsys):
    code, out = run_main([], capsys)
    assert code == 2 and "ablate" in out and "fit" in out


def test_ablate_help_is_ablates_own(capsys):
    code, out = run_main(["ablate", "--help"], capsys)
    assert code == 0 and "--report-only" in out and "--trainer" not in out


def test_ablate_after_lightning_options_is_refused_with_a_pointer(capsys):
    with pytest.raises(SystemExit):
        cli_main(["ablate", "--config", "x.yaml"], other_subcommands={"ablate": make_parser()})
    assert "must come first" in capsys.readouterr().err


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_nothing_in_the_package_imports_the_entry_point():
    importers = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).as_posix() not in ("tools/main.py", "__main__.py")
        and "lit_gspo.tools.main" in imported_modules(p)
    ]
    assert importers == []


def print_config(capsys, *extra: str) -> str:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(PACKAGE.parent / "configs/quickstart.yaml"), *extra, "--print_config"])
    return capsys.readouterr().out


def test_print_config_shows_the_objectives_defaults_as_values(capsys, tmp_path):
    """Before: ``clip_low: null``, with nothing saying the run uses GSPO's 3e-4 (issue 19, finding 9); now the
    objective's ``__init__`` holds its paper's values, and the printed config shows them."""
    text = print_config(capsys)
    for line in (
        "clip_low: 0.0003",
        "clip_high: 0.0004",
        "aggregation: seq-mean-token-mean",
        "max_grad_norm: 1.0",
        "every_n_steps: 25",
        "num_generations: 8",
    ):
        assert f"  {line}\n" in text, line
    # another objective: its own paper's values (the defaults of the config's GSPO do not carry over)
    dapo = print_config(capsys, "--model.objective", "DAPO")
    assert "class_path: lit_gspo.DAPO" in dapo and "  clip_low: 0.2\n" in dapo and "  clip_high: 0.28\n" in dapo
    assert "aggregation: token-mean" in dapo
    # the printed config is a config: it parses back to itself
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(printed), "--print_config"])
    assert capsys.readouterr().out == text


def test_one_objective_setting_changes_that_one_and_keeps_the_papers_others():
    cli = cli_main(
        [
            "--config",
            str(PACKAGE.parent / "configs/quickstart.yaml"),
            "--model.objective",
            "GSPO",
            "--model.objective.clip_high",
            "5e-4",
            "--trainer.max_steps",
            "0",
        ],
        run=False,
    )
    objective = cli.model.objective
    assert (type(objective).__name__, objective.clip_low, objective.clip_high) == ("GSPO", 3e-4, 5e-4)
    dapo = cli_main(
        [
            "--config",
            str(PACKAGE.parent / "configs/quickstart.yaml"),
            "--config",
            str(PACKAGE.parent / "configs/objectives/dapo.yaml"),
            "--trainer.max_steps",
            "0",
        ],
        run=False,
    )
    assert (type(dapo.model.objective).__name__, dapo.model.objective.clip_low, dapo.model.objective.clip_high) == (
        "DAPO",
        0.2,
        0.28,
    )


def settings_docs() -> dict[type, dict[str, str]]:
    """Each settings group of ``lit_gspo/rl/config.py`` → {field: its doc, the string literal after it}."""
    import dataclasses

    from lit_gspo.rl import config

    tree = ast.parse(Path(config.__file__).read_text())
    out = {}
    for node in tree.body:
        cls = getattr(config, getattr(node, "name", ""), None)
        if not (isinstance(node, ast.ClassDef) and dataclasses.is_dataclass(cls)):
            continue
        docs = {}
        for field, after in zip(node.body, node.body[1:] + [None]):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                docs[field.target.id] = " ".join(after.value.value.split())
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, f"{cls.__name__}: a field without a doc"
        out[cls] = docs
    return out


def help_text(capsys, monkeypatch, *args: str) -> str:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per option: no word broken by the wrapping
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(PACKAGE.parent / "configs/quickstart.yaml"), *args])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    return " ".join(out.split())


def test_fit_help_shows_each_settings_doc_and_default(capsys, monkeypatch):
    """Every field of every settings group has its doc where it is declared, and ``lit-gspo fit --help`` shows it with
    its default; a group RLModule takes as optional (``lora``: None is no LoRA) shows them in its own ``.help``."""
    import dataclasses
    import inspect
    import typing

    from lit_gspo.lightning.module import RLModule

    all_docs = settings_docs()

    def groups_of(hints: dict, defaults: dict, prefix: str):
        """(option path, group class, optional) of each settings group, nested groups included."""
        for name, hint in hints.items():
            for cls in typing.get_args(hint) or (hint,):
                if isinstance(cls, type) and cls in all_docs:
                    yield f"{prefix}{name}", cls, defaults.get(name) is None
                    fields = {f.name: f for f in dataclasses.fields(cls)}
                    yield from groups_of(
                        typing.get_type_hints(cls),
                        {
                            k: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                            for k, f in fields.items()
                        },
                        f"{prefix}{name}.",
                    )

    params = inspect.signature(RLModule.__init__).parameters
    groups = list(groups_of(typing.get_type_hints(RLModule.__init__), {k: p.default for k, p in params.items()}, ""))
    assert {path for path, _, _ in groups} >= {
        "policy",
        "policy.lora",
        "policy.routing",
        "policy.warm_start",
        "generation",
        "update",
        "validation",
    }
    assert {cls for _, cls, _ in groups} == set(all_docs)  # every group of config.py is a setting of RLModule
    text = help_text(capsys, monkeypatch, "--help")
    for name, cls, optional in groups:
        docs = all_docs[cls]
        shown = help_text(capsys, monkeypatch, f"--model.{name}.help", cls.__name__) if optional else text
        for field, doc in docs.items():
            if dataclasses.is_dataclass(typing.get_type_hints(cls)[field]):
                continue  # a nested group: its own fields are checked as a group
            default = getattr(cls(), field)
            assert f"--model.{name}.{field} " in shown and doc in shown, f"{name}.{field}"
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                assert f"{doc} (type: " in shown and f"default: {default})" in shown.split(doc, 1)[1][:200], (
                    f"{name}.{field}"
                )
    assert "--model.generation.num_generations NUM_GENERATIONS G: completions sampled per prompt" in text


def test_objective_help_shows_the_papers_defaults_as_numbers(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--model.objective.help", "GSPO")
    assert "--model.objective.clip_low CLIP_LOW ε_low: ratios below 1 − ε_low are clipped" in text
    assert "(type: float, default: 0.0003)" in text and "(type: float, default: 0.0004)" in text
    assert "default: seq-mean-token-mean)" in text and "default: null" not in text
