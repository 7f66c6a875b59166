"""A command run in this process leaves nothing of its run behind (``lit_gspo.runtime.own_context``).

Before: jsonargparse's ``subclass_arg_parser`` context variable kept the last parser, and with it the CLI, its
trainer, model and data, alive after ``main`` returned, until a garbage collection at some later moment freed them
inside whatever ran then. CI once failed three in-process CLI tests with jsonargparse's ``LookupError`` on
``parent_parser`` while such a dead fit's progress bar was printed in their output; that failure was not reproduced
here, the leak is what these tests check."""

import contextvars
import gc
import weakref
from pathlib import Path

import pytest

from lit_gspo.lightning import cli as lit_cli
from lit_gspo.tools.main import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart.yaml")
MISSING = object()


def changed_context_variables(before: contextvars.Context) -> list[str]:
    """The names of the context variables whose value is not the one in ``before``."""
    return [var.name for var, value in contextvars.copy_context().items() if before.get(var, MISSING) is not value]


def record_trainers(monkeypatch) -> list[weakref.ref]:
    """Weak references to every Trainer the CLI builds from now on."""
    built = []
    instantiate_trainer = lit_cli.RLCLI.instantiate_trainer

    def recording(self, **kwargs):
        trainer = instantiate_trainer(self, **kwargs)
        built.append(weakref.ref(trainer))
        return trainer

    monkeypatch.setattr(lit_cli.RLCLI, "instantiate_trainer", recording)
    return built


@pytest.mark.parametrize("entry", ["main", "cli_main"])
def test_a_command_in_process_leaves_no_trainer_and_no_context_variable(entry, tmp_path, monkeypatch, capsys):
    """``lit_gspo.tools.main.main`` (what ``lit-gspo`` runs) and ``lit_gspo.lightning.cli.cli_main`` (the API)."""
    built = record_trainers(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "rev 123=", "answer": "321"}\n' * 8)  # no `prompt` column: refused after the trainer
    args = [
        "fit",
        "--config",
        QUICKSTART,
        "--trainer.default_root_dir",
        str(tmp_path),
        "--data.train_source",
        str(rows),
    ]
    before = contextvars.copy_context()
    if entry == "main":
        with pytest.raises(SystemExit) as raised:
            main(args)
        assert raised.value.code == 2 and "has no column 'prompt'" in capsys.readouterr().err
    else:
        with pytest.raises(ValueError, match="has no column 'prompt'") as raised:
            lit_cli.cli_main(args)
    del raised  # its traceback holds the run's frames
    gc.collect()
    assert len(built) == 1 and built[0]() is None, "the run's Trainer outlived the command"
    assert changed_context_variables(before) == []
