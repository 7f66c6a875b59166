"""The LightningDataModule: batches of prompt rows, resumable mid-epoch.

How resuming works (Lightning 2.6): at checkpoint time the fit loop stores ``state_dict()`` of every
train loader that has ``state_dict``/``load_state_dict`` (``CombinedLoader._state_dicts``) and on
restart hands it back before iterating. A plain ``torch.utils.data.DataLoader`` has neither, so
``PromptLoader`` adds them, storing the sampler's (epoch, position). The sampler subclasses
``DistributedSampler`` and shards rows by rank itself, so under DDP Lightning leaves it alone
instead of replacing it with its own (which would lose the state).
"""

from __future__ import annotations

import inspect
import math
import random
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_gspo.data.prompts import (
    directory_splits,
    held_out_split,
    in_memory_table,
    is_dataset_dict,
    load_prompt_rows,
    subset_indices,
)
from lit_gspo.data.synthetic import TASKS, check_task_options, options_from
from lit_gspo.lightning.module_hooks import DATA_HOOKS, check_hooks
from lit_gspo.lightning.seed import resolve_seed
from lit_gspo.runtime.user_errors import option

#: sizes of a built-in task when num_train / num_val are None (files and datasets are used whole)
TASK_NUM_TRAIN, TASK_NUM_VAL = 1000, 64
#: at most this many rows are held out of a training file for validation when num_val is None
HELD_OUT_MAX = 64
#: (the file, task or dataset split; each kept row's index in it)
Origin = tuple[str, list[int]]
#: the names rows given from Python go by (``PromptDataModule.from_datasets``), TRL's
TRAIN_DATASET, EVAL_DATASET = "train_dataset", "eval_dataset"


class RowDataset(Dataset):
    """A map-style dataset over a list of row dicts."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def _identity(rows: list[dict]) -> list[dict]:
    return rows


class ResumableSampler(DistributedSampler):
    """Seeded shuffle, a new deterministic order every epoch, and a resumable (epoch, position).

    Epoch ``e``'s order is a permutation seeded by (seed, e); rank ``r`` of ``w`` takes every w-th
    index from r, all ranks the same count. ``position`` counts indices already handed out this
    epoch (advanced by ``PromptLoader`` as batches are yielded), so iterating again resumes there.
    Once an epoch is used up, the next iteration starts epoch + 1.
    """

    def __init__(self, num_rows: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(range(num_rows), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.num_rows = num_rows
        self.position = 0

    def order(self) -> list[int]:
        """This rank's indices for the current epoch."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        per_rank = self.num_rows // self.num_replicas
        perm = torch.randperm(self.num_rows, generator=generator)[: per_rank * self.num_replicas]
        return perm[self.rank :: self.num_replicas].tolist()

    def __len__(self) -> int:
        return self.num_rows // self.num_replicas

    def __iter__(self):
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        return iter(self.order()[self.position :])

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (Lightning calls this every epoch); the position is kept if the epoch is unchanged."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["num_rows"]) != (self.seed, self.num_rows):
            raise ValueError(
                f"cannot resume: the checkpoint's training data had {state['num_rows']} rows shuffled with "
                f"seed {state['seed']}, this run's has {self.num_rows} rows and seed {self.seed} "
                f"({option('data.seed')}, {option('data.num_train')} and the data must be the run's)"
            )
        self.epoch, self.position = state["epoch"], state["position"]


class RowBatches:
    """Consecutive batches of ``batch_size`` rows, in order: an iterable that draws no random numbers (Lightning takes
    any sized iterable as a dataloader; ``limit_val_batches`` uses its length) and, not being a ``DataLoader``, one
    that Lightning does not split over the ranks: ``trainer.predict(model, dataloaders=RowBatches(rows, 8))``."""

    def __init__(self, rows: list[dict], batch_size: int) -> None:
        self.rows, self.batch_size = rows, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.rows) / self.batch_size)

    def __iter__(self):
        return (self.rows[i : i + self.batch_size] for i in range(0, len(self.rows), self.batch_size))


