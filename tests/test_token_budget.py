"""``micro_batch_tokens: auto``: the update's micro-batches sized from the GPU memory free at the time."""

import torch
from transformers import Qwen3Config

from lit_gspo.runtime.token_budget import MIN_TOKENS, activation_bytes_per_token, token_budget

QWEN3_06B = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28)


def test_bytes_per_token_of_qwen3_06b_by_hand():
    assert activation_bytes_per_token(QWEN3_06B, 2) == 28 * (8 * 1024 + 4 * 3072) * 2  # 1,146,880: ~1.1 MB a token
    # checkpointing keeps each block's input, and one block's activations while it is recomputed
    assert activation_bytes_per_token(QWEN3_06B, 2, checkpointing=True) == 28 * 1024 * 2 + (8 * 1024 + 4 * 3072) * 2


def test_the_budget_is_half_the_free_memory_over_the_bytes_of_a_token(monkeypatch):
    free = 40 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    assert token_budget(QWEN3_06B, "cuda", torch.bfloat16) == free // 2 // 1146880  # 18,724 tokens
    assert token_budget(QWEN3_06B, "cuda", torch.float32) == free // 2 // (2 * 1146880)  # fp32 keeps twice the bytes
    # 32 prompts × 8 × (32 + 256) tokens in one update (the shape that ran out of 80 GB) is 4 micro-batches here
    assert -(-32 * 8 * 288 // token_budget(QWEN3_06B, "cuda", torch.bfloat16)) == 4


def test_no_budget_on_the_cpu_and_a_floor_when_the_gpu_is_full(monkeypatch):
    assert token_budget(QWEN3_06B, "cpu", torch.float32) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    assert token_budget(QWEN3_06B, "cuda", torch.bfloat16) == MIN_TOKENS
