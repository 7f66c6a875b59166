"""VLLMEngine (issue 31): vLLM samples what the trainer's fp32 forward would, from the weights the trainer holds.

Runs where vLLM imports (``.ci/run`` builds a second environment for ``pytest -m vllm``); skipped elsewhere. The
tiny model has head size 32 (vLLM's CPU attention starts there). One engine per test module: a build takes ~6 s.
"""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

vllm = pytest.importorskip("vllm", reason="needs vLLM: pip install 'lit-gspo[vllm]' (its own environment, see .ci/run)")

from lit_gspo.models.hf_weights import hf_weights  # noqa: E402
from lit_gspo.rl.engines import HFGenerate, VLLMEngine  # noqa: E402
from lit_gspo.rl.rollout import position_ids_of, token_logprobs  # noqa: E402

pytestmark = pytest.mark.vllm

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [2, 20, 21, 22, 19, 18, 17]]
#: engine vs trainer, fp32, per sampled token: both compute the same logits with other kernels (oneDNN vs
#: transformers' matmuls); seen here ≤ 5e-7 on the tiny model
ATOL = 2e-5


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=23,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def built(model):
    """The module's engine, built by a first greedy rollout, and what the build left of the process state: vLLM's
    CPU worker reseeds the global RNGs and replaces ``torch.set_num_threads`` in the process it is built in."""
    import random

    import numpy as np

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    expected = torch.rand(3), np.random.rand(3), random.random()
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    engine = VLLMEngine(kv_cache_gb=0.05)
    engine.sync_weights(model)  # nothing built yet: nothing to push (the build pushes)
    unbuilt = engine.llm is None and engine.last_sync_s is None
    engine.sample(model, PROMPTS, num_generations=1, max_new_tokens=4, pad_id=PAD, eos_id=EOS, greedy=True)  # builds
    after = dict(
        unbuilt=unbuilt,
        set_num_threads=torch.set_num_threads is set_num_threads,
        threads=torch.get_num_threads() == threads,
        torch=torch.equal(torch.rand(3), expected[0]),
        numpy=bool((np.random.rand(3) == expected[1]).all()),
        random=random.random() == expected[2],
    )
    yield engine, after
    engine.close()


@pytest.fixture
def engine(built):
    return built[0]


def sample(engine, model, seed=0, prompts=PROMPTS, num_generations=3, **kwargs):
    torch.manual_seed(seed)
    return engine.sample(
        model, prompts, num_generations=num_generations, max_new_tokens=8, pad_id=PAD, eos_id=EOS, **kwargs
    )


def greedy(engine, model):
    return sample(engine, model, num_generations=1, greedy=True, return_logprobs=False)


def test_logprobs_are_the_trainers_fp32_forward_within_the_stated_tolerance(engine, model):
    batch = sample(engine, model, temperature=0.7, return_logprobs=True)
    mask = batch.completion_mask
    assert engine.resolved_dtype == "float32" and len(batch) == len(PROMPTS) * 3
    assert batch.engine_logprobs.dtype == torch.float32 and batch.engine_logprobs[~mask].eq(0).all()
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=0.7).logprobs
    assert mask.sum() > 40  # enough sampled tokens to mean something
    torch.testing.assert_close(batch.engine_logprobs[mask], trainer[mask], atol=ATOL, rtol=0)


def test_with_top_k_and_top_p_the_logprobs_are_of_the_truncated_renormalised_distribution(engine, model):
    """Hand-computed from the trainer's logits: log softmax over the kept tokens only (top-k 5, then top-p 0.8)."""
    batch = sample(engine, model, temperature=0.9, top_k=5, top_p=0.8, return_logprobs=True)
    P, mask = batch.prompt_length, batch.completion_mask
    with torch.no_grad():
        logits = (
            model(
                batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids_of(batch.attention_mask)
            )
            .logits[:, P - 1 : -1]
            .float()
            / 0.9
        )
    top = logits.topk(5, -1)
    probs = top.values.softmax(-1)  # sorted descending
    kept = (probs.cumsum(-1) - probs) < 0.8  # the smallest prefix whose mass reaches 0.8 (the first always kept)
    truncated = torch.full_like(logits, -torch.inf).scatter(-1, top.indices, top.values.masked_fill(~kept, -torch.inf))
    expected = truncated.log_softmax(-1).gather(-1, batch.input_ids[:, P:, None]).squeeze(-1)
    assert torch.isfinite(expected[mask]).all()  # every sampled token is one the truncation kept
    torch.testing.assert_close(batch.engine_logprobs[mask], expected[mask], atol=ATOL, rtol=0)


def test_with_min_p_the_logprobs_are_of_the_tokens_at_least_min_p_times_the_most_probable(engine, model):
    """As the in-process engines' (tests/test_engines.py); vLLM cuts min-p before top-k and top-p, transformers after:
    alone, the same."""
    from test_engines import min_p_logprobs

    batch = sample(engine, model, temperature=0.3, min_p=0.5, return_logprobs=True)
    mask = batch.completion_mask
    expected, _ = min_p_logprobs(model, batch, 0.5, 0.3)
    assert torch.isfinite(expected[mask]).all()  # every sampled token is one min-p kept
    torch.testing.assert_close(batch.engine_logprobs[mask], expected[mask], atol=ATOL, rtol=0)


