"""The keyword a transformers model's forward takes its KV cache by.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name is deprecated, warns at every call that
passes it, even as None, and goes in 5.40); the versions before take ``past_key_values`` only. Passing the name the
model's own forward declares works on both sides of the rename and warns on neither.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn


def cache_kwargs(model: nn.Module, cache) -> dict:
    """``{keyword: cache}`` for ``model``'s forward; nothing when ``cache`` is None (the model makes its own, or none)."""
    return {} if cache is None else {cache_keyword(model): cache}


def cache_keyword(model: nn.Module) -> str:
    """``cache`` where ``model``'s forward declares it (transformers ≥ 5.24), else ``past_key_values``. A wrapper
    whose forward passes keyword arguments through (PEFT, DDP) is looked through to the model it wraps."""
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return _declared_keyword(type(model))


@torch.compiler.assume_constant_result  # a compiled decoding step reads it once, as a constant
def _declared_keyword(cls: type) -> str:
    # Of the class, not the module: torch 2.11's compiler takes only constants as the arguments of such a function
    # (a module is not one: `AsPythonConstantNotImplementedError`), torch 2.13's a module too.
    return _declared_keyword_of(cls)


@functools.cache
def _declared_keyword_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
