"""Prompt data: built-in synthetic tasks, loading rows from files or the Hub, prompt encoding, the DataModule.

The DataModule (Lightning) is imported on first use, so the stages below ``module.py`` that encode
prompts import no Lightning.
"""

from lit_gspo.data.prompts import encode_prompts, load_prompt_rows
from lit_gspo.data.synthetic import TASKS, get_task, is_held_out, make_split, make_task, sft_examples, task_splits

__all__ = [
    "PromptDataModule",
    "PromptLoader",
    "ResumableSampler",
    "RowDataset",
    "TASKS",
    "encode_prompts",
    "get_task",
    "is_held_out",
    "load_prompt_rows",
    "make_split",
    "make_task",
    "sft_examples",
    "task_splits",
]

_DATAMODULE = ("PromptDataModule", "PromptLoader", "ResumableSampler", "RowDataset")


def __getattr__(name: str):
    if name in _DATAMODULE:
        from lit_gspo.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module 'lit_gspo.data' has no attribute {name!r}")
