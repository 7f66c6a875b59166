"""The fast sampler: same greedy tokens as HF generate, EOS handling, group-major order, filters, wiring."""

import contextlib

import pytest
import torch

from lit_gspo.rl.engines import HFGenerate, LeanSampler
from lit_gspo.rl.engines.fast_generate import (
    attention_implementation,
    fast_generate,
    filter_logits,
    penalize_repeats,
    sample_tokens,
    tokens_seen,
)
from lit_gspo.rl.rollout import left_pad

PAD, EOS = 0, 1  # as in conftest.py's tiny model


def generate(model, prompts, *, backend="hf", attn_implementation=None, do_sample=True, **kwargs):
    """Sample through an engine as the trainer does (``hf``: HFGenerate, ``fast``: LeanSampler)."""
    engine = (LeanSampler if backend == "fast" else HFGenerate)(attn_implementation=attn_implementation)
    return engine.sample(model, prompts, greedy=not do_sample, **kwargs)


PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [7]]


def hf_greedy(model, ids, attn, max_new_tokens, eos_id):
    return model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=eos_id,
    )


def test_greedy_matches_hf_generate_with_left_padding(model):
    ids, attn = left_pad(PROMPTS, PAD)
    hf = hf_greedy(model, ids, attn, 12, EOS)
    fast = fast_generate(model, ids, attn, max_new_tokens=12, eos_id=EOS, pad_id=PAD, do_sample=False)
    assert fast.shape[1] <= hf.shape[1]
    assert torch.equal(fast, hf[:, : fast.shape[1]])
    assert (hf[:, fast.shape[1] :] == PAD).all()


@pytest.mark.parametrize("eos", [4, [4, 9]])
def test_greedy_eos_handling_matches_hf(model, eos):
    """An EOS that some rows hit early: those rows leave the batch and are padded; others continue unchanged."""
    ids, attn = left_pad(PROMPTS, PAD)
    free = hf_greedy(model, ids, attn, 16, EOS)[:, ids.shape[1] :]
    eos_ids = [eos] if isinstance(eos, int) else eos
    hit = torch.isin(free, torch.tensor(eos_ids)).any(1)
    hf = hf_greedy(model, ids, attn, 16, eos)
    fast = fast_generate(model, ids, attn, max_new_tokens=16, eos_id=eos, pad_id=PAD, do_sample=False)
    assert torch.equal(fast, hf[:, : fast.shape[1]])
    comp = fast[:, ids.shape[1] :]
    for row in range(len(PROMPTS)):
        if hit[row]:  # exactly one EOS, then only padding
            where = torch.isin(comp[row], torch.tensor(eos_ids)).nonzero().flatten()
            assert len(where) >= 1 and (comp[row, where[0] + 1 :] == PAD).all()


def test_stops_when_all_rows_finished(model):
    ids, attn = left_pad(PROMPTS, PAD)
    first = fast_generate(model, ids, attn, max_new_tokens=1, eos_id=EOS, pad_id=PAD, do_sample=False)[:, -1]
    out = fast_generate(
        model, ids, attn, max_new_tokens=10, eos_id=first.unique().tolist(), pad_id=PAD, do_sample=False
    )
    assert out.shape[1] == ids.shape[1] + 1  # every row emitted an EOS at the first step


def test_group_major_order_and_shared_prompt(model):
    ids, attn = left_pad(PROMPTS, PAD)
    G = 3
    torch.manual_seed(0)
    out = fast_generate(model, ids, attn, num_generations=G, max_new_tokens=6, eos_id=EOS, pad_id=PAD)
    assert out.shape[0] == len(PROMPTS) * G
    assert torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(G, 0))
    # greedy with G copies: every completion of a group equals the single greedy completion of its prompt
    greedy = fast_generate(model, ids, attn, max_new_tokens=6, eos_id=EOS, pad_id=PAD, do_sample=False)
    grouped = fast_generate(
        model, ids, attn, num_generations=G, max_new_tokens=6, eos_id=EOS, pad_id=PAD, do_sample=False
    )
    assert torch.equal(grouped, greedy.repeat_interleave(G, 0))


