"""The LM head: fp32 log-probs without the (B, c, V) log-softmax, and its bf16x3 matmul (CUDA under bf16 autocast).

The bf16x3 matmul's numbers are checked here on the CPU, where ``matmul_fp32_out`` computes what CUDA's bf16 GEMM
with fp32 output does (a product of two bf16 values is exact in fp32); that the CUDA kernel runs is ``test_cuda``'s.
"""

import pytest
import torch

from lit_gspo.rl import lm_head
from lit_gspo.rl.lm_head import (
    HeadWeights,
    bf16_parts,
    head_logits,
    head_precision,
    target_logprobs_and_entropy,
)
from lit_gspo.rl.rollout import token_logprobs


def a_trained_looking_head(vocab=512, hidden=128, seed=0):
    """Hidden states and a head whose logits spread over ~±20, as a trained LM's do (a random init's stay near 0)."""
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(3, 5, hidden, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.6
    targets = torch.randint(vocab, (3, 5), generator=g)
    return hidden_states, weight, targets


def logprob_error(logits, hidden64, weight64, targets) -> float:
    exact = (hidden64 @ weight64.T).log_softmax(-1).gather(-1, targets[..., None])
    ours = logits.log_softmax(-1).gather(-1, targets[..., None]).double()
    return float((ours - exact).abs().max())


def test_bf16_parts_add_up_to_the_value_within_2_to_the_minus_16():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 10
    hi, lo = bf16_parts(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert ((hi.float() + lo.float() - x).abs() <= x.abs() * 2**-16).all()
    assert bf16_parts(hi) == (hi, None)  # already bf16: its own high part


def test_bf16x3_logprobs_are_fp32_class_where_one_bf16_gemm_is_not():
    hidden64, weight64, targets = a_trained_looking_head()
    hidden, weight = hidden64.float(), weight64.float()
    fp32 = head_logits(hidden, HeadWeights(weight))
    split = head_logits(hidden, HeadWeights(weight, None, *bf16_parts(weight)))
    one_bf16_gemm = lm_head.matmul_fp32_out(hidden.reshape(-1, 128).bfloat16(), weight.bfloat16().T).reshape(3, 5, -1)
    assert split.dtype == torch.float32
    errors = {
        name: logprob_error(z, hidden64, weight64, targets)
        for name, z in (("fp32", fp32), ("bf16x3", split), ("bf16", one_bf16_gemm))
    }
    assert errors["fp32"] < 2e-5 and errors["bf16x3"] < 1e-4, errors  # logits over ±20: fp32's own rounding ~1e-5
    assert errors["bf16"] > 100 * errors["bf16x3"], errors  # the low parts are what makes it fp32-class


def test_bf16x3_gradients_are_the_fp32_heads_at_bf16_precision():
    hidden64, weight64, targets = a_trained_looking_head()
    grads = {}
    for name in ("fp32", "bf16x3"):
        hidden = hidden64.float().requires_grad_()
        weight = weight64.float().requires_grad_()
        head = HeadWeights(weight) if name == "fp32" else HeadWeights(weight, None, *bf16_parts(weight.detach()))
        logp, _ = target_logprobs_and_entropy(head_logits(hidden, head, temperature=0.7), targets)
        logp.sum().backward()
        grads[name] = (hidden.grad, weight.grad)
    for fp32, split in zip(grads["fp32"], grads["bf16x3"]):
        assert split.dtype == torch.float32
        assert float((split - fp32).norm() / fp32.norm()) < 1e-2  # bf16 inputs to each backward GEMM
        assert float(torch.nn.functional.cosine_similarity(split.flatten(), fp32.flatten(), dim=0)) > 0.9999


def test_with_bf16_weights_and_states_bf16x3_is_one_gemm_with_the_fp32_gemms_numbers():
    hidden64, weight64, _ = a_trained_looking_head()
    hidden, weight = hidden64.bfloat16(), weight64.bfloat16()  # bf16-true: no low parts
    split = HeadWeights(weight, None, *bf16_parts(weight))
    assert split.lo is None and bf16_parts(hidden)[1] is None
    torch.testing.assert_close(
        head_logits(hidden, split), head_logits(hidden, HeadWeights(weight)), atol=1e-5, rtol=1e-6
    )


def test_the_cpu_runs_the_fp32_head_even_under_bf16_autocast():
    assert not lm_head.gemm_bf16_to_fp32_exists("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head_precision(torch.device("cpu")) == "fp32"  # the golden runs and CPU timings are unchanged
    assert head_precision(torch.device("cpu"), torch.bfloat16) == "fp32"


@pytest.mark.parametrize("chunk", [2**26, 2 * 23], ids=["one chunk", "recomputed chunks"])
def test_token_logprobs_with_the_bf16x3_head(model, monkeypatch, chunk):
    """Where the head runs as bf16x3 (CUDA under bf16 autocast; forced here on the CPU), the learner's log-probs and
    gradients are the fp32 head's to fp32-class precision, chunked (recomputed in backward) or not."""
    from test_rollout import batch_of

    batch = batch_of([[2, 5, 6], [2, 7]], [[10, 11, 12, 13], [14, 15, 1]])
    results = {}
    for precision in ("fp32", "bf16x3"):
        monkeypatch.setattr(lm_head, "head_precision", lambda device, dtype, p=precision: p)
        model.zero_grad()
        out = token_logprobs(model, batch, with_entropy=True, max_chunk_elements=chunk)
        (out.logprobs * batch.completion_mask).sum().backward()
        results[precision] = (out.logprobs.detach(), out.entropy, model.lm_head.weight.grad.clone())
    (lp32, ent32, grad32), (lp3, ent3, grad3) = results["fp32"], results["bf16x3"]
    assert not torch.equal(lp3, lp32)  # the bf16x3 path ran (its rounding is not fp32's)
    torch.testing.assert_close(lp3, lp32, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent3, ent32, atol=1e-5, rtol=0)
    assert float((grad3 - grad32).norm() / grad32.norm()) < 1e-2


def test_target_logprob_backward_is_autograds_and_the_entropy_is_the_softmaxs():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 3, 7, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: target_logprobs_and_entropy(z, targets)[0], (logits,))
    logp, entropy = target_logprobs_and_entropy(logits, targets, with_entropy=True)
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(logp, reference.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1))
    assert not entropy.requires_grad
    with torch.no_grad():  # the no-grad path gives the same numbers
        plain = target_logprobs_and_entropy(logits, targets, with_entropy=True)
    torch.testing.assert_close(plain[0], logp.detach())
    torch.testing.assert_close(plain[1], entropy)
