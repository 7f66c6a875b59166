"""Sample completions in the loggers: a CSV file next to metrics.csv during a fit, TensorBoard text, a W&B table."""

import csv
from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from lit_gspo.lightning.completions_log import COLUMNS, due, log_completions, markdown
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]


def test_a_fit_writes_the_completions_table_beside_metrics_csv(tmp_path):
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "2",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "1",
        "--model.validation.log_completions_every_n_steps",
        "2",
        "--model.validation.num_logged_completions",
        "3",
        "--data.num_train",
        "16",
        "--data.num_val",
        "3",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "2",
        "--model.generation.max_new_tokens",
        "3",
        "--trainer.enable_progress_bar",
        "false",
    ]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = next(tmp_path.glob("**/metrics.csv"))
    with open(metrics.parent / "completions.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS
    assert [int(r["step"]) for r in rows] == [0, 0, 0, 2, 2, 2]  # validations at 0, 1, 2: logged at multiples of 2
    val_rows = cli.datamodule.val_rows
    assert [r["prompt"] for r in rows[:3]] == [v["prompt"] for v in val_rows]
    assert [r["answer"] for r in rows[:3]] == [v["answer"] for v in val_rows]
    with open(metrics) as f:
        val = {int(r["step"]): float(r["val/reward"]) for r in csv.DictReader(f) if r.get("val/reward")}
    for step in (0, 2):  # all 3 held-out prompts are shown: their mean reward is that step's val/reward
        shown = [float(r["reward"]) for r in rows if int(r["step"]) == step]
        assert sum(shown) / 3 == pytest.approx(val[step], abs=1e-6)


def test_when_completions_are_logged():
    assert due(0, None) and due(7, None)  # every validation
    assert not due(0, 0) and not due(10, 0)  # never
    assert due(0, 5) and due(10, 5) and not due(7, 5)


class FakeTensorBoard(TensorBoardLogger):
    def __init__(self):
        self.texts = []

    @property
    def experiment(self):
        return self

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, text, global_step))


class FakeWandb(WandbLogger):
    def __init__(self):
        self.tables = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None):
        self.tables.append((key, columns, data, step))


def test_tensorboard_gets_a_markdown_table_and_wandb_a_table():
    tb, wb = FakeTensorBoard(), FakeWandb()
    rows = [{"prompt": "rev 12|3=", "answer": "321"}, {"prompt": [{"role": "user", "content": "hi"}], "answer": None}]
    log_completions([tb, wb], 5, rows, ["321", "a\nb"], [1.0, 0.25])
    ((tag, text, step),) = tb.texts
    assert tag == "val/completions" and step == 5
    assert text.splitlines()[0] == "| step | prompt | completion | reward | answer |"
    assert "rev 12\\|3=" in text and "a<br>b" in text and "| 0.25 |" in text and "user: hi" in text
    ((key, columns, data, step),) = wb.tables
    assert key == "val/completions" and columns == COLUMNS and step == 5
    assert data == [[5, "rev 12|3=", "321", 1.0, "321"], [5, "user: hi", "a\nb", 0.25, ""]]
    assert markdown(data) == text


def test_print_completions_shows_each_logged_completion_with_every_reward_on_the_terminal(tmp_path, capsys):
    """As TRL's ``log_completions``: prompt, completion, the reward and each function's own score, at the validations
    that log completions; off by default."""
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "1",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "1",
        "--model.validation.num_logged_completions",
        "3",
        "--model.validation.print_completions",
        "true",
        "--model.rewards",
        "[lit_gspo.rl.rewards.CharAccuracy, lit_gspo.rl.rewards.ExactMatch]",
        "--model.reward_weights",
        "[1.0, 0.5]",
        "--data.num_train",
        "16",
        "--data.num_val",
        "5",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "2",
        "--model.generation.max_new_tokens",
        "3",
        "--trainer.enable_progress_bar",
        "false",
    ]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    out = capsys.readouterr().out.splitlines()
    titles = [i for i, line in enumerate(out) if "val completions, greedy, the first 3 held-out prompts" in line]
    assert [out[i].split(":")[0] for i in titles] == ["step 0", "step 1"]
    header, *body = out[titles[1] + 1 : titles[1] + 5]
    assert header.split() == ["prompt", "completion", "reward", "char_accuracy", "exact_match"]
    with open(next(tmp_path.glob("**/completions.csv"))) as f:
        logged = [r for r in csv.DictReader(f) if r["step"] == "1"]
    for line, row in zip(body, logged):  # the same completions as the loggers got
        assert line.startswith(row["prompt"])
        reward, char_accuracy, exact_match = map(float, line.split()[-3:])
        assert reward == pytest.approx(float(row["reward"]), abs=5e-4)
        assert reward == pytest.approx(char_accuracy + 0.5 * exact_match, abs=1e-3)


def test_completions_are_not_printed_unless_asked(tmp_path, capsys):
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "1",
        "--model.policy.warm_start.steps",
        "0",
        "--data.num_train",
        "16",
        "--data.num_val",
        "3",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "2",
        "--model.generation.max_new_tokens",
        "3",
        "--trainer.enable_progress_bar",
        "false",
    ]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "completions, greedy" not in capsys.readouterr().out
