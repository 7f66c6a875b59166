"""A user's mistake is one ``error:`` line and exit code 2; a bug keeps its traceback (issue 29, finding 9).

Before: a bad value in the config arrived after 12-44 traceback frames, a misspelled option after a ~95-line usage
dump."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_gspo.lightning.callbacks.run_lock import RunLockedError
from lit_gspo.runtime import user_errors
from lit_gspo.tools.main import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
ENV.pop(user_errors.DEBUG_ENV, None)


def cli(*args: str, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_gspo.tools.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def exit_code_and_error(capsys, args) -> tuple[int, list[str], str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    return exit_info.value.code, [line for line in err.splitlines() if line.startswith("error:")], err


# ------------------------------------------------------------------------------------------- the command line
def test_a_misspelled_option_is_the_error_and_its_close_matches_not_the_usage_dump(capsys):
    """In-process (``main(argv)``); the test below runs ``python -m lit_gspo.tools.main`` as typed."""
    code, _, err = exit_code_and_error(capsys, ["fit", "--config", QUICKSTART, "--data.prompts_per_stp", "3"])
    assert code == 2
    assert err.splitlines() == [
        "error: unrecognized arguments: --data.prompts_per_stp 3",
        "  Did you mean: --data.prompts_per_step, --data.prompt_column, --data.train_split?",
    ]


def test_a_bad_value_in_the_config_is_one_error_line_without_a_traceback(tmp_path):
    proc = cli(
        "fit",
        "--config",
        QUICKSTART,
        "--model.generation.num_generations",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: generation.num_generations=1, but GroupNormalized")
    assert not (tmp_path / "checkpoints").exists()


def test_debug_shows_the_traceback_and_the_usage(tmp_path, capsys, monkeypatch):
    """In-process: with ``--debug`` the ValueError propagates out of ``main`` (Python prints its traceback, exit 1)."""
    monkeypatch.setenv(user_errors.DEBUG_ENV, "0")  # off; --debug sets it to 1 (for launched ranks): undone after
    with pytest.raises(ValueError, match=r"^generation.num_generations=1"):  # without --debug: the test above
        main(
            [
                "fit",
                "--config",
                QUICKSTART,
                "--model.generation.num_generations",
                "1",
                "--debug",
                "--trainer.default_root_dir",
                str(tmp_path),
            ]
        )
    monkeypatch.setenv(user_errors.DEBUG_ENV, "1")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--data.prompts_per_stp", "3"])
    assert (
        exit_info.value.code == 2 and "usage:" in capsys.readouterr().err
    )  # jsonargparse's own message, usage included


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--data.train_source", "no_such_file.jsonl"], "error: 'no_such_file.jsonl' is neither a built-in task"),
        (["--data.num_val", "-1"], "error: --data.num_val -1: must be >= 0, or null"),
        (
            ["--data.train_source", "{tmp}/rows.jsonl"],
            "error: '{tmp}/rows.jsonl' has no column 'prompt' (--data.prompt_column prompt); its columns are",
        ),
        # a value no type of the option accepts: jsonargparse's lines per subtype as one line naming the option and the value
        (
            ["--trainer.precision", "7"],
            "error: --trainer.precision 7: expected one of 64, 32, 16, 'transformer-engine'",
        ),
        (["--model.update.epochs", "abc"], "error: --model.update.epochs abc: expected an int"),
        (
            ["--model.lr_scheduler", "ReduceLROnPlateau"],
            "error: --model.lr_scheduler ReduceLROnPlateau: Multiple subclasses "
            "with name ReduceLROnPlateau. Give the full class path",
        ),
        (["--model.policy.warm_start.steps", "-3"], "error: --model.policy.warm_start: warm_start needs steps >= 0"),
    ],
)
def test_settings_paths_and_columns_checked_at_start_are_one_error(tmp_path, capsys, monkeypatch, extra, expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "rows.jsonl").write_text('{"question": "rev 123=", "answer": "321"}\n' * 8)
    extra, expected = [e.format(tmp=tmp_path) for e in extra], expected.format(tmp=tmp_path)
    code, errors, err = exit_code_and_error(
        capsys,
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            *extra,
        ],
    )
    assert code == 2 and len(errors) == 1 and errors[0].startswith(expected), err[-3000:]


def test_eval_of_a_missing_checkpoint_is_one_error(tmp_path, capsys):
    code, errors, err = exit_code_and_error(capsys, ["eval", "--ckpt", str(tmp_path / "nothing.ckpt")])
    assert code == 2 and errors == [
        f"error: --ckpt {tmp_path / 'nothing.ckpt'}: no such file (a run's checkpoints are "
        "<run>/checkpoints/*.ckpt; its exported model is <run>/hf_model)"
    ], err[-3000:]


# ------------------------------------------------------------------------------------------- the classification
def _a_start_check_error() -> ValueError:
    """A ValueError raised by lit_gspo's own code for a bad input (pass@k of more samples than there are)."""
    from lit_gspo.rl.evaluate import pass_at_k

    try:
        pass_at_k(4, 1, 5)
    except ValueError as err:
        return err
    raise AssertionError("pass_at_k(4, 1, 5) should refuse k > n")


def test_what_counts_as_a_user_error():
    user_errors.mark_starting()
    ours = _a_start_check_error()
    assert user_errors.is_user_error(ours)  # a start check's ValueError
    assert user_errors.is_user_error(RunLockedError("in use"))  # the library's user-facing classes
    assert user_errors.is_user_error(user_errors.SettingsError("bad"))
    try:
        int("x")  # a ValueError raised outside lit_gspo (here: a user's code, torch, ...): its traceback helps
    except ValueError as err:
        assert not user_errors.is_user_error(err)
    assert not user_errors.is_user_error(TypeError("a bug"))
    user_errors.mark_started()  # training runs: a ValueError now is a failure of the run, with its traceback
    assert not user_errors.is_user_error(ours)
    assert user_errors.is_user_error(user_errors.SettingsError("bad"))  # the marker always is
    user_errors.mark_starting()
