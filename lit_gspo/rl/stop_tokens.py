"""Where a reply ends: every token that ends one, not only the tokenizer's eos.

Instruct models close an assistant turn with a token their tokenizer need not call eos: Gemma's ``<end_of_turn>``
(eos ``<eos>``), Llama 3's ``<|eot_id|>``, Phi-3's ``<|end|>``; Qwen3 also stops at ``<|endoftext|>``. Their
``generation_config.eos_token_id`` lists them (transformers' ``generate`` and vLLM stop at each), and the chat
template writes the turn's closing token after every reply. A sampler that stops at the tokenizer's eos alone runs
past the turn's end into an invented next turn, which the reward then scores and the update trains on.

    stop ids = [the chat template's turn-closing token (prompts rendered through it)]
               ∪ [tokenizer.eos_token_id] ∪ generation_config.eos_token_id       (in this order, each once)

The first is the one a demonstration ends with (the warm start); a reply ends at the first of any.
"""

from __future__ import annotations

import warnings

from torch import nn

from lit_gspo.rl.envs.base import assistant_closing


def stop_token_ids(
    tokenizer, model: nn.Module | None = None, *, chat_template: bool = False, template_kwargs: dict | None = None
) -> list[int]:
    """The ids a reply ends at: the template's turn closing (with ``chat_template``, rendered with
    ``template_kwargs``), the tokenizer's eos and the model's ``generation_config.eos_token_id`` (an int or a list)."""
    found = [turn_closing_token(tokenizer, template_kwargs) if chat_template else None, tokenizer.eos_token_id]
    config = getattr(model, "generation_config", None)
    declared = getattr(config, "eos_token_id", None)
    found += declared if isinstance(declared, (list, tuple)) else [declared]
    return list(dict.fromkeys(int(i) for i in found if i is not None))


def environment_stop_ids(tokenizer, environment, model: nn.Module | None = None) -> list[int]:
    """:func:`stop_token_ids` for prompts rendered as ``environment`` renders them (its chat template use, its
    ``chat_template_kwargs``)."""
    return stop_token_ids(
        tokenizer,
        model,
        chat_template=environment.uses_chat_template(tokenizer),
        template_kwargs=environment.chat_template_kwargs,
    )


def turn_closing_token(tokenizer, template_kwargs: dict | None = None) -> int | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>``, ``<end_of_turn>``), or
    None where its closing starts with text (``\\n\\n``) or nothing."""
    try:
        closing = assistant_closing(tokenizer, template_kwargs=template_kwargs)
    except Exception as error:  # noqa: BLE001 — a template may refuse a conversation (a raise_exception of its own)
        warnings.warn(
            f"the tokenizer's chat template cannot render a user turn and an assistant reply ({type(error).__name__}: "
            f"{error}); replies end at the tokenizer's eos and the model's generation_config eos ids only",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    ids = tokenizer(closing, add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    added = tokenizer.added_tokens_decoder.get(ids[0])
    special = (added is not None and added.special) or ids[0] in tokenizer.all_special_ids
    return ids[0] if special else None


def describe_stop_tokens(tokenizer, stop_ids: list[int]) -> str:
    """``<end_of_turn> (106), <eos> (1)``: for the run's log."""
    return ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})" for i in stop_ids) or "none"
