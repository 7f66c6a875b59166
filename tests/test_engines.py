"""Rollout engines: the sampler's own log-probs, and that asking for them changes nothing sampled."""

import re

import pytest
import torch

from lit_gspo.models import load_policy
from lit_gspo.rl.engines import HFGenerate, LeanSampler, RolloutEngine, StaticCacheSampler
from lit_gspo.rl.rollout import position_ids_of, token_logprobs

PAD, EOS = 0, 1  # conftest.py's tiny model
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]


def sample(engine, model, seed=0, **kwargs):
    torch.manual_seed(seed)
    return engine.sample(model, PROMPTS, num_generations=3, max_new_tokens=8, pad_id=PAD, eos_id=EOS, **kwargs)


def own_stream(engine: RolloutEngine, seed: int = 7) -> RolloutEngine:
    engine.own_random_stream(seed)
    return engine


SAMPLERS = {  # each in-process engine, drawing from torch's default stream or from its own
    "hf": HFGenerate,
    "lean": LeanSampler,
    "hf-own-stream": lambda: own_stream(HFGenerate()),
    "lean-own-stream": lambda: own_stream(LeanSampler()),
}


@pytest.mark.parametrize("make", SAMPLERS.values(), ids=list(SAMPLERS))
def test_engine_logprobs_are_the_trainers_when_both_see_the_same_distribution(model, make):
    batch = sample(make(), model, temperature=0.7, return_logprobs=True)
    plain = sample(make(), model, temperature=0.7)
    assert torch.equal(batch.input_ids, plain.input_ids) and plain.engine_logprobs is None  # same draws
    mask = batch.completion_mask
    assert batch.engine_logprobs.dtype == torch.float32 and batch.engine_logprobs.shape == mask.shape
    assert batch.engine_logprobs[~mask].eq(0).all() and (batch.engine_logprobs[mask] < 0).all()
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=0.7).logprobs
    torch.testing.assert_close(batch.engine_logprobs[mask], trainer[mask], atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "sampling",
    [
        {"top_k": 3},
        {"top_p": 0.8, "temperature": 1.3},
        {"min_p": 0.2, "top_p": 0.9, "temperature": 1.3},
        {"repetition_penalty": 1.5, "top_k": 5},
        {"greedy": True},
    ],
    ids=["top-k", "top-p", "min-p after top-p", "repetition penalty", "greedy"],
)
@pytest.mark.parametrize("make", SAMPLERS.values(), ids=list(SAMPLERS))
def test_asking_for_the_logprobs_changes_nothing_sampled(model, make, sampling):
    """HFGenerate keeps the log-probs in a logits processor that applies the warpers itself: its draws must be those
    of transformers' own warpers, bit for bit."""
    batch = sample(make(), model, return_logprobs=True, **sampling)
    plain = sample(make(), model, **sampling)
    assert torch.equal(batch.input_ids, plain.input_ids) and torch.equal(batch.completion_mask, plain.completion_mask)


@pytest.mark.parametrize("make", SAMPLERS.values(), ids=list(SAMPLERS))
def test_with_top_k_the_sampler_renormalises_so_its_logprobs_exceed_the_trainers(model, make):
    """The sampler draws from the top-k distribution; the trainer scores under the full softmax (a mismatch)."""
    batch = sample(make(), model, top_k=3, return_logprobs=True)
    mask = batch.completion_mask
    with torch.no_grad():
        trainer = token_logprobs(model, batch).logprobs
    gap = (batch.engine_logprobs - trainer)[mask]
    assert (gap > 1e-4).all()  # the 3 kept tokens' mass is < 1 under the full softmax


def min_p_logprobs(model, batch, min_p: float, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, T) by hand: the log-softmax of each step's logits / T over the tokens whose probability is ≥ min_p × the
    most probable one's; and how many tokens each step kept."""
    P = batch.prompt_length
    with torch.no_grad():
        positions = position_ids_of(batch.attention_mask)
        out = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions)
        logits = out.logits[:, P - 1 : -1].float() / temperature
    probs = logits.softmax(-1)
    kept = probs >= min_p * probs.amax(-1, keepdim=True)
    expected = logits.masked_fill(~kept, -torch.inf).log_softmax(-1).gather(-1, batch.input_ids[:, P:, None])[..., 0]
    return expected, kept.sum(-1)


