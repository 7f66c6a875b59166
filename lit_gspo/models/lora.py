"""LoRA through peft: wrap a policy, take the reference policy from the same weights, save merged.

Under LoRA the frozen base weights *are* the reference policy, so no second model is kept:
``with reference_mode(model): ref_logits = model(...)`` runs the base model with adapters off.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

from torch import nn
from transformers import PreTrainedModel

from lit_gspo.runtime.extras import require


def _require_peft():
    return require("peft", "LoRA")


def apply_lora(
    model: PreTrainedModel,
    r: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
    dropout: float = 0.0,
):
    """Wrap ``model`` in a peft ``PeftModel`` with LoRA adapters; only adapter parameters stay trainable.

    ``target_modules`` are module-name suffixes (or ``"all-linear"``). Returns the ``PeftModel``,
    which forwards and generates like the original model.
    """
    peft = _require_peft()
    if r <= 0:
        raise ValueError(f"LoRA rank r={r} must be a positive integer")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout={dropout} must be in [0, 1)")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM"
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"LoRA target_modules={targets!r} not found in the model; linear modules are {names}") from err


def is_lora(model: nn.Module) -> bool:
    """True when ``model`` carries peft adapters (a ``PeftModel`` or a model with injected adapters)."""
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel) or bool(getattr(model, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def reference_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with its LoRA adapters disabled (the base = reference policy); re-enabled on exit.

    Raises ``TypeError`` for a model without adapters (keep a separate frozen reference copy then).
    """
    peft = _require_peft()
    if isinstance(model, peft.PeftModel):
        with model.disable_adapter():
            yield model
    elif getattr(model, "_hf_peft_config_loaded", False):
        model.disable_adapters()
        try:
            yield model
        finally:
            model.enable_adapters()
    else:
        raise TypeError(f"reference_mode needs a LoRA model (see apply_lora), got {type(model).__name__}")


def merged_for_saving(model: nn.Module) -> PreTrainedModel:
    """Return a plain ``PreTrainedModel`` with the adapters merged into a *copy* of the weights.

    The training model is left untouched (adapters stay separate and trainable). A model without
    adapters is returned as is. Save the result with ``save_pretrained``.
    """
    peft = _require_peft()
    if isinstance(model, peft.PeftModel):
        merged = copy.deepcopy(model).merge_and_unload()
        merged.train(model.training)
        return merged
    if getattr(model, "_hf_peft_config_loaded", False):
        raise TypeError("merge adapters injected with model.add_adapter by wrapping with peft instead (apply_lora)")
    return model
