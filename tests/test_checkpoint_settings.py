"""A checkpoint's generation_config.json changes nothing an engine samples (lit_gspo.rl.engines.checkpoint_settings):
every setting transformers' GenerationConfig has, set on the model, leaves HFGenerate's tokens and log-probs those of
π, as LeanSampler's and StaticCacheSampler's are (they never read it)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from lit_gspo.models.loading import load_policy
from lit_gspo.rl.engines import HFGenerate
from lit_gspo.rl.engines.checkpoint_settings import checkpoint_sampling_settings, generating_model
from lit_gspo.rl.rollout import token_logprobs

#: values a checkpoint plausibly ships for the settings that change what transformers samples (seen in the wild:
#: Qwen2.5-Instruct's repetition_penalty 1.05 with temperature 0.7, top_p 0.8, top_k 20); every other setting is set
#: to each of GENERIC
REALISTIC = {
    "repetition_penalty": [1.05, 3.0],
    "no_repeat_ngram_size": [1, 2],
    "min_new_tokens": [6],
    "min_length": [12],
    "temperature": [0.7],
    "top_k": [2, 20],
    "top_p": [0.5, 0.8],
    "min_p": [0.3],
    "top_h": [0.5],
    "typical_p": [0.5],
    "epsilon_cutoff": [0.05],
    "eta_cutoff": [0.05],
    "bad_words_ids": [[[5]], [[6], [7]]],
    "sequence_bias": [{(5,): 10.0}],
    "suppress_tokens": [[5, 6, 7]],
    "begin_suppress_tokens": [[5, 6, 7]],
    "forced_eos_token_id": [5],
    "exponential_decay_length_penalty": [(1, 2.0)],
    "renormalize_logits": [True],
    "max_time": [0.0],
    "num_beams": [2],
    "num_return_sequences": [2],
    "return_dict_in_generate": [True],
    "output_scores": [True],
    "do_sample": [False, True],
    "max_new_tokens": [2],
    "max_length": [3],
    "use_cache": [False],
}
GENERIC = [2, True]
SKIPPED = {"transformers_version", "_from_model_config", "pad_token_id", "eos_token_id", "bos_token_id"}
SETTINGS = [k for k in GenerationConfig().to_dict() if k not in SKIPPED]
MODES = {  # the three ways HFGenerate calls generate: its own random stream, torch's default stream, greedy
    "own-stream": dict(return_logprobs=True, own_stream=True),
    "default-stream": dict(return_logprobs=False, own_stream=False),
    "greedy": dict(return_logprobs=False, own_stream=False, greedy=True),
}


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny-llama", seed=0)


def sample(policy, tok, *, return_logprobs, own_stream, greedy=False):
    engine = HFGenerate()
    if own_stream:
        engine.own_random_stream(0)
    torch.manual_seed(0)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("rev 12=", "rev 345=")]
    return engine.sample(
        policy,
        prompts,
        num_generations=2,
        max_new_tokens=8,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        greedy=greedy,
        return_logprobs=return_logprobs,
        top_k=0,
    )


@pytest.mark.parametrize("mode", MODES)
def test_no_setting_of_the_checkpoints_generation_config_changes_what_hfgenerate_samples(tiny, mode):
    policy, tok = tiny
    baseline = sample(policy, tok, **MODES[mode])
    changed = []
    for setting in SETTINGS:
        for value in REALISTIC.get(setting, GENERIC):
            saved = policy.generation_config
            policy.generation_config = GenerationConfig(**saved.to_dict())
            setattr(policy.generation_config, setting, value)
            try:
                batch = sample(policy, tok, **MODES[mode])
                same = torch.equal(batch.input_ids, baseline.input_ids) and (
                    batch.engine_logprobs is None or torch.equal(batch.engine_logprobs, baseline.engine_logprobs)
                )
            except Exception as error:  # noqa: BLE001 — a setting that breaks generate is a change too
                same = f"raised {type(error).__name__}"
            finally:
                policy.generation_config = saved
            if same is not True:
                changed.append((setting, value, same))
    assert not changed, f"settings of the model's generation_config that changed HFGenerate's samples: {changed}"


def test_hfgenerate_samples_pi_and_records_its_log_probs_under_a_qwen_instruct_like_config(tiny):
    policy, tok = tiny
    saved = policy.generation_config
    qwen_like = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    policy.generation_config = GenerationConfig(**{**saved.to_dict(), **qwen_like})
    try:
        batch = sample(policy, tok, return_logprobs=True, own_stream=True)
        assert checkpoint_sampling_settings(policy) == {
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
            "repetition_penalty": 1.05,
        }
        assert policy.generation_config.repetition_penalty == 1.05  # restored after sampling
    finally:
        policy.generation_config = saved
    with torch.no_grad():
        trainer = token_logprobs(policy, batch).logprobs
    mask = batch.completion_mask
    torch.testing.assert_close(batch.engine_logprobs * mask, trainer * mask, atol=1e-5, rtol=0)


def test_a_lora_policys_base_model_is_the_one_whose_config_is_emptied(tiny):
    peft = pytest.importorskip("peft")
    policy, tok = load_policy("tiny-llama", seed=0)
    baseline = sample(policy, tok, return_logprobs=True, own_stream=True)
    wrapped = peft.get_peft_model(policy, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=True))
    assert generating_model(wrapped) is policy
    policy.generation_config.repetition_penalty = 3.0
    batch = sample(wrapped, tok, return_logprobs=True, own_stream=True)
    assert torch.equal(batch.input_ids, baseline.input_ids) and policy.generation_config.repetition_penalty == 3.0
