"""What a causal LM's forward does to its LM head's output, so that lit_gspo's own head (``lm_head.py``, which never
materialises the whole (rows, T, vocab) logits) gives the log-probs the model samples from:

    z = c · tanh(s · (h Wᵀ + b) / c)        (no soft cap: z = s · (h Wᵀ + b))

Read from the model's (text) config, by architecture:

- soft cap c: ``final_logit_softcapping`` (Gemma 2, 3, 3n, 4, VaultGemma, nanochat), ``logits_soft_cap``
  (RecurrentGemma);
- scale s: ``logit_scale`` (Cohere, Cohere 2), 1 / ``logits_scaling`` (Granite and Granite MoE), ``logits_scaling``
  (HyperCLOVA X: the same name, the other way round), ``lm_head_multiplier`` (Falcon-H1), 1 / ``logits_scaling``
  (MiniCPM3: it divides the states before a head without bias, the same logits).

Any other architecture's forward is taken to return h Wᵀ + b. The config says what a forward may do, not what it does:
Gemma 3's vision + text forward ignores its text config's soft cap, Gemma 3n's applies it. So the load check
(``forward_checks.check_policy_forward``) tries the config's map, then the identity, against the model's own logits and
keeps on the model (``VERIFIED``) the one that reproduces them; none: the model is refused by name at the start instead
of training on log-probs other than the ones it samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn


class LogitMap(NamedTuple):
    """z = c · tanh(s · z₀ / c) of the head's output z₀ (``softcap`` c None: z = s · z₀)."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = (logits / self.softcap).tanh() * self.softcap
        return logits


#: model_type → the scale s its forward multiplies the head's output by
SCALES: dict[str, Callable[[object], float]] = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), lambda c: c.logit_scale),
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"),
        lambda c: 1.0 / c.logits_scaling,
    ),
    "hyperclovax": lambda c: c.logits_scaling,
    "falcon_h1": lambda c: c.lm_head_multiplier,
    "minicpm3": lambda c: 1.0 / c.logits_scaling,
}


#: the attribute the load check sets on a model: the map it found to reproduce the model's own logits
VERIFIED = "lit_gspo_logit_map"


def logit_map(model: nn.Module) -> LogitMap:
    """The :class:`LogitMap` of ``model``'s forward: the one the load check verified on it, else its config's."""
    verified = getattr(model, VERIFIED, None)
    return verified if verified is not None else config_logit_map(model)


def config_logit_map(model: nn.Module) -> LogitMap:
    """The :class:`LogitMap` ``model``'s (text) config names (identity for a model without a config, or one whose
    config names none)."""
    config = getattr(model, "config", None)
    if config is None:
        return LogitMap()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = SCALES.get(getattr(text, "model_type", None), lambda c: 1.0)(text)
    softcap = getattr(text, "final_logit_softcapping", None) or getattr(text, "logits_soft_cap", None)
    return LogitMap(float(scale), float(softcap) if softcap else None)
