"""Small clear errors (issue 20): empty and non-UTF-8 data files, an over-long prompt named by its file row, a hub id
without a network failing in seconds, a misspelled nested key listing the valid ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lit_gspo.data.prompts import load_prompt_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name, text",
    [
        ("empty.jsonl", ""),
        ("blank.jsonl", "\n\n"),
        ("empty.csv", ""),
        ("header.csv", "prompt,answer\n"),
        ("empty.json", "[]"),
    ],
)
def test_an_empty_data_file_says_so(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{path} (is empty|holds no rows)"):
        load_prompt_rows(str(path))


@pytest.mark.parametrize(
    "name, content, line",
    [
        ("bad.jsonl", b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n', 2),
        ("bad.csv", b"prompt,answer\nok,1\nok,2\ncaf\xe9,3\n", 4),
    ],
)
def test_a_file_that_is_not_utf8_names_the_file_and_line(tmp_path, name, content, line):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path} line {line} is not UTF-8 text: byte b'\\xe9'"):
        load_prompt_rows(str(path))


@pytest.fixture
def no_network(monkeypatch):
    """HF_HUB_OFFLINE unset, the hub endpoint refusing connections (CI sets HF_HUB_OFFLINE=1)."""
    import datasets
    import huggingface_hub

    import lit_gspo.runtime.hub as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9", raising=False)
    monkeypatch.setattr(hub, "_answer", {})


def test_a_hub_model_without_network_fails_in_seconds_saying_why(no_network):
    from lit_gspo.models import load_policy

    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"cannot reach http://127.0.0.1:9.*not in the local Hugging Face cache.*HF_HUB_OFFLINE=1"
    ):
        load_policy("someorg/not-a-model")
    assert time.perf_counter() - start < 15  # it retried for about a minute before


def test_a_hub_dataset_without_network_fails_in_seconds_saying_why(no_network):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"cannot reach http://127.0.0.1:9.*not in the local Hugging Face cache"):
        load_prompt_rows("someorg/not-a-dataset")
    assert time.perf_counter() - start < 15


def test_an_over_long_prompt_is_named_by_its_file_row_before_training(tmp_path):
    from lit_gspo.tools.main import cli_main

    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"rev {i}{i}{i}=", "answer": f"{i}{i}{i}"} for i in range(10)]
    rows[5]["prompt"] = "rev " + "7" * 300 + "="
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.max_steps",
            "2",
            "--model.policy.warm_start.steps",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--data.train_source",
            str(data),
            "--data.num_val",
            "2",
            "--data.prompts_per_step",
            "4",
            "--model.generation.max_prompt_length",
            "64",
        ],
        run=False,
    )
    with pytest.raises(
        ValueError,
        match=rf"{data} row 5: the prompt is \d+ tokens, longer than --model.generation.max_prompt_length 64",
    ):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert (
        not list((tmp_path / "run").glob("**/metrics.csv"))
        or "train/reward" not in next((tmp_path / "run").glob("**/metrics.csv")).read_text()
    )


def test_a_misspelled_nested_key_lists_the_valid_fields(capsys):
    from lit_gspo.tools.main import cli_main

    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--model.generation.num_generation", "4"])
    err = capsys.readouterr().err
    # not taken as an abbreviation of num_generations (argparse's prefix matching is off): refused, with the close ones
    assert "unrecognized arguments: --model.generation.num_generation 4" in err
    assert "Did you mean: --model.generation.num_generations" in err


def test_a_misspelled_option_suggests_the_close_ones(capsys):
    from lit_gspo.tools.main import cli_main

    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--data.prompts_per_stp", "4"])
    assert "Did you mean: --data.prompts_per_step" in capsys.readouterr().err
