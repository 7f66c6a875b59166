"""Tiny randomly initialised models built from ``transformers`` configs (no download).

They are small enough to train on CPU in tests and quickstarts: a dense Llama and a Qwen3-MoE
(8 experts, top-2) for Routing Replay. Special-token ids default to the char tokenizer's.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen3MoeConfig

from .tokenizer import char_vocab

_VOCAB = char_vocab()
_SPECIAL_IDS = {"pad_token_id": _VOCAB["<pad>"], "bos_token_id": _VOCAB["<bos>"], "eos_token_id": _VOCAB["<eos>"]}


def tiny_llama_config(
    vocab_size: int = len(_VOCAB),
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    pad_token_id: int = _SPECIAL_IDS["pad_token_id"],
    bos_token_id: int = _SPECIAL_IDS["bos_token_id"],
    eos_token_id: int = _SPECIAL_IDS["eos_token_id"],
    tie_word_embeddings: bool = True,
    **kwargs: Any,
) -> LlamaConfig:
    """A small dense ``LlamaConfig`` (≈0.1M parameters with the char vocabulary); extra kwargs go to the config."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **kwargs,
    )


def tiny_qwen3_moe_config(
    vocab_size: int = len(_VOCAB),
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    moe_intermediate_size: int = 32,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    norm_topk_prob: bool = True,
    max_position_embeddings: int = 256,
    pad_token_id: int = _SPECIAL_IDS["pad_token_id"],
    bos_token_id: int = _SPECIAL_IDS["bos_token_id"],
    eos_token_id: int = _SPECIAL_IDS["eos_token_id"],
    tie_word_embeddings: bool = True,
    **kwargs: Any,
) -> Qwen3MoeConfig:
    """A small ``Qwen3MoeConfig``: every layer sparse, 8 experts, top-2, ``output_router_logits=False``."""
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok={num_experts_per_tok} must be between 1 and num_experts={num_experts}")
    kwargs.setdefault("output_router_logits", False)
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **kwargs,
    )


def build_from_config(config, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Instantiate a causal LM from ``config`` with random weights drawn under ``torch.manual_seed(seed)``.

    The global RNG state is restored afterwards, so building a model does not perturb the caller's seeds.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model
