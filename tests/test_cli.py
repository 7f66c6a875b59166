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
    assert "{fit,validate,test,eval,ablate,compare}" in out  # not predict: RLModule has nothing to predict
    assert "Every arm × seed" in out  # ablate's one-line description, as fit's is listed
    assert "pass@k" in out  # eval's


@pytest.mark.parametrize("name", ["predict"])
def test_lightnings_other_subcommands_point_to_eval(name, capsys):
    code, out = run_main([name, "--config", "configs/quickstart.yaml"], capsys)
    assert code == 2 and "lit-gspo eval" in out and "No `validation_step()`" not in out


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
    importers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).as_posix() not in ("tools/main.py", "__main__.py")
                 and "lit_gspo.tools.main" in imported_modules(p)]
    assert importers == []


def print_config(capsys, *extra: str) -> str:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(PACKAGE.parent / "configs/quickstart.yaml"), *extra, "--print_config"])
    return capsys.readouterr().out


def test_print_config_says_what_null_settings_resolve_to(capsys, tmp_path):
    """Before: ``clip_low: null``, with nothing saying the run uses GSPO's 3e-4 (issue 19, finding 9)."""
    text = print_config(capsys)
    assert "clip_low: null  # resolves to 0.0003 (GSPO's paper)" in text
    assert "clip_high: null  # resolves to 0.0004 (GSPO's paper)" in text
    assert "aggregation: null  # resolves to seq-mean-token-mean (GSPO's paper)" in text
    assert "advantage: null  # resolves to GroupNormalized (GSPO's paper)" in text
    assert "sampling: null  # resolves to dynamic: false (GSPO's paper), the other Sampling defaults" in text
    assert "update: null  # resolves to the Update defaults (epochs: 1," in text
    assert "val_max_new_tokens: null  # resolves to 6 (max_new_tokens)" in text
    # the values follow the objective, which is why they stay null: a printed config run with another objective
    dapo = print_config(capsys, "--model.objective", "DAPO")
    assert "clip_high: null  # resolves to 0.28 (DAPO's paper)" in dapo
    assert "sampling: null  # resolves to dynamic: true (DAPO's paper), the other Sampling defaults" in dapo
    # the printed config is a config: it parses back to itself
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(printed), "--print_config"])
    assert capsys.readouterr().out == text
