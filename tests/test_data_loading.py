"""Data loads as written (issue 29, item 7): CSV cells stay text, JSON strings stay strings, a directory's own
validation file is the validation set, every column stays reachable under its own name, and settings the data cannot
satisfy are refused at start with the numbers."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from lit_gspo.data import load_prompt_rows
from lit_gspo.lightning.datamodule import PromptDataModule
from lit_gspo.rl.rewards import CharAccuracy, ExactMatch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def info_log(caplog, monkeypatch):
    """Lightning's logger does not propagate to the root logger that caplog listens on: let it, for the test."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_csv_answers_with_leading_zeros_stay_text_and_score_full_marks(tmp_path):
    path = tmp_path / "rev.csv"
    path.write_text("prompt,answer,note\nrev 000=,000,NA\nrev 210=,012,\nrev 1.50=,05.1,null\n")
    rows = load_prompt_rows(str(path))
    assert [r["answer"] for r in rows] == ["000", "012", "05.1"]
    assert [r["note"] for r in rows] == ["NA", None, "null"]  # only an empty cell is missing
    completions = ["000", "012", "05.1"]
    answers = [r["answer"] for r in rows]
    assert CharAccuracy()([r["prompt"] for r in rows], completions, answer=answers) == [1.0, 1.0, 1.0]
    assert ExactMatch()([r["prompt"] for r in rows], completions, answer=answers) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_json_strings_stay_strings_and_numbers_stay_numbers(tmp_path, name):
    rows = [{"prompt": "a", "answer": "000", "day": "2024-01-01", "n": 3}, {"prompt": "b", "answer": "012", "n": 4.5}]
    path = tmp_path / name
    path.write_text(json.dumps(rows) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompt_rows(str(path))
    assert [(r["answer"], r["day"], r["n"]) for r in loaded] == [("000", "2024-01-01", 3), ("012", None, 4.5)]


def test_a_broken_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match=rf"{path} line 3 is not valid JSON"):
        load_prompt_rows(str(path))
    path.write_text('{"prompt": "a", "answer": "1"}\n["b", "2"]\n')
    with pytest.raises(ValueError, match=rf"{path} line 2 is a JSON list, not an object"):
        load_prompt_rows(str(path))


@pytest.mark.parametrize(
    "train, val",
    [
        ("train.csv", "validation.jsonl"),
        ("train.jsonl", "validation.jsonl"),
        ("train.jsonl", "val.jsonl"),
        ("train.csv", "test.csv"),
    ],
)
def test_a_directory_with_its_own_validation_file_uses_it(tmp_path, info_log, train, val):
    folder = tmp_path / "data"
    folder.mkdir()
    train_rows = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(10)]
    val_rows = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(100, 103)]
    for name, rows in ((train, train_rows), (val, val_rows)):
        if name.endswith(".csv"):
            (folder / name).write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
        else:
            jsonl(folder / name, rows)
    dm = PromptDataModule(str(folder), prompts_per_step=4)
    dm.setup()
    assert dm.train_rows == train_rows  # every training row trains (none held out), answers as written ("000")
    assert dm.val_rows == val_rows
    split = "test" if val.startswith("test") else "validation"
    assert (
        f"train: 10 rows from {folder} [train], val: 3 rows from {folder} [{split}] ({val}: the directory's own "
        f"{split} split, so no training row is held out)"
    ) in info_log.text
    assert dm.describe_row("val", 2) == f"{folder} [{split}] row 2"


def test_a_directory_without_a_validation_file_still_holds_rows_out(tmp_path, info_log):
    folder = tmp_path / "data"
    folder.mkdir()
    jsonl(folder / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    dm = PromptDataModule(str(folder), prompts_per_step=4)
    dm.setup()
    assert len(dm.train_rows) == 18 and len(dm.val_rows) == 2
    assert f"train: 18 rows from {folder} [train], val: 2 rows held out of it" in info_log.text


def test_a_missing_directory_split_names_the_ones_it_has(tmp_path):
    jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}])
    jsonl(tmp_path / "valid.jsonl", [{"prompt": "b", "answer": "2"}])
    with pytest.raises(
        ValueError, match=r"has no split 'test'; its splits are train \(train.jsonl\), validation \(valid.jsonl\)"
    ):
        load_prompt_rows(str(tmp_path), split="test")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"holds no data file"):
        load_prompt_rows(str(empty))