class PromptLoader(DataLoader):
    """A DataLoader of row lists (collate = identity) whose position Lightning saves and restores."""

    def __init__(self, rows: list[dict], batch_size: int, sampler: ResumableSampler) -> None:
        # a private generator: each new iterator draws its base seed from it, not from the global torch RNG
        # (so re-creating the iterator after a resume does not shift the sampling RNG stream)
        super().__init__(
            RowDataset(rows),
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=_identity,
            drop_last=True,
            generator=torch.Generator().manual_seed(sampler.seed),
        )

    def __iter__(self):
        sampler = self.sampler
        for batch in super().__iter__():
            sampler.position += len(batch)  # counted when handed out: a checkpoint after this step resumes past it
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's (epoch, position); Lightning stores it in checkpoints."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved (epoch, position)."""
        self.sampler.load_state_dict(state)


def _count(kept: list, rows: list, limit: str) -> str:
    """``"5000 rows"``, or ``"1000 of 5000 rows (num_train=1000)"`` when a limit cut them."""
    return f"{len(kept)} rows" if len(kept) == len(rows) else f"{len(kept)} of {len(rows)} rows ({limit})"


class PromptDataModule(LightningDataModule):
    """Prompt rows for RL: ``train_dataloader`` yields lists of ``prompts_per_step`` row dicts.

    Args:
        train_source: a built-in task name, a local .json/.jsonl/.parquet/.csv file or directory, or
            a Hub dataset name (see ``load_prompt_rows``).
        val_source: where held-out prompts come from; None takes the held-out split of a built-in
            task, a ``train_source`` directory's own validation (else test) split (``validation.jsonl``,
            ``val.csv``, ``test.jsonl``, ...), or else ``val_fraction`` of the rows of a file/dataset (removed
            from training).
        prompt_column: the column holding prompts.
        answer_column: the column holding reference answers (None for none).
        num_train: training prompts: exactly this many for a task (None: 1000); at most this many of
            a file/dataset, a seeded sample (None: every row not held out).
        num_val: validation prompts: exactly this many for a task (None: 64); at most this many of
            ``val_source`` (None: all its rows); held out of the training file when ``val_source`` is
            None: ``min(num_val, ceil(val_fraction · rows))`` with num_val None counting as 64.
        task_kwargs: options of a built-in task, e.g. ``{"digits": 1, "ops": "+"}``.
        val_task_kwargs: options of the built-in task that validation's prompts come from, when they differ from
            training's: e.g. longer strings than ``reversal`` trains on, to measure length generalisation (None:
            ``task_kwargs``). Held-out prompts stay out of training whatever the options.
        prompts_per_step: prompts per rollout batch on each process (an incomplete last batch is dropped).
        val_batch_size: prompts per validation batch.
        seed: seeds task generation, subset choice and the shuffle (None: the run's ``seed_everything``).
        train_split: the split loaded from a directory or Hub dataset for training.
        val_split: the split loaded from ``val_source`` (or the held-out split of a task, or the split of a
            ``train_source`` directory used for validation when it has it).
        val_fraction: the share of a file/dataset held out when ``val_source`` is None.
    """

    def __init__(
        self,
        train_source: str = "arithmetic",
        val_source: str | None = None,
        prompt_column: str = "prompt",
        answer_column: str | None = "answer",
        num_train: int | None = None,
        num_val: int | None = None,
        task_kwargs: dict | None = None,
        val_task_kwargs: dict | None = None,
        prompts_per_step: int = 8,
        val_batch_size: int = 64,
        seed: int | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        check_hooks(type(self), PromptDataModule, DATA_HOOKS)  # a subclass's hooks (module_hooks.py)
        for name, source in (("train_source", train_source), ("val_source", val_source)):
            if source is not None and not isinstance(source, str):
                raise TypeError(
                    f"{name} names where the rows are (a built-in task, a file, a directory or a Hub dataset), got a "
                    f"{type(source).__name__}: rows in memory (a datasets.Dataset, a list of dicts, a DataFrame) are "
                    "PromptDataModule.from_datasets(train_dataset=..., eval_dataset=..., ...)"
                )
        if prompts_per_step < 1 or val_batch_size < 1:
            bad = "prompts_per_step" if prompts_per_step < 1 else "val_batch_size"
            raise ValueError(
                f"{option('data.' + bad, {'prompts_per_step': prompts_per_step, 'val_batch_size': val_batch_size}[bad])}: must be >= 1 (prompts per batch)"
            )
        if not 0 < val_fraction < 1:
            raise ValueError(
                f"{option('data.val_fraction', val_fraction)}: must be in (0, 1) (the share of a file "
                "held out for validation when there is no val_source)"
            )
        for name, n in (("num_train", num_train), ("num_val", num_val)):
            if n is not None and n < 0:
                raise ValueError(
                    f"{option('data.' + name, n)}: must be >= 0, or null (every row of a file; a task's default size)"
                )
        val_task = train_source if val_source is None else val_source
        if val_task_kwargs is not None and val_task not in TASKS:
            raise ValueError(
                f"{option('data.val_task_kwargs', val_task_kwargs)}: options of a built-in task {sorted(TASKS)}, but "
                f"validation's prompts come from {val_task!r} ({option('data.val_source')}); leave it null"
            )
        self.task_kwargs = dict(task_kwargs or {})
        self.val_task_kwargs = self.task_kwargs if val_task_kwargs is None else dict(val_task_kwargs)
        #: where validation's task options were given, as its errors name it
        self.val_options_setting = "data.task_kwargs" if val_task_kwargs is None else "data.val_task_kwargs"
        inherited = val_task_kwargs is None and val_task != train_source  # training's options, another task's
        for source, setting, kwargs, hint in (
            (train_source, "data.task_kwargs", self.task_kwargs, ""),
            (
                val_task,
                self.val_options_setting,
                self.val_task_kwargs,
                f"; validation's task {val_task!r} takes options of its own as {option('data.val_task_kwargs')}"
                if inherited
                else "",
            ),
        ):
            if source in TASKS:  # at start, not at the first batch after the model
                with options_from(setting):
                    check_task_options(source, kwargs, hint)
        self.save_hyperparameters()
        self.train_source, self.val_source = train_source, val_source
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.num_train, self.num_val = num_train, num_val
        self.prompts_per_step, self.val_batch_size = prompts_per_step, val_batch_size
        self.seed, self.train_split, self.val_split, self.val_fraction = (
            resolve_seed(seed),
            train_split,
            val_split,
            val_fraction,
        )
        self.train_rows: list[dict] | None = None
        self.val_rows: list[dict] | None = None
        self._origin: dict[str, Origin] = {}
        self.in_memory: dict[str, tuple] = {}  # name → rows given from Python (``from_datasets``)

    @classmethod
    def from_datasets(cls, train_dataset, eval_dataset=None, **settings) -> PromptDataModule:
        """Rows held in memory, as TRL's ``GRPOTrainer(train_dataset=..., eval_dataset=...)`` takes them: a
        ``datasets.Dataset``, a ``DatasetDict`` (its ``train_split``; its ``val_split``, else ``validation`` or
        ``test``), a list of row dicts or a pandas DataFrame, each checked here. Without ``eval_dataset``, validation
        takes a ``DatasetDict``'s own split as a directory's, or holds out rows of ``train_dataset`` as of a file
        (``val_fraction``). ``settings`` are the constructor's other arguments. Messages and checkpoints name the rows
        ``train_dataset`` and ``eval_dataset``; a checkpoint keeps their names, not the rows."""
        for name in ("train_source", "val_source", "task_kwargs", "val_task_kwargs"):
            if name in settings:
                raise TypeError(f"from_datasets takes rows as train_dataset and eval_dataset, not {name}")
        defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}
        train_split, val_split = (settings.get(name, defaults[name]) for name in ("train_split", "val_split"))
        val_source, val_name = (None, None) if eval_dataset is None else (EVAL_DATASET, EVAL_DATASET)
        if eval_dataset is None and is_dataset_dict(train_dataset):  # its own validation split, as a directory's
            own = held_out_split(train_dataset, val_split, train_split)
            if own is not None:
                eval_dataset, val_source, val_name = train_dataset, f"{TRAIN_DATASET} [{own}]", TRAIN_DATASET
                val_split = own
        elif is_dataset_dict(eval_dataset):
            val_split = held_out_split(eval_dataset, val_split) or val_split
        module = cls(train_source=TRAIN_DATASET, val_source=val_source, **settings)
        module.in_memory[TRAIN_DATASET] = in_memory_table(train_dataset, TRAIN_DATASET, train_split)
        if val_source is not None:
            module.in_memory[val_source] = in_memory_table(eval_dataset, val_name, val_split, "data.val_split")
        return module

    def _load(self, source: str, split: str, limit: str) -> tuple[list[dict], str, Origin]:
        """The rows for ``limit`` (``"num_train"``/``"num_val"``), their description for the log line, and where each
        row comes from."""
        n = getattr(self, limit)
        if source in TASKS:
            n = (TASK_NUM_TRAIN if limit == "num_train" else TASK_NUM_VAL) if n is None else n
            kwargs, setting = (
                (self.task_kwargs, "data.task_kwargs")
                if limit == "num_train"
                else (self.val_task_kwargs, self.val_options_setting)
            )
            with options_from(setting):
                rows = load_prompt_rows(
                    source, split, self.prompt_column, self.answer_column, n=n, seed=self.seed, **kwargs
                )
            return (
                rows,
                f"{len(rows)} rows from task {source!r} ({split} split)",
                (f"task {source!r} ({split} split)", list(range(len(rows)))),
            )
        rows = load_prompt_rows(
            source, split, self.prompt_column, self.answer_column, seed=self.seed, table=self.in_memory.get(source)
        )
        indices = subset_indices(len(rows), n, self.seed)
        kept = [rows[i] for i in indices]
        return (
            kept,
            _count(kept, rows, option(f"data.{limit}", n)) + f" from {self._name(source, split)}",
            (self._name(source, split), indices),
        )

    def _name(self, source: str, split: str) -> str:
        """A file or rows given from Python as named; a directory or Hub dataset with its split."""
        return source if source in self.in_memory or Path(source).is_file() else f"{source} [{split}]"

    def _directory_val_split(self) -> str | None:
        """The split of a ``train_source`` directory that serves as validation when ``val_source`` is None: ``val_split``
        when the directory has it, else its ``validation`` or ``test`` split; None for files, tasks, Hub datasets and a
        directory with one split (rows are then held out of training)."""
        if self.val_source is not None or self.train_source in TASKS or self.train_source in self.in_memory:
            return None
        if not Path(self.train_source).is_dir():
            return None
        return held_out_split(directory_splits(Path(self.train_source)), self.val_split, self.train_split)

    def setup(self, stage: str | None = None) -> None:
        """Load (or generate) the train and validation rows once and say how many there are (rank 0)."""
        if self.train_rows is not None:
            return
        for source in (self.train_source, self.val_source):
            given = source is not None and source.split(" [")[0] in (TRAIN_DATASET, EVAL_DATASET)
            if given and source not in self.in_memory and not Path(source).exists():
                raise ValueError(
                    f"{source!r} names rows a run got from Python (PromptDataModule.from_datasets), which its "
                    "checkpoint does not keep: build the data module with them again, "
                    "PromptDataModule.from_datasets(rows, ...)"
                )
        own_split = self._directory_val_split()
        if self.val_source is not None or self.train_source in TASKS or own_split is not None:
            train, train_text, train_origin = self._load(self.train_source, self.train_split, "num_train")
            val, val_text, val_origin = self._load(
                self.val_source or self.train_source, own_split or self.val_split, "num_val"
            )
            if own_split is not None:
                files = ", ".join(f.name for f in directory_splits(Path(self.train_source))[own_split])
                val_text += f" ({files}: the directory's own {own_split} split, so no training row is held out)"
            if len(train) < self.prompts_per_step:
                raise ValueError(
                    f"{self.train_source!r} gave {len(train)} training prompts ({train_text}), fewer than "
                    f"{option('data.prompts_per_step', self.prompts_per_step)}: give more rows or a smaller "
                    f"{option('data.prompts_per_step')}"
                )
        else:
            rows = load_prompt_rows(
                self.train_source,
                self.train_split,
                self.prompt_column,
                self.answer_column,
                seed=self.seed,
                table=self.in_memory.get(self.train_source),
            )
            order = list(range(len(rows)))
            random.Random(self.seed).shuffle(order)
            cap = HELD_OUT_MAX if self.num_val is None else self.num_val
            n_val = min(cap, max(1, math.ceil(self.val_fraction * len(rows))))
            if len(rows) - n_val < self.prompts_per_step:
                raise ValueError(
                    f"{self._name(self.train_source, self.train_split)} has {len(rows)} rows; {n_val} are held out "
                    "for validation "
                    f"({option('data.val_fraction', self.val_fraction)}, at most {cap}), which leaves {len(rows) - n_val} "
                    f"for training, fewer than {option('data.prompts_per_step', self.prompts_per_step)}. Give more rows, "
                    f"a smaller {option('data.prompts_per_step')} or {option('data.val_fraction')}, or the validation "
                    f"rows as {option('data.val_source')} FILE"
                )
            val = [rows[i] for i in sorted(order[:n_val])]
            rest = [rows[i] for i in sorted(order[n_val:])]
            train = rest[: self.num_train]
            name = self._name(self.train_source, self.train_split)
            train_origin, val_origin = (name, sorted(order[n_val:])[: len(train)]), (name, sorted(order[:n_val]))
            train_text = (
                _count(train, rest, option("data.num_train", self.num_train))
                + f" from {self._name(self.train_source, self.train_split)}"
            )
            val_text = (
                f"{len(val)} rows held out of it ({option('data.val_fraction', self.val_fraction)}, at most {cap})"
            )
            if len(train) < self.prompts_per_step:
                raise ValueError(
                    f"{option('data.num_train', self.num_train)} keeps {len(train)} training prompts, "
                    f"fewer than {option('data.prompts_per_step', self.prompts_per_step)}"
                )
        rank_zero_info(f"train: {train_text}, val: {val_text}")
        self.train_rows, self.val_rows = train, val
        self._origin = {"train": train_origin, "val": val_origin}

    def describe_row(self, split: str, position: int) -> str:
        """Where row ``position`` of ``train_rows``/``val_rows`` (``split`` "train"/"val") comes from: its file and
        row (counted from 0 in the file, as ``load_prompt_rows`` reads it), or its task and index."""
        if split not in self._origin:  # rows set by hand
            return f"{split}_rows[{position}]"
        name, rows = self._origin[split]
        return f"{name} row {rows[position]}"

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> PromptLoader:
        """Shuffled, per-rank batches of ``prompts_per_step`` rows; resumable (see ``PromptLoader``)."""
        self.setup()
        rank, world_size = self._rank()
        if len(self.train_rows) // world_size < self.prompts_per_step:
            raise ValueError(
                f"{len(self.train_rows)} training prompts over {world_size} processes cannot fill one batch "
                f"of {option('data.prompts_per_step', self.prompts_per_step)} on each"
            )
        sampler = ResumableSampler(len(self.train_rows), seed=self.seed, rank=rank, world_size=world_size)
        return PromptLoader(self.train_rows, self.prompts_per_step, sampler)

    def val_dataloader(self) -> RowBatches:
        """All held-out rows in a fixed order, ``val_batch_size`` per batch, the same on every rank (``validation_step``
        takes its share, so every rank runs every step). A plain list: iterating it draws no random numbers (a
        DataLoader draws a seed from the global generator), so validating does not change the training run."""
        self.setup()
        return RowBatches(self.val_rows, self.val_batch_size)

    def test_dataloader(self) -> RowBatches:
        """The held-out rows, as :meth:`val_dataloader` (``lit-gspo test`` logs them as ``test/*``)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> RowBatches:
        """The held-out rows, as :meth:`val_dataloader` (``trainer.predict`` gives their completions)."""
        return self.val_dataloader()