def test_with_a_repetition_penalty_the_logprobs_are_of_the_penalised_distribution(engine, model):
    """vLLM penalises the prompt's and the reply's tokens before temperature, as the in-process engines do."""
    from test_engines import penalised_logprobs

    batch = sample(engine, model, temperature=0.7, repetition_penalty=1.8, return_logprobs=True)
    mask = batch.completion_mask
    expected = penalised_logprobs(model, batch, 1.8, 0.7)
    torch.testing.assert_close(batch.engine_logprobs[mask], expected[mask], atol=ATOL, rtol=0)


def test_a_seeded_torch_rng_samples_the_same_completions_and_another_seed_others(engine, model):
    first, again, other = (sample(engine, model, seed=s, temperature=1.0) for s in (0, 0, 1))
    assert torch.equal(first.input_ids, again.input_ids)
    assert not torch.equal(first.input_ids, other.input_ids)
    rows = first.input_ids[:, first.prompt_length :]
    assert len({tuple(r.tolist()) for r in rows}) > len(PROMPTS)  # the G samples of a prompt differ


def test_with_a_stream_of_its_own_the_engine_samples_the_same_whatever_torch_drew(engine, model):
    """The async rollouts' worker gives its engine a stream of its own: the request seeds come from it, not from torch's
    default stream (which the trainer's thread draws from too)."""
    drawn = []
    try:
        for torch_seed in (0, 1):
            engine.own_random_stream(7)
            drawn.append(sample(engine, model, seed=torch_seed, temperature=1.0).input_ids)
    finally:
        engine.own_random_stream(None)  # the module's engine: torch's default stream again for the other tests
    assert torch.equal(*drawn)


def test_prompts_beyond_one_steps_token_budget_sample_with_their_seeds(engine, model):
    """48 prompts × 100 tokens exceed the 4096 tokens vLLM prefills in one step. With chunked prefill (vLLM's
    default) a partly prefilled seeded request fails on CPU ("CPU Generator does not use offset"); whole prompts
    do not, and the seeds still give the same draws."""
    torch.manual_seed(0)
    prompts = torch.randint(2, 23, (48, 100)).tolist()
    first, again = (sample(engine, model, prompts=prompts, num_generations=2, temperature=1.0) for _ in range(2))
    assert len(first) == 96 and torch.equal(first.input_ids, again.input_ids)


def test_the_draws_follow_the_trainers_distribution(engine):
    """4000 first tokens of one prompt: their frequencies are the softmax of the trainer's logits up to sampling noise
    (total variation ≈ 0.014 here for vLLM and for HFGenerate alike; noise alone gives ≈ 0.015 at this n)."""
    policy = tiny_llama()
    with torch.no_grad():
        policy.lm_head.weight.mul_(8)  # a peaked distribution: 0.47 on one token, 0.001 on another
        probs = policy(torch.tensor([[5, 6, 7]])).logits[0, -1].float().softmax(-1)
    torch.manual_seed(1)
    drawn = torch.cat(
        [
            engine.sample(
                policy, [[5, 6, 7]] * 4, num_generations=250, max_new_tokens=1, pad_id=PAD, eos_id=EOS, temperature=1.0
            ).input_ids[:, -1]
            for _ in range(4)
        ]
    )
    frequencies = torch.bincount(drawn, minlength=len(probs)).float() / len(drawn)
    assert len(drawn) == 4000 and 0.5 * (frequencies - probs).abs().sum() < 0.04


def test_greedy_completions_equal_hf_generates(engine, model):
    ours = greedy(engine, model)
    hf = HFGenerate().sample(model, PROMPTS, num_generations=1, max_new_tokens=8, pad_id=PAD, eos_id=EOS, greedy=True)
    assert torch.equal(ours.input_ids, hf.input_ids) and torch.equal(ours.completion_mask, hf.completion_mask)


def test_changed_weights_are_pushed_change_the_sample_and_equal_the_trainers_then_restore(engine, model):
    before = greedy(engine, model)
    engine.sync_weights(model)
    assert engine.last_sync_s is None  # nothing changed since the last push
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync_weights(model)
    assert engine.last_sync_s is not None and engine.last_sync_s > 0
    changed = greedy(engine, model)
    hf = HFGenerate().sample(model, PROMPTS, num_generations=1, max_new_tokens=8, pad_id=PAD, eos_id=EOS, greedy=True)
    assert not torch.equal(changed.input_ids, before.input_ids) and torch.equal(changed.input_ids, hf.input_ids)
    batch = sample(engine, model, temperature=1.0, return_logprobs=True)
    with torch.no_grad():
        trainer = token_logprobs(model, batch).logprobs
    # the perturbed weights give larger logits, and the two kernels' fp32 differences grow with them: 2.5e-5 seen on
    # an AMD Zen 3 (2026-12-07), past the unperturbed model's ATOL
    torch.testing.assert_close(
        batch.engine_logprobs[batch.completion_mask], trainer[batch.completion_mask], atol=5 * ATOL, rtol=0
    )
    model.load_state_dict(saved)
    engine.sync_weights(model)
    assert engine.last_sync_s is not None
    assert torch.equal(greedy(engine, model).input_ids, before.input_ids)


