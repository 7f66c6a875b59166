"""Prompt data: built-in synthetic tasks, loading rows from files or the Hub, prompt encoding. No Lightning here: the
``LightningDataModule`` over these rows is ``lit_gspo.lightning.datamodule.PromptDataModule`` (also reachable as
``lit_gspo.data.PromptDataModule``, imported on first use).
"""

from lit_gspo.data.prompts import encode_prompts, load_prompt_rows
from lit_gspo.data.synthetic import TASKS, get_task, is_held_out, make_split, make_task, sft_examples, task_splits
from lit_gspo.moved import moved_name

__all__ = ["TASKS", "encode_prompts", "get_task", "is_held_out", "load_prompt_rows", "make_split", "make_task", "sft_examples",
           "task_splits"]


def __getattr__(name: str):
    """``lit_gspo.data.PromptDataModule`` and the other DataModule names of before the layout (``lit_gspo.moved``)."""
    return moved_name(__name__, name)
