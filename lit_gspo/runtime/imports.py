"""The object behind a dotted import path (``"lit_gspo.rl.envs.calculator.calculator"``), for settings given as text."""

from __future__ import annotations

import importlib


def import_path(path: str):
    """``getattr(import_module(module), name)`` for ``path = "module.name"``; ImportError/AttributeError as Python raises them."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ImportError(f"{path!r} is not a dotted import path (module.name)")
    return getattr(importlib.import_module(module), name)