def test_an_optimiser_step_counts_as_a_change_and_sample_pushes_without_an_explicit_sync(engine, model):
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batch = sample(engine, model, temperature=1.0)
    with torch.no_grad():
        lp_before = token_logprobs(model, batch).logprobs
    lp = token_logprobs(model, batch).logprobs
    (-(lp * batch.completion_mask).sum()).backward()
    optimizer.step()
    try:
        scored = sample(engine, model, seed=5, temperature=1.0, return_logprobs=True)  # sample() syncs by itself
        with torch.no_grad():
            trainer = token_logprobs(model, scored).logprobs
            assert not torch.allclose(token_logprobs(model, batch).logprobs, lp_before)
        torch.testing.assert_close(
            scored.engine_logprobs[scored.completion_mask], trainer[scored.completion_mask], atol=ATOL, rtol=0
        )
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(saved)


def test_building_vllm_leaves_the_trainers_rng_and_threads_as_they_were(built):
    engine, after = built
    assert engine.llm is not None and engine.startup_s > 0  # greedy drew no request seed from torch's RNG
    assert after == dict(unbuilt=True, set_num_threads=True, threads=True, torch=True, numpy=True, random=True)


def test_a_second_engine_in_the_process_is_refused_until_the_first_is_closed(engine, model):
    with pytest.raises(RuntimeError, match=r"another VLLMEngine holds a vLLM in this process.*\.close\(\)"):
        greedy(VLLMEngine(kv_cache_gb=0.05), model)


def test_lora_adapters_are_merged_into_what_vllm_samples_from(engine):
    from lit_gspo.models.lora import apply_lora

    policy = apply_lora(tiny_llama(seed=0), r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # peft starts B at 0 (no change): make the adapters matter
    batch = sample(engine, policy, temperature=1.0, return_logprobs=True)
    with torch.no_grad():
        trainer = token_logprobs(policy, batch).logprobs
        with policy.disable_adapter():
            base = token_logprobs(policy, batch).logprobs
    mask = batch.completion_mask
    assert (trainer - base)[mask].abs().max() > 0.05  # the adapters change the distribution
    torch.testing.assert_close(batch.engine_logprobs[mask], trainer[mask], atol=ATOL, rtol=0)
    names = [name for name, _ in hf_weights(policy)]
    assert names == list(tiny_llama().state_dict())  # the plain model's checkpoint names, adapters left out


def test_a_policy_of_another_shape_is_refused_naming_both(engine):
    other = tiny_llama()
    other.config.intermediate_size = 96  # only the config is compared: no forward runs
    with pytest.raises(
        ValueError, match=r"built for a .*'intermediate_size': 64.*this policy is .*'intermediate_size': 96"
    ):
        greedy(engine, other)


def test_under_several_trainer_processes_an_engine_split_over_ranks_is_refused_naming_the_setting(model, monkeypatch):
    """Each trainer rank samples its own prompts with a whole engine (tests/test_vllm_distributed.py); a tensor-parallel
    engine would need its ranks to sample the same ones."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    engine = VLLMEngine(kv_cache_gb=0.05, llm_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(
        ValueError, match=r"one whole engine per trainer rank; llm_kwargs \{'tensor_parallel_size': 2\}"
    ):
        greedy(engine, model)
    assert engine.llm is None


def test_a_head_size_vllms_cpu_attention_lacks_is_refused_naming_it():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=23,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    with pytest.raises(ValueError, match=r"head sizes \(32, 64.*the policy's is 8 .*hidden_size 32 / 4 heads"):
        VLLMEngine().sample(
            LlamaForCausalLM(config), [[3, 4]], num_generations=1, max_new_tokens=2, pad_id=PAD, eos_id=EOS, greedy=True
        )


def test_the_llm_arguments_the_engine_sets_itself_are_vllms():
    """``OWN_LLM_ARGUMENTS`` (refused in llm_kwargs) names arguments this vLLM has."""
    from lit_gspo.rl.engines.vllm import OWN_LLM_ARGUMENTS

    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert [key for key in OWN_LLM_ARGUMENTS if key not in fields] == []


def test_the_names_the_cli_knows_as_vllms_are_this_vllms():
    """``foreign_names.py``'s vLLM tables (the errors about an option that is vLLM's name) name vLLM's fields."""
    from lit_gspo.lightning.foreign_names import VLLM_LLM, VLLM_SAMPLING

    engine_args = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    sampling = set(vllm.SamplingParams.__struct_fields__)
    assert [name for name in VLLM_LLM if name not in engine_args] == []
    assert [name for name in VLLM_SAMPLING if name not in sampling] == []
