"""A checkpoint's sampling settings (its ``generation_config.json``) are never applied: every engine samples π with
``model.generation``'s temperature, top-p and top-k only.

transformers' ``generate`` fills each setting a call leaves unset from ``model.generation_config``: a Qwen2.5-Instruct
checkpoint's ``repetition_penalty`` 1.05, a ``no_repeat_ngram_size``, a ``min_new_tokens`` (which forbids the eos),
a ``min_p``. HFGenerate would then sample another distribution than the update's log-probs and the other engines
(LeanSampler and StaticCacheSampler never read it, VLLMEngine builds vLLM with ``generation_config="vllm"``), and
record log-probs of a distribution it did not sample from. So HFGenerate generates under an empty config.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from transformers import GenerationConfig

#: what a generation config holds besides sampling settings
_NOT_SAMPLING = {
    *("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"),
    *("transformers_version", "use_cache"),
}


def generating_model(policy: nn.Module) -> nn.Module:
    """The transformers model whose ``generation_config`` ``policy.generate`` reads (a PEFT model's base model)."""
    get_base_model = getattr(policy, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else policy


@contextmanager
def empty_generation_config(policy: nn.Module) -> Iterator[None]:
    """While ``policy.generate`` runs, the model's ``generation_config`` is an empty one (restored after, always)."""
    model = generating_model(policy)
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def checkpoint_sampling_settings(policy: nn.Module) -> dict:
    """The sampling settings the model's ``generation_config`` sets (e.g. ``{"repetition_penalty": 1.05}``), which
    no engine applies: for the run's log."""
    config = getattr(generating_model(policy), "generation_config", None)
    if config is None:
        return {}
    settings = config.to_diff_dict().items()
    return {k: v for k, v in settings if k not in _NOT_SAMPLING and not k.startswith("_") and v is not False}
