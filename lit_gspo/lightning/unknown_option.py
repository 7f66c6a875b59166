"""What the error about an option or a YAML key the parser does not know adds: where a setting of that name is.

    error: unrecognized arguments: --model.lr 1e-5
      --model.policy.warm_start.lr and --model.optimizer.lr have that name
    error: Subcommand 'fit' does not accept option 'model.update.num_iterations'
      TRL's GRPOConfig num_iterations is --model.update.epochs here (docs/from_trl.md says how they differ)

TRL's, vLLM's or transformers' name for the setting (``foreign_names.py``) and the options with the same last name (a setting typed in the
wrong group, a class's parameter one level too high); where neither, the close spellings. The command line says
``unrecognized arguments: --a.b``, a YAML ``Group 'a' does not accept option 'b'`` (``Subcommand 'fit' ...`` for a
top-level key): both are read.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re

import torch

from lit_gspo.lightning.foreign_names import foreign_hint, foreign_option
from lit_gspo.rl.advantages import ADVANTAGES
from lit_gspo.rl.config import ReferenceSync
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine
from lit_gspo.rl.envs import Environment, RetryWithFeedback, SingleTurn, ToolUse
from lit_gspo.rl.learn.mismatch import Mismatch
from lit_gspo.rl.objectives import OBJECTIVES

UNKNOWN = (
    re.compile(r"unrecognized arguments: --([\w.]+)"),
    re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'"),
    re.compile(r"Subcommand '\w+' does not accept option '([\w.]+)'"),
)


def class_settings() -> dict[str, list[type]]:
    """The settings that name a class (``class_path``), with the classes lit_gspo ships for them (torch's for the
    optimiser and the scheduler): the parser lists such a setting, not its classes' parameters."""
    return {
        "model.objective": list(OBJECTIVES.values()),
        "model.advantage": list(ADVANTAGES.values()),
        "model.engine": [HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine],
        "model.environment": [Environment, SingleTurn, ToolUse, RetryWithFeedback],
        "model.update.mismatch": [Mismatch],
        "model.policy.ref_sync": [ReferenceSync],  # null by default
        "model.optimizer": [torch.optim.AdamW],
        "model.lr_scheduler": [torch.optim.lr_scheduler.LinearLR, torch.optim.lr_scheduler.CosineAnnealingLR],
    }


def class_fields(cls: type) -> list[str]:
    """The settings a class takes: a dataclass's fields, else its ``__init__``'s named parameters."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def unknown_key(message: str) -> str | None:
    """The dotted key a parser error says it does not know (``model.beta``), None for another error."""
    for pattern in UNKNOWN:
        if found := pattern.search(message):
            return ".".join(found.groups())
    return None


def every_option(parser_options: list[str]) -> list[str]:
    """``parser_options`` (``--model.generation.top_p``, ...) and the parameters of the classes a setting names; not
    the ``help`` of each class setting nor the ``+`` (append) form of list settings."""
    nested = [
        f"--{setting}.{name}"
        for setting, classes in class_settings().items()
        for cls in classes
        for name in class_fields(cls)
    ]
    return [
        option
        for option in dict.fromkeys([*parser_options, *nested])
        if leaf(option) != "help" and not option.endswith("+")
    ]


def leaf(option: str) -> str:
    """``top_p`` of ``--model.generation.top_p``."""
    return option.rpartition(".")[2].lstrip("-")


def unknown_option_hint(message: str, parser_options: list[str]) -> str:
    """Lines to add to an error about an unknown option or YAML key (``parser_options``: the parser's own): where
    TRL, vLLM or transformers have that name, the other options of the same name, or the close spellings; "" for
    another error."""
    key = unknown_key(message)
    if key is None:
        return ""
    options = every_option(parser_options)
    same = [
        option for option in options if leaf(option) == leaf(key) and option not in (foreign_option(key), f"--{key}")
    ]
    hint = f"\n  {foreign}" if (foreign := foreign_hint(key)) else ""
    if same:
        hint += f"\n  {' and '.join(same)} {'has' if len(same) == 1 else 'have'} that name{' too' if hint else ''}"
    if not hint:
        close = difflib.get_close_matches(f"--{key}", options, n=3)
        hint = f"\n  Did you mean: {', '.join(close)}?" if close else ""
    return hint
