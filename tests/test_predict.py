"""``trainer.predict``, as a Lightning user calls it: the completions of the held-out prompts with their rewards, drawn
and scored as a validation draws and scores them, so a prediction's rewards give that validation's metrics exactly."""

import functools
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lit_gspo import GSPO, CharAccuracy, Generation, Policy, PromptDataModule, RLModule, WarmStart
from lit_gspo.rl.config import Validation
from lit_gspo.rl.evaluate import pass_at_k

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(0, 1000, 7)]
THRESHOLD = 0.5


def module(n: int = 0, engine=None, lr: float = 1e-5) -> RLModule:
    """A tiny warm-started policy; ``n`` sampled completions per prompt in validation (0: one greedy)."""
    return RLModule(
        policy=Policy(
            "tiny-llama",
            config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64},
            warm_start=WarmStart(steps=30, lr=1e-2, batch_size=16),
        ),
        objective=GSPO(),
        rewards=[CharAccuracy()],
        generation=Generation(num_generations=4, max_new_tokens=4),
        engine=engine,
        optimizer=functools.partial(torch.optim.AdamW, lr=lr),
        validation=Validation(num_generations=n, temperature=1.5, pass_threshold=THRESHOLD) if n else Validation(),
    )


def data() -> PromptDataModule:
    return PromptDataModule.from_datasets(ROWS, eval_dataset=ROWS[:10], prompts_per_step=4, val_batch_size=4)


def trainer(root, **flags) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **flags,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A warm-started policy after one RL step: its completions are partly right (CharAccuracy between 0 and 1)."""
    root = tmp_path_factory.mktemp("predict")
    L.seed_everything(0)
    saved = ModelCheckpoint(dirpath=root / "checkpoints")
    trainer(root, max_steps=1, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[saved]).fit(
        module(), datamodule=data()
    )
    return saved.last_model_path or saved.best_model_path


def flat(predictions: list[list[dict]]) -> list[dict]:
    return [prediction for batch in predictions for prediction in batch]


@pytest.mark.parametrize("n", [0, 3], ids=["greedy", "sampled"])
def test_predictions_score_as_the_validation_of_the_same_checkpoint(checkpoint, n, tmp_path):
    model, held_out = module(n), data()
    predictions = trainer(tmp_path).predict(model, datamodule=held_out, ckpt_path=checkpoint)
    (metrics,) = trainer(tmp_path).validate(model, datamodule=held_out, ckpt_path=checkpoint, verbose=False)
    assert [len(batch) for batch in predictions] == [4, 4, 2]  # one list per batch of val_batch_size rows
    predictions = flat(predictions)
    assert [p["row"] for p in predictions] == ROWS[:10]
    samples = max(n, 1)
    assert all(len(p["completions"]) == len(p["rewards"]) == samples for p in predictions)
    assert all(isinstance(text, str) for p in predictions for text in p["completions"])
    rewards = [r for p in predictions for r in p["rewards"]]
    assert 0 < sum(rewards) < len(rewards)  # a policy partly right: the identities below could fail
    assert math.fsum(rewards) / len(rewards) == pytest.approx(metrics["val/reward"], rel=1e-12)
    assert all(p["scores"] == {"char_accuracy": p["rewards"]} for p in predictions)  # one function, weight 1
    for k in range(1, n + 1):
        solved = [sum(r >= THRESHOLD for r in p["rewards"]) for p in predictions]
        expected = sum(pass_at_k(n, c, k) for c in solved) / len(predictions)
        assert expected == pytest.approx(metrics[f"val/pass@{k}"], rel=1e-12)


def test_predicting_twice_gives_the_same_samples(checkpoint, tmp_path):
    """A sampled prediction draws from the validation's seeded stream, whatever the global RNG's state."""
    model, held_out = module(3), data()
    torch.manual_seed(123)
    first = trainer(tmp_path).predict(model, datamodule=held_out, ckpt_path=checkpoint)
    torch.manual_seed(456)
    assert trainer(tmp_path).predict(model, datamodule=held_out, ckpt_path=checkpoint) == first


@pytest.mark.parametrize("load", ["validate", "test", "predict", "load_from_checkpoint"])
def test_a_checkpoint_loaded_outside_a_fit_leaves_the_random_state_as_it_was(checkpoint, load, tmp_path):
    """Only a fit's resume restores the RNG states the checkpoint holds (a script or notebook that evaluates a
    checkpoint between draws of its own keeps its stream; before, these four restored the fit's)."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    if load == "load_from_checkpoint":
        RLModule.load_from_checkpoint(checkpoint, objective=GSPO(), rewards=[CharAccuracy()])
    else:
        kwargs = {} if load == "predict" else {"verbose": False}
        getattr(trainer(tmp_path), load)(module(3), datamodule=data(), ckpt_path=checkpoint, **kwargs)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_loader_of_rows_predicts_as_the_data_module_does_and_rows_without_an_answer_get_no_reward(
    checkpoint, tmp_path
):
    """Prompts of one's own, from a DataLoader that keeps rows; a row with nothing to compare with (answer None) is
    predicted with rewards None, not a score."""
    model = module()
    from_module = flat(trainer(tmp_path).predict(model, datamodule=data(), ckpt_path=checkpoint))
    rows = ROWS[:10]
    loader = DataLoader(rows, batch_size=4, collate_fn=lambda batch: batch)
    assert flat(trainer(tmp_path).predict(model, dataloaders=loader)) == from_module  # weights loaded above
    unlabelled = [{"prompt": row["prompt"], "answer": None} for row in rows[:4]]
    loader = DataLoader(unlabelled, batch_size=4, collate_fn=lambda batch: batch)
    (batch,) = trainer(tmp_path).predict(model, dataloaders=loader)
    assert [p["completions"] for p in batch] == [p["completions"] for p in from_module[:4]]
    assert all(p["rewards"] == [None] and p["scores"] == {"char_accuracy": [None]} for p in batch)
    with pytest.raises(TypeError, match=r"^a batch of prompts is a list of row dicts .* got a dict of columns"):
        trainer(tmp_path).predict(model, dataloaders=DataLoader(rows, batch_size=4))  # the default collate


