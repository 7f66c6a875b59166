"""Small model helpers the trainer needs: parameter counts, gradient checkpointing, freezing."""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

from torch import nn


class ParameterCount(NamedTuple):
    """Total and trainable parameter counts (shared/tied tensors counted once)."""

    total: int
    trainable: int


def count_parameters(model: nn.Module) -> ParameterCount:
    """Count ``model``'s parameters: ``ParameterCount(total, trainable)``."""
    params = list(model.parameters())  # nn.Module.parameters() already de-duplicates tied weights
    return ParameterCount(
        total=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad)
    )


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Turn on non-reentrant gradient checkpointing (no ``enable_input_require_grads`` needed for LoRA).

    Works for plain and LoRA (peft) models. transformers turns the KV cache off in train mode while
    checkpointing, so put the model in ``eval()`` mode to generate. Raises ``ValueError`` for models that do not support checkpointing.
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(target).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5 (old name deprecated)
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def eval_mode(*modules: nn.Module | None):
    """Every submodule of ``modules`` in eval mode (no dropout, no router noise), each one's own flag restored on exit.

    An RL update computes the log-probs of the policy that sampled, which samples in eval mode: with dropout drawn
    in the update, the ratio of an unchanged policy would be noise around 1 (GSPO clips at 1 ± 4e-4), whatever mode
    the policy was left in (a callback's ``policy.train()``, say).
    """
    return module_mode(*modules, training=False)


def module_mode(*modules: nn.Module | None, training: bool):
    """Every submodule of ``modules`` in train (``training``) or eval mode, each one's own flag restored on exit."""
    return training_flags([m for module in modules if module is not None for m in module.modules()], training)


def checkpointing_active(model: nn.Module):
    """Let gradient checkpointing run while the model stays in eval mode.

    transformers checkpoints a layer only when that layer's ``training`` flag is set, and a policy
    loaded by ``from_pretrained`` is in eval mode (Lightning keeps submodules' modes). This sets the
    flag on the checkpointed layers alone, not on their submodules, so dropout stays off; restored on exit.
    """
    return checkpointed_layers_training(model, True)


def checkpointing_paused(model: nn.Module):
    """The checkpointed layers run plainly, keeping every activation (their ``training`` flag off); restored on exit."""
    return checkpointed_layers_training(model, False)


def checkpointed_layers_training(model: nn.Module, flag: bool):
    """The ``training`` flag of the layers with gradient checkpointing set to ``flag``, restored on exit."""
    return training_flags([m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True], flag)


@contextmanager
def training_flags(modules: list[nn.Module], flag: bool):
    """Each of ``modules``' own ``training`` flag (not its submodules') set to ``flag``, restored on exit."""
    before = [m.training for m in modules]
    for m in modules:
        m.training = flag
    try:
        yield
    finally:
        for m, was in zip(modules, before):
            m.training = was


def freeze(model: nn.Module) -> nn.Module:
    """Set ``requires_grad=False`` on every parameter and put the model in eval mode (e.g. a reference policy)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
