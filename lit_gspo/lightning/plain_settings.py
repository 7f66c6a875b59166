"""An RLModule's settings as plain data in its hyperparameters, and back.

LightningCLI hands a module its parsed config (dicts, lists, numbers, text), and that is what Lightning saves as the
module's hyperparameters. A module built in Python saves its init arguments as they are: ``Policy``, ``Update``,
``Generation`` and ``Validation`` objects, which ``torch.load(weights_only=True)`` refuses, the way Lightning (and
lit_gspo) read checkpoints, so ``trainer.fit(ckpt_path=...)`` and ``RLModule.load_from_checkpoint`` could not read
what the run wrote. :func:`plain` writes them as the CLI's config writes them; :func:`from_plain` reads such data back
with jsonargparse, the CLI's parser, so ``RLModule(policy={...})`` builds the module that saved it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

from jsonargparse import ArgumentParser

PLAIN = (bool, int, float, str, type(None))


def plain(value: Any) -> Any:
    """``value`` as a config writes it: a dataclass as a dict of its fields, another object as ``class_path`` and
    ``init_args`` (read back from its attributes of the same names), lists and dicts element by element."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    cls = type(value)
    names = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    missing = [name for name in names if not hasattr(value, name)]
    if missing:
        raise TypeError(
            f"{cls.__qualname__} keeps no attribute {missing[0]!r} for its argument of that name, so a config cannot "
            "say how to build it again"
        )
    return {
        "class_path": f"{cls.__module__}.{cls.__qualname__}",
        "init_args": {n: plain(getattr(value, n)) for n in names},
    }


def is_plain(value: Any) -> bool:
    """Whether ``value`` is data a config holds (what ``torch.load(weights_only=True)`` reads)."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def from_plain(cls: type, value: Any, setting: str) -> Any:
    """A ``cls`` from the dict :func:`plain` (or a config) wrote for it; anything else as it is. ``setting`` names
    it in errors."""
    if not isinstance(value, dict):
        return value
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=cls)
    try:
        config = parser.parse_object({"value": copy.deepcopy(value)})  # jsonargparse rewrites what it is given
    except Exception as error:  # noqa: BLE001 - jsonargparse reports a bad config with several types
        raise ValueError(f"{setting}: not the settings of a {cls.__name__}: {error}") from None
    return parser.instantiate(config).value