@pytest.mark.parametrize("make", [HFGenerate, LeanSampler, StaticCacheSampler], ids=["hf", "lean", "static-cache"])
def test_with_min_p_the_logprobs_are_of_the_tokens_at_least_min_p_times_the_most_probable(model, make):
    """Every sampled token is one min-p kept, with the log-prob of the cut distribution (temperature 0.3, min-p 0.5)."""
    batch = sample(make(), model, temperature=0.3, min_p=0.5, return_logprobs=True)
    mask = batch.completion_mask
    expected, kept = min_p_logprobs(model, batch, 0.5, 0.3)
    assert torch.isfinite(expected[mask]).all()
    assert (kept[mask] < model.config.vocab_size).any()  # min-p cut some
    torch.testing.assert_close(batch.engine_logprobs[mask], expected[mask], atol=2e-5, rtol=0)


def penalised_logprobs(model, batch, penalty: float, temperature: float) -> torch.Tensor:
    """(rows, T) by hand: the log-softmax of each step's logits after dividing (z > 0) or multiplying (z ≤ 0) the
    logit of every token the row held before it (its prompt, not the left padding, and its reply so far) by p."""
    P = batch.prompt_length
    with torch.no_grad():
        positions = position_ids_of(batch.attention_mask)
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits.float()
    expected = torch.zeros(batch.completion_mask.shape)
    for row in range(len(batch)):
        prompt = zip(batch.input_ids[row, :P].tolist(), batch.attention_mask[row, :P].tolist())
        held = {token for token, real in prompt if real}
        for step in range(batch.completion_mask.shape[1]):
            z = logits[row, P - 1 + step].clone()
            for token in held:
                z[token] = z[token] / penalty if z[token] > 0 else z[token] * penalty
            token = int(batch.input_ids[row, P + step])
            expected[row, step] = (z / temperature).log_softmax(-1)[token]
            held.add(token)
    return expected


@pytest.mark.parametrize("make", [HFGenerate, LeanSampler, StaticCacheSampler], ids=["hf", "lean", "static-cache"])
def test_with_a_repetition_penalty_the_logprobs_are_of_the_penalised_distribution(model, make):
    batch = sample(make(), model, temperature=0.7, repetition_penalty=1.8, return_logprobs=True)
    mask = batch.completion_mask
    expected = penalised_logprobs(model, batch, 1.8, 0.7)
    torch.testing.assert_close(batch.engine_logprobs[mask], expected[mask], atol=2e-5, rtol=0)
    plain = penalised_logprobs(model, batch, 1.0, 0.7)
    assert (expected - plain)[mask].abs().max() > 0.1  # the penalty moved them


@pytest.mark.parametrize("make", [HFGenerate, LeanSampler, StaticCacheSampler], ids=["hf", "lean", "static-cache"])
def test_an_engine_with_its_own_stream_samples_the_same_whatever_torch_drew_meanwhile(model, make):
    """The thread rollout worker's engine draws from its own stream: the trainer's thread drawing from torch's default
    one (at any moment) changes nothing it samples. On the default stream the same draws do change it."""
    drawn = {}
    for torch_seed, torch_draws in ((0, 0), (1, 5)):
        engine = own_stream(make(), seed=7)
        torch.manual_seed(torch_seed)
        first = engine.sample(model, PROMPTS, num_generations=3, max_new_tokens=8, pad_id=PAD, eos_id=EOS)
        torch.rand(torch_draws)  # the trainer's thread, between two rollouts
        second = sample(engine, model, seed=torch_seed + 10, top_p=0.9, return_logprobs=True)
        drawn[torch_seed] = first, second
    (a, b), (c, d) = drawn.values()
    assert torch.equal(a.input_ids, c.input_ids) and torch.equal(b.input_ids, d.input_ids)
    assert torch.equal(b.engine_logprobs, d.engine_logprobs)
    assert not torch.equal(a.input_ids, b.input_ids)  # the stream went on: the second rollout drew afresh
    assert not torch.equal(sample(make(), model, seed=0).input_ids, sample(make(), model, seed=1).input_ids)


