"""Prompt data: built-in synthetic tasks, loading rows from files or the Hub, prompt encoding. No Lightning here: the
``LightningDataModule`` over these rows is ``lit_gspo.lightning.datamodule.PromptDataModule``.
"""

from lit_gspo.data.prompts import encode_prompts, load_prompt_rows
from lit_gspo.data.synthetic import TASKS, get_task, is_held_out, make_split, make_task, sft_examples, task_splits

__all__ = [
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
