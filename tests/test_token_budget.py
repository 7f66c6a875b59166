"""``micro_batch_tokens: auto``: the update's micro-batches sized from the GPU memory free at the time, over the bytes
a token's activations take, measured by the backbone's own forward."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gspo.models.utils import enable_gradient_checkpointing
from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.objectives import GSPO
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.runtime.token_budget import (
    MIN_TOKENS,
    SavedStorages,
    checkpointed_bytes_per_token,
    saved_bytes_per_token,
    token_budget,
)

ROOT = Path(__file__).resolve().parents[1]


def qwen3_06b_layers(layers: int) -> Qwen3ForCausalLM:
    """Qwen3-0.6B's layer shape (``benchmarks/shapes``), ``layers`` of its 28, a vocabulary of 4,096 (the LM head's
    memory is bounded apart), random weights."""
    config = json.loads((ROOT / "benchmarks/shapes/qwen3-0.6b.config.json").read_text())
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers], vocab_size=4096)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**config))


def saved_by(forward) -> int:
    counter = SavedStorages()
    with counter.counting():
        out = forward()  # noqa: F841 (holds the graph while counted)
    return counter.bytes


@pytest.mark.parametrize("param_dtype", [None, "bf16"], ids=["autocast", "bf16-casts"])
@pytest.mark.parametrize("align", [True, False], ids=["aligned", "padded"])
def test_the_measured_cost_of_a_token_predicts_what_a_micro_batch_keeps(align, param_dtype):
    """Measured on one row at two lengths, the cost of a token predicts the bytes autograd keeps for a micro-batch of
    another shape (4 rows × 160 tokens of Qwen3-0.6B's layers under bf16 autocast, its LM head in chunks as a large
    micro-batch's, lean norms and activations as the update runs them) within 3 %; the config's count, (8·hidden +
    4·intermediate) values a layer, was half of what plain modules keep."""
    policy = qwen3_06b_layers(2)
    learner = Learner(policy, GSPO(), Update(align_rows=align, param_dtype=param_dtype))
    ids = torch.arange(4 * 160).reshape(4, 160) * 31 % policy.config.vocab_size
    attention = torch.ones_like(ids)
    attention[1:, :3] = 0  # prompts of 8, 5, 5, 5 tokens
    batch = RolloutBatch(ids, attention, 8, torch.ones(4, 152, dtype=torch.bool))
    rng = torch.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), learner.cast(policy), learner.lean():
        per_token = learner.activation_bytes_per_token()
        one_row = saved_by(lambda: learner.probe_forward(64))
        kept = saved_by(lambda: learner.completion_logprobs(policy, batch, max_chunk_elements=2**20).logprobs)
    assert torch.equal(torch.get_rng_state(), rng)  # the measuring forward draws nothing
    predicted = one_row + per_token * (ids.numel() - 64)
    assert predicted == pytest.approx(kept, rel=0.03)
    plain = Learner(policy, GSPO(), Update(align_rows=align, param_dtype=param_dtype, lean_activations=False))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        plain_per_token = plain.activation_bytes_per_token()
    config_count = 2 * (8 * 1024 + 4 * 3072) * 2
    assert plain_per_token > 1.5 * config_count and per_token < plain_per_token


@pytest.mark.parametrize("param_dtype", [None, "bf16"], ids=["autocast", "bf16-casts"])
def test_under_gradient_checkpointing_a_token_costs_each_blocks_input_and_one_blocks_activations(param_dtype):
    """A block's input is the residual stream: fp32 under autocast on fp32 parameters, bf16 on the casts."""
    policy = qwen3_06b_layers(2)
    enable_gradient_checkpointing(policy)
    plain = Learner(qwen3_06b_layers(2), GSPO(), Update(param_dtype=param_dtype))
    learner = Learner(policy, GSPO(), Update(param_dtype=param_dtype), gradient_checkpointing=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        full, checkpointed = plain.activation_bytes_per_token(), learner.activation_bytes_per_token()
    stream_bytes = 4 if param_dtype is None else 2
    assert checkpointed == 2 * 1024 * stream_bytes + -(-full // 2)
    assert checkpointed_bytes_per_token(policy.config, 1000, 2) == 2 * 1024 * 2 + 500


def test_the_budget_is_half_the_free_memory_over_the_bytes_of_a_token(monkeypatch):
    free = 40 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    assert token_budget(2_000_000, "cuda") == free // 2 // 2_000_000  # 10,737 tokens
    assert token_budget(2_000_000, "cpu") is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    assert token_budget(2_000_000, "cuda") == MIN_TOKENS


def test_a_linear_cost_is_measured_exactly():
    """A forward that keeps 3 fp32 values a token and a fixed 1 KB: 12 bytes a token."""
    weight = torch.ones(256, requires_grad=True)

    def forward(length):
        x = torch.ones(length, 3, requires_grad=True)
        return (x * x).sum() + (weight * weight).sum()

    assert saved_bytes_per_token(forward) == 12


def test_under_fsdp2_the_measuring_forward_enters_at_the_root_and_the_update_runs_after_it():
    """FSDP2 gathers the root's own parameters (embeddings, LM head) in the root's forward only: the measuring forward is
    a micro-batch's (through the root), with grad and without backward, and the update after it runs as before."""
    from test_learner import plain_and_sharded_updates

    def measure(plain, sharded):
        measured, unsharded = sharded.activation_bytes_per_token(), plain.activation_bytes_per_token()
        assert unsharded <= measured <= 1.1 * unsharded  # (FSDP2's hooks keep a little more at each layer's edge)

    plain, sharded = plain_and_sharded_updates(Update(), between=measure)
    for (name, a), b in zip(plain.policy.named_parameters(), sharded.policy.parameters()):
        torch.testing.assert_close(b.full_tensor(), a, rtol=0, atol=1e-6, msg=name)