def test_one_stream_inverts_the_same_cdf_in_every_engine(model):
    """HFGenerate's own-stream draws (a logits processor) are the lean sampler's: the same uniform per row inverts the
    same distribution, so every first token agrees (later ones differ once a finished row leaves the lean batch)."""
    hf = sample(own_stream(HFGenerate()), model, temperature=0.7, return_logprobs=True)
    lean = sample(own_stream(LeanSampler()), model, temperature=0.7, return_logprobs=True)
    P = len(max(PROMPTS, key=len))
    assert torch.equal(hf.input_ids[:, : P + 1], lean.input_ids[:, : P + 1])
    torch.testing.assert_close(hf.engine_logprobs[:, 0], lean.engine_logprobs[:, 0], atol=2e-6, rtol=0)


def test_lean_and_hf_engines_agree_on_greedy_tokens_and_logprobs(model):
    hf = sample(HFGenerate(), model, greedy=True, return_logprobs=True)
    lean = sample(LeanSampler(), model, greedy=True, return_logprobs=True)
    assert torch.equal(hf.input_ids, lean.input_ids) and torch.equal(hf.completion_mask, lean.completion_mask)
    torch.testing.assert_close(hf.engine_logprobs, lean.engine_logprobs, atol=2e-5, rtol=0)


def test_an_engine_is_one_method_and_sample_does_the_layout(model):
    class Fixed(RolloutEngine):
        """Always answers 4, 4, EOS (then junk the layout must mask)."""

        def generate(self, policy, input_ids, attention_mask, *, num_generations, **kwargs):
            reply = torch.tensor([4, 4, EOS, 9])
            rows = input_ids.repeat_interleave(num_generations, 0)
            return torch.cat([rows, reply.expand(len(rows), -1)], 1), None

    batch = Fixed().sample(model, PROMPTS, num_generations=2, max_new_tokens=4, pad_id=PAD, eos_id=EOS)
    assert len(batch) == 6 and batch.prompt_length == 5
    assert batch.completion_mask.tolist() == [[True, True, True]] * 6  # through the EOS, the 9 trimmed
    assert batch.input_ids[0, 5:].tolist() == [4, 4, EOS] and batch.engine_logprobs is None
    assert batch.attention_mask[1].tolist() == [1] * 8 and batch.attention_mask[2].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]


def test_greedy_generation_picks_the_argmax_of_our_logprobs(model):
    """The engine and token_logprobs() must see the same positions, also for left-padded prompts."""
    rollout = HFGenerate().sample(
        model, [[2, 5, 6, 7, 8, 9], [2, 4]], num_generations=1, max_new_tokens=6, pad_id=PAD, eos_id=EOS, greedy=True
    )
    lp = token_logprobs(model, rollout).logprobs
    assert rollout.completion_mask[:, 0].all()
    # greedy tokens have the maximal log-prob at every valid step: logp(y_t) == max_v logp(v)
    P = rollout.prompt_length
    ids, attn = rollout.input_ids, rollout.attention_mask

    logits = model(ids, attention_mask=attn, position_ids=position_ids_of(attn)).logits.float().log_softmax(-1)
    best = logits[:, P - 1 : -1].max(-1).values
    mask = rollout.completion_mask
    torch.testing.assert_close(lp[mask], best[mask], atol=1e-5, rtol=1e-5)


