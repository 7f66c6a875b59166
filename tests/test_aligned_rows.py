"""Rows aligned to their front (``token_logprobs(..., align=True)``, ``update.align_rows``): each row's tokens first,
its padding after, no attention mask. The log-probs, entropies and gradients are the padded forward's; what it saves is
transformers' per-query-head copy of the keys and values under a padding mask, kept for backward."""

import copy

import pytest
import torch
from test_packing import rollout, tiny_qwen3

from lit_gspo.rl.rollout import RolloutBatch, completion_states_aligned, token_logprobs


@pytest.fixture(params=["llama", "qwen3"])
def policy(request, model):
    return copy.deepcopy(model) if request.param == "llama" else tiny_qwen3()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_aligned_logprobs_entropy_and_gradients_are_the_padded_ones(policy, impl):
    policy.set_attn_implementation(impl)
    batch = rollout(policy)
    mask = batch.completion_mask
    outputs = []
    for align in (False, True):
        policy.zero_grad()
        out = token_logprobs(policy, batch, with_entropy=True, temperature=0.7, align=align)
        (out.logprobs * mask).sum().div(mask.sum()).backward()
        outputs.append((out, [p.grad.clone() for p in policy.parameters()]))
    (padded, padded_grads), (aligned, aligned_grads) = outputs
    assert aligned.logprobs.shape == padded.logprobs.shape
    torch.testing.assert_close(aligned.logprobs[mask], padded.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(aligned.entropy[mask], padded.entropy[mask], atol=1e-5, rtol=0)
    for a, b in zip(aligned_grads, padded_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_backbone_runs_each_row_from_its_first_token_without_a_mask(policy):
    batch = rollout(policy)
    seen = []
    handle = policy.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"], kwargs["attention_mask"])), with_kwargs=True
    )
    with torch.no_grad():
        token_logprobs(policy, batch, align=True)
    handle.remove()
    ((ids, mask),) = seen
    assert mask is None
    lengths = batch.attention_mask.sum(1)
    for row, length in enumerate(lengths.tolist()):
        real = batch.input_ids[row][batch.attention_mask[row].bool()]
        assert torch.equal(ids[row, :length], real)  # its tokens first, in order


def test_a_row_with_a_hole_in_its_mask_runs_padded():
    """A masked token between real ones (not a layout the samplers make) cannot be hidden by causal attention alone."""
    policy = tiny_qwen3()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 4, 5, 6, 7, 8]])
    attention = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    batch = RolloutBatch(ids, attention, 3, torch.ones(2, 3, dtype=torch.bool))
    assert completion_states_aligned(policy, batch) is None
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(policy, batch, align=True).logprobs, token_logprobs(policy, batch).logprobs, atol=0, rtol=0
        )


def test_without_a_mask_sdpa_gets_the_key_value_heads_as_they_are(monkeypatch):
    """Qwen3's 4 query heads read 2 key-value heads. Under a padding mask transformers repeats the keys and values to 4
    heads before sdpa (which keeps those copies for backward); aligned rows reach sdpa with no mask, the 2 key-value
    heads and ``enable_gqa``, which CUDA's flash kernel reads natively (the CPU's kernels repeat them inside)."""
    policy = tiny_qwen3()
    policy.set_attn_implementation("sdpa")
    batch = rollout(policy)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def seen(query, key, value, attn_mask=None, **kwargs):
        calls.append((key.shape[1], attn_mask is None, kwargs.get("enable_gqa", False), kwargs.get("is_causal")))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", seen)
    layers = policy.config.num_hidden_layers
    with torch.no_grad():
        token_logprobs(policy, batch)
        assert calls == [(4, False, False, False)] * layers  # repeated to the query heads, masked
        calls.clear()
        token_logprobs(policy, batch, align=True)
        assert calls == [(2, True, True, True)] * layers


def test_auto_aligns_on_a_gpu_in_16_bits_only_and_never_under_routing_records_or_the_router_loss():
    """In fp32 CUDA's sdpa takes grouped key-value heads only in its math kernel (every (L, L) score held): padded."""
    from types import SimpleNamespace

    from lit_gspo.models.cast_parameters import CastParameters
    from lit_gspo.rl.config import Update
    from lit_gspo.rl.learn.learner import Learner

    def aligns(setting, device, dtype=torch.bfloat16, records_routing=False, router_aux_coef=0.0):
        fake = SimpleNamespace(
            cfg=Update(align_rows=setting),
            device=torch.device(device),
            records_routing=records_routing,
            router_aux_coef=router_aux_coef,
        )
        fake.compute_dtype = dtype
        return Learner.aligns.fget(fake)

    assert (
        aligns("auto", "meta") and aligns("auto", "meta", torch.float16) and not aligns("auto", "meta", torch.float32)
    )
    assert not aligns("auto", "cpu") and aligns(True, "cpu", torch.float32) and not aligns(False, "meta")
    assert not aligns(True, "meta", records_routing=True)  # MoE routing records hold padded positions
    assert not aligns(True, "meta", router_aux_coef=0.01)  # the router loss needs the padding mask
    learner = SimpleNamespace(device=torch.device("cpu"), policy=tiny_qwen3(), cast_parameters=None)
    assert Learner.compute_dtype.fget(learner) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Learner.compute_dtype.fget(learner) == torch.bfloat16
    learner.cast_parameters = CastParameters(torch.bfloat16)  # update.param_dtype: bf16, without autocast too
    assert Learner.compute_dtype.fget(learner) == torch.bfloat16
    with pytest.raises(ValueError, match="align_rows must be true, false or 'auto', got 'yes'"):
        Update(align_rows="yes")
