"""Padding-free packing (``token_logprobs(..., pack=True)``): the rows as one sequence give the padded forward's
log-probs, entropies and gradients."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gspo.rl.engines import LeanSampler
from lit_gspo.rl.rollout import token_logprobs

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]  # different lengths: left padding


def tiny_qwen3():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=23,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
    ).eval()


@pytest.fixture(params=["llama", "qwen3"])
def policy(request, model):
    return copy.deepcopy(model) if request.param == "llama" else tiny_qwen3()


def rollout(policy):
    torch.manual_seed(0)
    batch = LeanSampler().sample(policy, PROMPTS, num_generations=3, max_new_tokens=8, pad_id=PAD, eos_id=EOS)
    assert batch.attention_mask[:, : batch.prompt_length].eq(0).any()  # some prompt is padded
    assert batch.completion_mask.sum(1).unique().numel() > 1  # completions of different lengths
    return batch


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_logprobs_and_entropy_are_the_padded_ones(policy, impl):
    policy.set_attn_implementation(impl)
    batch = rollout(policy)
    mask = batch.completion_mask
    with torch.no_grad():
        padded = token_logprobs(policy, batch, with_entropy=True, temperature=0.7)
        packed = token_logprobs(policy, batch, with_entropy=True, temperature=0.7, pack=True)
    assert packed.logprobs.shape == padded.logprobs.shape
    torch.testing.assert_close(packed.logprobs[mask], padded.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.entropy[mask], padded.entropy[mask], atol=1e-5, rtol=0)


def test_packed_gradients_are_the_padded_ones(policy):
    batch = rollout(policy)
    mask = batch.completion_mask
    grads = []
    for pack in (False, True):
        policy.zero_grad()
        logp = token_logprobs(policy, batch, pack=pack).logprobs
        (logp * mask).sum().div(mask.sum()).backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
    for padded, packed in zip(*grads):
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-4)


def test_packing_drops_the_padding_from_the_backbone(policy):
    """What it saves: the backbone sees the real tokens only."""
    batch = rollout(policy)
    seen = []
    handle = policy.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    with torch.no_grad():
        token_logprobs(policy, batch, pack=True)
    handle.remove()
    assert seen == [int(batch.attention_mask.sum())] and seen[0] < batch.input_ids.numel()