def test_generation_is_group_major_and_masks_after_eos(model):
    torch.manual_seed(1)
    rollout = HFGenerate().sample(
        model, [[2, 5], [2, 6, 7]], num_generations=3, max_new_tokens=5, pad_id=PAD, eos_id=EOS
    )
    assert len(rollout) == 6
    prompts = rollout.input_ids[:, : rollout.prompt_length]
    assert torch.equal(prompts[0], prompts[2]) and torch.equal(prompts[3], prompts[5])
    completions = rollout.input_ids[:, rollout.prompt_length :]
    assert (completions[~rollout.completion_mask] == PAD).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="fp8"), r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), got 'fp8'"),
        (dict(max_model_len=1), r"max_model_len must be >= 2 .*got 1"),
        (dict(kv_cache_gb=0), r"kv_cache_gb must be > 0, got 0"),
        (dict(num_threads=0), r"num_threads must be >= 1 or null, got 0"),
    ],
)
def test_bad_vllm_engine_settings_are_refused_naming_the_value(kwargs, message):
    """Checked before vLLM is looked for: the same error with or without it installed."""
    from lit_gspo.rl.engines import VLLMEngine

    with pytest.raises(ValueError, match=message):
        VLLMEngine(**kwargs)


def test_llm_kwargs_that_the_vllm_engine_sets_itself_are_refused_naming_its_own_argument():
    """Each would be a TypeError at the first rollout (a keyword given twice), after the warm start; vLLM ignores
    gpu_memory_utilization beside the KV cache's bytes. Checked before vLLM is looked for."""
    from lit_gspo.rl.engines import VLLMEngine
    from lit_gspo.rl.engines.vllm import OWN_LLM_ARGUMENTS

    for key, own in OWN_LLM_ARGUMENTS.items():
        way = f"--model.engine.init_args.{own}" if own else "set by the engine"
        with pytest.raises(ValueError, match=rf"llm_kwargs \['{key}'\]: .*\({key}: {re.escape(way)}\)"):
            VLLMEngine(llm_kwargs={"block_size": 16, key: 1})


@pytest.mark.parametrize("engine", ["LeanSampler", "StaticCacheSampler"])
def test_under_sharded_parameters_an_engine_without_its_own_sharded_loop_samples_with_generate(engine, monkeypatch):
    """FSDP2 (``synced_gpus``): ranks that finish early must keep stepping with the others: transformers' generate."""
    import lit_gspo.rl.engines as engines
    import lit_gspo.rl.engines.hf as hf

    calls, original = [], hf.generate_with_hf

    def recorded(policy, input_ids, attention_mask, **kwargs):
        calls.append(kwargs["synced_gpus"])  # one process: no group to synchronise with
        return original(policy, input_ids, attention_mask, **{**kwargs, "synced_gpus": False})

    monkeypatch.setattr(hf, "generate_with_hf", recorded)
    policy, tokenizer = load_policy("tiny-llama", seed=0)
    prompts = [tokenizer("rev 12=")["input_ids"]]
    kwargs = dict(num_generations=2, max_new_tokens=3, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    with pytest.warns(UserWarning, match=f"{engine} samples with transformers' generate"):
        getattr(engines, engine)().sample(policy, prompts, synced_gpus=True, **kwargs)
    getattr(engines, engine)().sample(policy, prompts, **kwargs)
    assert calls == [True]  # only the sharded call went to generate


def test_hf_generates_logprobs_hold_one_steps_scores_not_every_steps(model):
    """transformers' ``output_scores`` kept a (rows, vocabulary) fp32 tensor per step, and stacking them made
    (rows, T, vocabulary) — 10 GB for 64 rows × 256 tokens of a 152k vocabulary. No tensor that large is made now."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocabulary = model.config.vocab_size  # 23: no other dimension of the tiny model

    class LargestScores(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == vocabulary:
                    LargestScores.numel = max(LargestScores.numel, t.numel())
            return out

    with LargestScores():
        batch = sample(HFGenerate(), model, top_p=0.9, return_logprobs=True)
    rows, T = batch.completion_mask.shape
    assert T > max(map(len, PROMPTS))  # the prefill's logits (rows, P, vocabulary) are smaller than T steps' scores
    assert LargestScores.numel < rows * T * vocabulary