def test_sampling_is_reproducible_with_a_generator(model):
    ids, attn = left_pad(PROMPTS, PAD)
    runs = [
        fast_generate(
            model,
            ids,
            attn,
            num_generations=4,
            max_new_tokens=8,
            eos_id=EOS,
            pad_id=PAD,
            generator=torch.Generator().manual_seed(3),
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


def test_sampled_tokens_follow_the_model_distribution(model):
    """First sampled token frequencies match softmax(logits) of the prompt (a loose chi-square-free check)."""
    ids, attn = left_pad([[5, 6, 7]], PAD)
    probs = model(input_ids=ids, attention_mask=attn).logits[0, -1].float().softmax(-1)
    out = fast_generate(
        model,
        ids,
        attn,
        num_generations=4000,
        max_new_tokens=1,
        eos_id=EOS,
        pad_id=PAD,
        generator=torch.Generator().manual_seed(0),
    )
    freq = torch.bincount(out[:, -1], minlength=probs.numel()).float() / 4000
    assert (freq - probs).abs().max() < 0.03


def test_inverse_cdf_sampling_matches_the_distribution_and_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]).repeat(20000, 1)
    probs[::2] *= 3.0  # unnormalised rows are fine: u is scaled by the row total
    draws = sample_tokens(probs, torch.Generator().manual_seed(0)).view(20000, 2)
    freq = torch.bincount(draws[:, 0], minlength=6).float() / 20000
    assert freq[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]), rtol=0, atol=0.015)
    assert torch.all(draws[:, 1] == 5)


