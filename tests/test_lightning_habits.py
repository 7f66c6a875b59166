"""Each habit a Lightning user brings works, or is refused at start in one line (``benchmarks/lightning_habits.py``,
whose table is in docs/usage.md, runs the same habits on the quickstart)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lightning_habits import HABITS, run_habit, verdict  # noqa: E402

from lit_gspo.lightning.cli import cli_main  # noqa: E402

STEPS = 6
TINY = [
    "--config",
    str(ROOT / "configs/quickstart.yaml"),
    "--model.policy.warm_start.steps",
    "5",
    "--model.validation.every_n_steps",
    "2",
    "--data.num_train",
    "64",
    "--data.num_val",
    "8",
    "--data.prompts_per_step",
    "4",
    "--model.generation.num_generations",
    "4",
    "--model.generation.max_new_tokens",
    "4",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.mark.slow
@pytest.mark.parametrize("habit", HABITS, ids=[h.name for h in HABITS])
def test_a_lightning_habit_works_or_is_refused_in_one_line(habit, tmp_path):
    outcome = run_habit(habit, tmp_path / "run", TINY, STEPS)
    good, text = verdict(habit, outcome, STEPS)
    assert good, text
    if habit.refused:
        assert "\n" not in str(outcome.error) and (
            "--model." in str(outcome.error) or "--trainer." in str(outcome.error)
        )


def test_trainer_validate_from_python_puts_val_reward_in_callback_metrics(tmp_path):
    cli = cli_main([*TINY, "--trainer.default_root_dir", str(tmp_path)], run=False)
    (result,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert 0 <= result["val/reward"] <= 1
    assert float(cli.trainer.callback_metrics["val/reward"]) == pytest.approx(result["val/reward"])


def test_validate_and_test_score_a_checkpoint_and_an_export_as_eval_does(tmp_path, capsys):
    from lit_gspo.tools.main import main

    run = tmp_path / "run"
    main(["fit", *TINY, "--trainer.max_steps", "4", "--trainer.default_root_dir", str(run)])
    rows = [float(r) for r in _column(run, "val/reward")]
    scores = {}
    for command, ckpt, key in [
        ("validate", run / "checkpoints/last.ckpt", "val/reward"),
        ("validate", run / "hf_model", "val/reward"),
        ("test", run / "hf_model", "test/reward"),
    ]:
        cli = cli_main(
            [
                command,
                *TINY,
                "--trainer.default_root_dir",
                str(tmp_path / f"{command}_{ckpt.name}"),
                "--ckpt_path",
                str(ckpt),
            ]
        )
        scores[(command, ckpt.name)] = float(cli.trainer.callback_metrics[key])
    from lit_gspo.tools import eval as eval_cli

    eval_result = eval_cli.main(
        [*TINY, "--ckpt", str(run / "hf_model"), "--samples", "0", "--output", str(tmp_path / "eval.json")]
    )
    # the last validation of the fit, both validate commands, test and eval: one number, through one code path
    assert len(set(scores.values())) == 1, scores
    assert scores[("validate", "last.ckpt")] == pytest.approx(rows[-1], abs=0)
    assert eval_result["greedy"]["reward"] == pytest.approx(rows[-1], abs=1e-12)
    # predict, as a Lightning user runs it: the held-out rows' completions and rewards, one JSON line each, in order
    for ckpt in (run / "checkpoints/last.ckpt", run / "hf_model"):
        root = tmp_path / f"predict_{ckpt.name}"
        main(["predict", *TINY, "--trainer.default_root_dir", str(root), "--ckpt_path", str(ckpt)])
        lines = (root / "lightning_logs/predict/predictions.jsonl").read_text().splitlines()
        predictions = [json.loads(line) for line in lines]
        assert [p["completions"][0] for p in predictions] == [p["greedy_completion"] for p in eval_result["per_prompt"]]
        rewards = [p["rewards"][0] for p in predictions]
        assert sum(rewards) / len(rewards) == pytest.approx(rows[-1], abs=1e-6), ckpt.name


class KeepsPredictions(BasePredictionWriter):
    """A user's writer: the predictions of each batch, with Lightning's batch_indices, in ``self.batches``."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.batches = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((batch_indices, prediction))


WRITER = f"{__name__}.KeepsPredictions"


@pytest.mark.parametrize(
    "given",
    [
        ["--trainer.callbacks", json.dumps([{"class_path": WRITER}])],
        ["--trainer.callbacks", json.dumps({"class_path": WRITER})],  # before: TypeError, not iterable
        [f"--trainer.callbacks+={WRITER}"],
    ],
    ids=["list", "one", "appended"],
)
def test_lit_gspo_predict_writes_no_file_of_its_own_beside_a_users_prediction_writer(given, tmp_path):
    """Lightning's pattern: a ``BasePredictionWriter`` in ``trainer.callbacks`` (a list, one callback, or appended, as
    LightningCLI takes them) writes the predictions; the CLI's own file is then left out. The writer gets every held-out
    row's prediction, in order."""
    cli = cli_main(["predict", *TINY, "--trainer.default_root_dir", str(tmp_path), *given])
    (kept,) = [c for c in cli.trainer.callbacks if isinstance(c, KeepsPredictions)]
    assert [p["row"] for _, batch in kept.batches for p in batch] == cli.datamodule.val_rows
    assert not list(tmp_path.rglob("predictions.jsonl"))


def test_a_lightning_validation_does_not_change_the_training_run(tmp_path):
    """val_check_interval 1 against 0 (only before and after): every train/* value and the weights the same."""
    runs = {}
    for every in ("1", "0"):
        root = tmp_path / every
        cli = cli_main(
            [
                "fit",
                *TINY,
                "--trainer.max_steps",
                "3",
                "--model.validation.every_n_steps",
                every,
                "--trainer.default_root_dir",
                str(root),
            ]
        )
        train = [
            {k: v for k, v in row.items() if k.startswith("train/")} for row in _rows(root) if row.get("train/reward")
        ]
        runs[every] = (train, {k: v.clone() for k, v in cli.model.policy.state_dict().items()})
    assert runs["1"][0] == runs["0"][0]
    assert all(torch.equal(runs["1"][1][k], runs["0"][1][k]) for k in runs["1"][1])


def _rows(root: Path) -> list[dict]:
    import csv

    (path,) = root.glob("**/metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def _column(root: Path, key: str) -> list[str]:
    return [row[key] for row in _rows(root) if row.get(key)]