@pytest.mark.distributed
def test_two_processes_predict_from_a_one_process_checkpoint_what_one_process_does(checkpoint, tmp_path):
    """Under DDP each rank samples its share of a batch (a batch of 1 row leaves rank 1 none) and every rank returns
    the whole batch, greedy as one process does. A fit's checkpoint holds one RNG state per rank, which only a fit
    restores: predicting from it on another number of processes was refused ("resume with the same number of
    processes")."""
    outputs = {}
    for devices in (1, 2):
        out = tmp_path / f"devices{devices}"
        subprocess.run(
            [sys.executable, str(ROOT / "tests/dist_predict.py"), str(out), str(devices), checkpoint],
            check=True,
            timeout=300,
            cwd=ROOT,
        )
        outputs[devices] = [torch.load(out / f"rank{rank}.pt") for rank in range(devices)]
    (single,) = outputs[1]
    assert [len(batch) for batch in single] == [4, 1]
    assert outputs[2] == [single, single]


def held_out(out: Path, devices: int, stage: str, loader: str, rows: int) -> list:
    """What each rank of ``tests/dist_held_out_loader.py`` returned or raised."""
    script = [sys.executable, str(ROOT / "tests/dist_held_out_loader.py"), str(out), str(devices), stage, loader]
    proc = subprocess.run([*script, str(rows)], timeout=300, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{stage} {loader} {rows} on {devices}: {proc.returncode}\n{proc.stderr[-3000:]}"
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(devices)]


@pytest.mark.distributed
def test_under_ddp_a_loader_split_over_the_ranks_is_refused_on_every_rank_and_row_batches_predict_every_row(
    tmp_path,
):
    """Before: a DataLoader of 10 rows, which Lightning splits over 2 ranks, predicted 5 of them (each rank its share of
    its own part) and validated on those 5; predicting 9 rows one rank had a batch more and the other waited for it. Now
    each is refused on both ranks, naming what to pass; the ``RowBatches`` it names predicts all 10, in order, on every
    rank, as one process does."""
    for stage, rows, said in [
        ("predict", 10, "the ranks were given different rows"),
        ("validate", 10, "the ranks were given different rows"),
        ("predict", 9, "different numbers of batches per loader (rank 0 [2], rank 1 [1])"),
    ]:
        for result in held_out(tmp_path / f"{stage}{rows}", 2, stage, "dataloader", rows):
            assert isinstance(result, ValueError) and said in str(result), (stage, rows, result)
            assert "lit_gspo.RowBatches(rows, batch_size=8)" in str(result)
    one = held_out(tmp_path / "one", 1, "predict", "batches", 10)
    two = held_out(tmp_path / "two", 2, "predict", "batches", 10)
    assert [p["row"] for p in flat(one[0])] == ROWS[:10]
    assert two == [one[0], one[0]]