def test_a_compiled_draw_hands_no_cumsum_to_the_compiler():
    """The draw's CDF (and top-p's) reaches torch.compile as one opaque op: inductor's own lowering of a (rows,
    vocabulary) cumsum, a split scan on CUDA, failed to generate code at a real vocabulary (torch 2.11, the H100)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    probs = torch.rand(4, 50).softmax(-1)
    draw = torch.compile(
        lambda p, u: sample_tokens(filter_logits(p.log(), top_p=0.9).softmax(-1), uniform=u),
        backend=capture,
        fullgraph=True,
    )
    uniform = torch.rand(4)
    assert torch.equal(
        draw(probs, uniform), sample_tokens(filter_logits(probs.log(), top_p=0.9).softmax(-1), uniform=uniform)
    )
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op.startswith("call")]
    assert targets.count("lit_gspo.cumulative_sum.default") == 2
    assert not any("cumsum" in target for target in targets)


def test_generation_can_sample_with_another_attention_kernel_and_restores_the_models(model):
    assert model.config._attn_implementation == "sdpa"
    sdpa = generate(
        model, PROMPTS, num_generations=2, max_new_tokens=8, pad_id=PAD, eos_id=EOS, do_sample=False, backend="fast"
    )
    eager = generate(
        model,
        PROMPTS,
        num_generations=2,
        max_new_tokens=8,
        pad_id=PAD,
        eos_id=EOS,
        do_sample=False,
        backend="fast",
        attn_implementation="eager",
    )
    assert torch.equal(sdpa.input_ids, eager.input_ids)  # fp32: the kernels agree on the greedy tokens
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), attention_implementation(model, "eager"):
        assert model.config._attn_implementation == "eager"
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        LeanSampler(attn_implementation="fast")


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.85)).tolist() == [[False, False, False, True]]  # 0.8 < 0.85
    assert torch.isinf(filter_logits(logits, top_p=0.9)).tolist() == [[False, False, False, True]]
    assert torch.allclose(filter_logits(logits, temperature=2.0), logits / 2)
    # min-p: probability >= min_p × the most probable one's (0.5): 0.2 → 0.1 drops 0.05; 0.5 → 0.25 keeps two
    assert torch.isinf(filter_logits(logits, min_p=0.2)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, min_p=0.5)).tolist() == [[False, False, True, True]]
    # after top-p 0.7 (0.5, 0.3 left, renormalised 0.625, 0.375): the threshold is relative, so 0.7 drops 0.3 still
    assert torch.isinf(filter_logits(logits, top_p=0.7, min_p=0.7)).tolist() == [[False, True, True, True]]


def test_the_repetition_penalty_is_transformers_bit_for_bit_and_skips_left_padding():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.randint(3, 30, (4, 9), generator=torch.Generator().manual_seed(1))
    everything = torch.ones_like(ids, dtype=torch.bool)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits)
    assert torch.equal(penalize_repeats(logits, tokens_seen(ids, everything, 30), 1.3), expected)
    # by hand: z > 0 divided by p, z <= 0 multiplied; a token seen only in the padding is not penalised
    ids, valid = torch.tensor([[0, 0, 4, 5]]), torch.tensor([[False, False, True, True]])
    z = torch.tensor([[2.0, -1.0, 0.5, 0.5, 3.0, -2.0]])
    assert penalize_repeats(z, tokens_seen(ids, valid, 6), 2.0).tolist() == [[2.0, -1.0, 0.5, 0.5, 1.5, -4.0]]


def test_filter_logits_is_transformers_warpers_bit_for_bit():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)]
    expected = logits
    for warper in warpers:
        expected = warper(None, expected)
    assert torch.equal(filter_logits(logits, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05), expected)


def test_rollout_backends_agree_on_greedy(model):
    hf = generate(model, PROMPTS, num_generations=2, max_new_tokens=10, pad_id=PAD, eos_id=EOS, do_sample=False)
    fast = generate(
        model, PROMPTS, num_generations=2, max_new_tokens=10, pad_id=PAD, eos_id=EOS, do_sample=False, backend="fast"
    )
    assert hf.prompt_length == fast.prompt_length
    assert torch.equal(hf.input_ids, fast.input_ids)
    assert torch.equal(hf.attention_mask, fast.attention_mask)
    assert torch.equal(hf.completion_mask, fast.completion_mask)


def test_bf16_autocast_keeps_logprobs_and_ratios_fp32(model):
    """Under bf16-mixed (CPU autocast) the backbone runs in bf16 but log-probs come out fp32, and
    an on-policy recomputation gives a ratio of exactly 1 (the same kernels run twice)."""
    from lit_gspo.rl.objectives import GSPO
    from lit_gspo.rl.rollout import token_logprobs

    batch = generate(model, PROMPTS, num_generations=2, max_new_tokens=6, pad_id=PAD, eos_id=EOS, backend="fast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            old = token_logprobs(model, batch).logprobs
        new = token_logprobs(model, batch).logprobs
        out = GSPO()(new, old, torch.randn(len(batch)), batch.completion_mask)
    assert old.dtype == new.dtype == torch.float32
    assert torch.equal(old, new.detach())
    assert out.metrics["clip_frac"] == 0
    out.loss.backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    model.zero_grad()


def test_weights_are_cast_once_while_sampling_and_the_cache_is_dropped_after():
    from torch.utils._python_dispatch import TorchDispatchMode

    from lit_gspo.rl.engines.fast_generate import weights_cast_once

    class CountCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                CountCasts.count += 1
            return func(*args, **kwargs)

    layer, x = torch.nn.Linear(8, 8), torch.randn(2, 8)

    def two_forwards(cached: bool):
        CountCasts.count = 0
        with torch.no_grad(), CountCasts(), weights_cast_once("cpu") if cached else contextlib.nullcontext():
            outputs = layer(x), layer(x)
        return outputs, CountCasts.count

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as Lightning's bf16-mixed
        (first, _), uncached = two_forwards(cached=False)
        (same, _), cached = two_forwards(cached=True)
        with torch.no_grad():
            layer.weight.add_(1.0)  # an optimiser step after sampling
            after = layer(x)
    assert (uncached, cached) == (6, 4)  # input, weight, bias per call; with the cache the weight and bias once
    torch.testing.assert_close(same, first, rtol=0, atol=0)
    assert not torch.allclose(after.float(), first.float())  # the cache did not outlive the block


def test_grouped_query_eager_attention_equals_eager(model):
    """lit_gqa_eager: the same log-probs and greedy tokens as eager, without repeating K and V per head."""
    from lit_gspo.rl.engines.fast_generate import GQA_EAGER
    from lit_gspo.rl.rollout import token_logprobs

    assert model.config.num_attention_heads // model.config.num_key_value_heads == 2
    prompts = [[2, 5, 6, 7, 8], [2, 9]]  # left padding exercises the mask
    outputs = {}
    for implementation in ("eager", GQA_EAGER):
        with attention_implementation(model, implementation):
            rollout = generate(
                model,
                prompts,
                num_generations=1,
                max_new_tokens=6,
                pad_id=PAD,
                eos_id=EOS,
                do_sample=False,
                backend="fast",
            )
            outputs[implementation] = rollout, token_logprobs(model, rollout).logprobs
    (eager, eager_lp), (gqa, gqa_lp) = outputs["eager"], outputs[GQA_EAGER]
    assert torch.equal(gqa.input_ids, eager.input_ids)
    torch.testing.assert_close(gqa_lp, eager_lp, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation != GQA_EAGER  # restored after the block


@pytest.mark.parametrize("asked", [dict(sliding_window=4), dict(softcap=50.0), dict(s_aux=torch.zeros(4))])
def test_grouped_query_eager_attention_refuses_more_than_plain_attention(asked):
    """A sliding window, soft-capped logits or attention sinks change what attention computes: refused, not ignored."""
    from lit_gspo.rl.engines.fast_generate import gqa_eager_attention

    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    plain, _ = gqa_eager_attention(torch.nn.Identity(), q, kv, kv, None, scaling=0.5, sliding_window=None)
    assert plain.shape == (1, 3, 4, 8)
    with pytest.raises(NotImplementedError, match=next(iter(asked))):
        gqa_eager_attention(torch.nn.Identity(), q, kv, kv, None, scaling=0.5, **asked)


def test_grouped_query_eager_attention_over_the_first_slots_is_the_masked_attention_over_all():
    """``lit_attention_slots`` (length S): the keys past slot S are left unread, not just masked; where they are
    masked anyway (a static cache's unwritten slots) the output is the same."""
    from lit_gspo.rl.engines.fast_generate import ATTENTION_SLOTS, gqa_eager_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 10, 8), torch.randn(3, 2, 10, 8)
    mask = torch.zeros(3, 1, 1, 10)
    mask[..., 6:] = torch.finfo(torch.float32).min  # slots 6.. unwritten
    module = torch.nn.Identity()
    full, _ = gqa_eager_attention(module, q, k, v, mask, scaling=0.3)
    k[:, :, 6:], v[:, :, 6:] = float("nan"), float("nan")  # what is not read cannot matter
    first, _ = gqa_eager_attention(module, q, k, v, mask, scaling=0.3, **{ATTENTION_SLOTS: torch.arange(6)})
    torch.testing.assert_close(first, full, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "value_dim, mask_heads", [(8, 1), (5, 1), (8, 4)], ids=["plain", "narrower-values", "per-head"]
)
def test_grouped_query_eager_attention_is_eager_attention(value_dim, mask_heads):
    """Without copying keys and values per query head, the numbers of transformers' eager attention (``repeat_kv``),
    also with values narrower than keys (latent attention: DeepSeek-V3, MiniCPM3) and a mask per head (Doge's)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from lit_gspo.rl.engines.fast_generate import gqa_eager_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, value_dim)
    mask = torch.randn(2, mask_heads, 3, 6)
    mask[..., 4:] = torch.finfo(torch.float32).min
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    expected, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = gqa_eager_attention(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