def test_answer_column_keeps_the_original_column_reachable(tmp_path):
    path = jsonl(tmp_path / "x.jsonl", [{"question": "rev 001=", "solution": "100", "level": 1}])
    (row,) = load_prompt_rows(str(path), prompt_column="question", answer_column="solution")
    assert row == {"question": "rev 001=", "solution": "100", "level": 1, "prompt": "rev 001=", "answer": "100"}


def test_a_column_setting_that_would_hide_a_data_column_is_refused(tmp_path):
    path = jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "answer": "1", "solution": "one"}])
    with pytest.raises(
        ValueError,
        match=r"--data.answer_column solution would hide .*'answer' column.*columns are "
        r"\['prompt', 'answer', 'solution'\]",
    ):
        load_prompt_rows(str(path), answer_column="solution")


def test_holding_out_too_many_rows_for_prompts_per_step_is_refused_with_the_numbers(tmp_path):
    path = jsonl(tmp_path / "x.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    with pytest.raises(
        ValueError,
        match=r"has 10 rows; 3 are held out for validation \(--data.val_fraction 0.3, at most 64\), "
        r"which leaves 7 for training, fewer than --data.prompts_per_step 8",
    ):
        PromptDataModule(str(path), prompts_per_step=8, val_fraction=0.3).setup()
    with pytest.raises(
        ValueError, match=r"--data.num_train 2 keeps 2 training prompts, fewer than --data.prompts_per_step 4"
    ):
        PromptDataModule(str(path), prompts_per_step=4, num_train=2).setup()
    val = jsonl(tmp_path / "val.jsonl", [{"prompt": "v", "answer": "0"}])
    with pytest.raises(
        ValueError, match=r"gave 10 training prompts \(10 rows from .*\), fewer than --data.prompts_per_step 16"
    ):
        PromptDataModule(str(path), val_source=str(val), prompts_per_step=16).setup()


def test_a_fit_gives_rewards_each_column_by_its_own_name_as_written(tmp_path, monkeypatch):
    """End to end: a CSV train file + a JSONL validation file in one directory, answer_column pointing at `solution`;
    a reward naming `solution` and `question` gets them (strings, leading zeros kept), and validation uses the JSONL."""
    from lit_gspo.tools.main import cli_main

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.csv").write_text(
        "question,solution\n" + "".join(f"rev {i:03d}=,{i:03d}\n" for i in range(0, 80, 10))
    )
    jsonl(
        folder / "validation.jsonl",
        [{"question": "rev 123=", "solution": "321"}, {"question": "rev 045=", "solution": "540"}],
    )
    module = tmp_path / "seen_rewards.py"
    module.write_text(
        textwrap.dedent("""
        SEEN = []

        def by_name(completions, solution, question, **kwargs):
            SEEN.extend(zip(question, solution, kwargs["answer"]))
            return [0.0] * len(completions)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.max_steps",
            "1",
            "--model.policy.warm_start.steps",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--data.train_source",
            str(folder),
            "--data.prompt_column",
            "question",
            "--data.answer_column",
            "solution",
            "--data.num_train",
            "null",
            "--data.num_val",
            "null",
            "--data.prompts_per_step",
            "4",
            "--model.generation.num_generations",
            "2",
            "--model.rewards",
            "[lit_gspo.rl.rewards.CharAccuracy, seen_rewards.by_name]",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seen = set(sys.modules["seen_rewards"].SEEN)
    assert {("rev 123=", "321", "321"), ("rev 045=", "540", "540")} <= seen  # validation: the directory's JSONL
    train = {s for s in seen if s[0] not in ("rev 123=", "rev 045=")}
    assert len(train) == 4 and train <= {(f"rev {i:03d}=", f"{i:03d}", f"{i:03d}") for i in range(0, 80, 10)}
