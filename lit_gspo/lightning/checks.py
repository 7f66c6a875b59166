"""Settings of an RLModule that cannot work together, or with the Trainer that runs it: refused at start, in one line."""

from __future__ import annotations

from lit_gspo.data.prompts import check_prompt_lengths
from lit_gspo.rl.advantages import AdvantageEstimator
from lit_gspo.rl.config import Generation
from lit_gspo.rl.objectives import Objective


def check_stages_fit(objective: Objective, advantage: AdvantageEstimator, generation: Generation) -> None:
    """An estimator and an objective that cannot work together, or groups too small for the estimator, fail at start."""
    if advantage.needs_values != objective.needs_critic:
        raise ValueError(
            f"{type(advantage).__name__} {'needs' if advantage.needs_values else 'does not use'} a critic's "
            f"values, and {type(objective).__name__} {'has' if objective.needs_critic else 'has no'} critic: "
            "use GAE with PPO, and GroupNormalized, GroupMean, BatchNormalized or RLOO with the others"
        )
    if advantage.needs_groups and generation.num_generations < 2:
        raise ValueError(
            f"generation.num_generations={generation.num_generations}, but {type(advantage).__name__} compares "
            "the completions of a prompt with each other (Â = 0 for a group of 1, nothing is learned): use "
            "num_generations >= 2, or an estimator without groups (GAE with PPO)"
        )


#: ``val_check_interval`` of a run that validates only before and after training (``validation.every_n_steps=0``)
NEVER = 2**62


def validation_schedule(every_n_steps: int) -> dict:
    """The Trainer settings of ``validation.every_n_steps``: Lightning's validation loop every n batches (= RL steps)."""
    return {"val_check_interval": every_n_steps or NEVER, "check_val_every_n_epoch": None}


def check_validation_schedule(trainer, every_n_steps: int) -> None:
    """``RLModule(validation=Validation(every_n_steps=n))`` under a Trainer that schedules otherwise: one line naming
    the Trainer flags."""
    want = validation_schedule(every_n_steps)
    have = {
        "val_check_interval": trainer.val_check_interval,
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
    }
    if have != want:
        raise ValueError(
            f"validation.every_n_steps={every_n_steps} needs Trainer(val_check_interval="
            f"{want['val_check_interval']}, check_val_every_n_epoch=None) (one Lightning batch is one RL "
            f"step); this Trainer has {have}. Set those on the Trainer, or leave validation.every_n_steps=None"
        )


def check_param_dtype(param_dtype: str | None, precision: str) -> None:
    """``update.param_dtype`` computes in bf16 itself; under fp16 autocast (``16-mixed``) its casts would be cast again."""
    if param_dtype is not None and precision.startswith("16"):
        raise ValueError(
            f"update.param_dtype={param_dtype!r} with trainer.precision={precision!r}: fp16 autocast would cast the "
            f"{param_dtype} casts again; use it with bf16-mixed or 32-true, or set update.param_dtype to null"
        )


def check_data(module) -> None:
    """A reward function whose parameters no dataset column fills, or a prompt too long for the context, fails now
    (named by its file row), not after N steps."""
    dm = module.trainer.datamodule
    rows = getattr(dm, "train_rows", None)
    if rows:
        module.collector.rewards.check(list(rows[0]))
    for split in ("train", "val"):
        check_prompt_lengths(
            getattr(dm, f"{split}_rows", None) or [],
            lambda r: module.collector.encode(module.policy, r),
            lambda i: dm.describe_row(split, i) if hasattr(dm, "describe_row") else f"{split} row {i}",
        )


#: how rows in memory or on disk reach an RLModule
DATA_MODULE_HINT = "datamodule=PromptDataModule(...) (rows in memory: PromptDataModule.from_datasets(rows, ...))"


def check_prompt_source(module) -> None:
    """A fit draws its prompt rows from a data module's ``train_rows`` (the warm start's demonstrations, dynamic
    sampling's refills, the data checks): a fit given loaders alone (``trainer.fit(model, train_dataloaders=...)``)
    is refused at start, naming what to give instead."""
    datamodule = module.trainer.datamodule
    if hasattr(datamodule, "train_rows"):
        return
    given = "loaders and no data module" if datamodule is None else f"a {type(datamodule).__name__}"
    raise TypeError(f"RLModule reads its prompts from a PromptDataModule, got {given}: {DATA_MODULE_HINT}")


def check_rows_batch(rows) -> None:
    """A batch of prompts is a list of row dicts, as ``PromptDataModule``'s loaders give it; a DataLoader's default
    collate (a dict of columns) or a tokenised batch is refused in one line."""
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return
    if isinstance(rows, dict):
        got = (
            f"a dict of columns {sorted(rows)[:6]} (a DataLoader's default collate: "
            "collate_fn=lambda rows: rows keeps rows)"
        )
    elif isinstance(rows, (list, tuple)):
        bad = next(row for row in rows if not isinstance(row, dict))
        got = f"a {type(rows).__name__} holding a {type(bad).__name__}"
    else:
        got = f"a {type(rows).__name__}"
    raise TypeError(
        f"a batch of prompts is a list of row dicts (PromptDataModule's loaders), got {got}: {DATA_MODULE_HINT}"
    )
