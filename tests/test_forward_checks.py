"""The update's log-probs are the model's own, for every causal-LM architecture transformers ships, or the model is
refused by name: ``forward_checks.check_policy_forward`` at load, ``packing_keeps_rows_apart`` before packing, and the
model's own logit map (soft caps, scales) in lit_gspo's head (``logit_map.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_archs import causal_lm_types, tiny_causal_lm, tiny_composite_lm

import lit_gspo.rl.logit_map as logit_maps
from lit_gspo.rl.config import Update
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler
from lit_gspo.rl.forward_checks import PROBE_ROWS, check_policy_forward, packing_keeps_rows_apart, probe_batch
from lit_gspo.rl.learn import learner as learner_module
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.logit_map import logit_map
from lit_gspo.rl.objectives import GSPO
from lit_gspo.rl.rollout import token_logprobs

#: architectures RL is run on that must build here and pass (a transformers change that stops one is seen)
EXPECTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2")
EXPECTED += (
    "granite",
    "cohere",
    "gpt2",
    "gpt_neox",
    "opt",
    "mixtral",
    "olmoe",
    "smollm3",
    "starcoder2",
    "glm4",
    "llama4_text",
)


def each_row_alone(model, batch) -> torch.Tensor:
    """(N, T) log-probs of each row's completion from the model's forward of that row alone, unpadded."""
    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    out = torch.zeros(len(batch), T)
    for row in range(len(batch)):
        real = batch.attention_mask[row].bool()
        ids = batch.input_ids[row][real]
        with torch.no_grad():
            logp = model(input_ids=ids[None], use_cache=False).logits[0].float().log_softmax(-1)
        start = P - int((~real[:P]).sum())  # the first completion token's index in ``ids``
        for t in range(int(batch.completion_mask[row].sum())):
            out[row, t] = logp[start - 1 + t, ids[start + t]]
    return out


def checked_architectures():
    """(model_type, model, the load check's ValueError or None) for every architecture that builds tiny."""
    for model_type in causal_lm_types():
        model = tiny_causal_lm(model_type)
        if model is None:
            continue
        try:
            check_policy_forward(model)
        except ValueError as refusal:
            yield model_type, model, refusal
        else:
            yield model_type, model, None


def test_every_architecture_trains_the_logprobs_of_each_row_alone_or_is_refused_by_name():
    """Over every causal LM transformers' auto mapping holds that builds tiny from its default config: either the load
    check refuses it with a ValueError naming it, or the padded, aligned and shared-prompt forwards give each row's own
    log-probs, and the packed forward does exactly where the packing probe says it keeps the rows apart."""
    accepted, refused, packs = [], {}, {}
    for model_type, model, refusal in checked_architectures():
        if refusal is not None:
            assert type(model).__name__ in str(refusal) or model_type in str(refusal)
            refused[model_type] = str(refusal).split(":")[0]
            continue
        accepted.append(model_type)
        batch = probe_batch(model, PROBE_ROWS)
        truth, mask = each_row_alone(model, batch), batch.completion_mask
        allowed = 1e-5 * (1 + float(truth[mask].abs().max()))
        with torch.no_grad():
            for how in ({}, {"align": True}, {"share_prompts": True}):
                gap = (token_logprobs(model, batch, **how).logprobs - truth)[mask].abs().max()
                assert gap <= allowed, (model_type, how, float(gap))
            packs[model_type] = packing_keeps_rows_apart(model)
            gap = (token_logprobs(model, batch, pack=True).logprobs - truth)[mask].abs().max()
        assert bool(gap <= allowed) == packs[model_type], (model_type, float(gap), packs[model_type])
    assert set(EXPECTED) <= set(accepted), sorted(set(EXPECTED) - set(accepted))
    # the refusals seen: bidirectional encoders as decoders, positions that ignore position_ids, a head lit_gspo
    # does not know; each for its own reason
    assert {"bert", "roberta", "xlm-roberta"} <= set(refused)
    assert {"bart", "marian", "rwkv"} <= set(refused)
    assert "not causal" in refused["bert"] and "left padding" in refused["bart"]
    assert not packs["opt"] and packs["llama"]  # OPT's mask ignores restarting positions


#: (model_type, config overrides) whose forward maps the head's logits, with the map large enough to matter
MAPPED = [
    ("gemma2", {"final_logit_softcapping": 0.5}),
    ("gemma3_text", {"final_logit_softcapping": 0.5}),
    ("cohere", {"logit_scale": 4.0}),
    ("granite", {"logits_scaling": 0.25}),
    ("granitemoe", {"logits_scaling": 0.25}),
]


@pytest.mark.parametrize("model_type, overrides", MAPPED, ids=[m for m, _ in MAPPED])
def test_each_logit_map_is_what_makes_the_heads_logprobs_the_models(model_type, overrides, monkeypatch):
    model = tiny_causal_lm(model_type, **overrides)
    assert model is not None
    check_policy_forward(model)  # with its map
    monkeypatch.setattr("lit_gspo.rl.rollout.logit_map", lambda model: logit_maps.LogitMap())
    with pytest.raises(ValueError, match=rf"LM head gives log-probs .* {type(model).__name__}"):
        check_policy_forward(model)  # without it


def test_an_architecture_whose_map_lit_gspo_does_not_know_is_refused_at_the_start_of_a_fit(tmp_path, monkeypatch):
    """Cohere multiplies its logits by ``logit_scale``: with that unknown to lit_gspo, ``lit-gspo fit`` on a saved
    Cohere stops before sampling, naming it and the setting that skips the check; known, the same fit runs."""
    from lit_gspo.lightning.cli import cli_main
    from lit_gspo.models import char_tokenizer

    model = tiny_causal_lm("cohere", vocab_size=128, logit_scale=4.0)
    model.save_pretrained(tmp_path / "cohere")
    char_tokenizer().save_pretrained(tmp_path / "cohere")
    args = ["--config", "configs/quickstart.yaml", "--model.policy.name", str(tmp_path / "cohere")]
    args += ["--model.policy.config", "{}"]
    args += ["--model.policy.warm_start.steps", "0", "--trainer.max_steps", "1", "--data.prompts_per_step", "2"]
    args += ["--model.generation.num_generations", "2", "--model.generation.max_new_tokens", "2"]
    args += ["--trainer.default_root_dir", str(tmp_path / "run")]
    monkeypatch.setattr(logit_maps, "SCALES", {k: v for k, v in logit_maps.SCALES.items() if k != "cohere"})
    with pytest.raises(ValueError, match="CohereForCausalLM.*'cohere'.*check_forward: false skips this check"):
        cli_main(args, run=False)
    cli_main([*args, "--model.policy.check_forward", "false"], run=False)  # the way around a wrong refusal
    monkeypatch.undo()
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1


def packing_learner(model, pack_sequences):
    return Learner(model, GSPO(), Update(pack_sequences=pack_sequences), max_len=4, group_size=2)


def test_packing_asked_of_a_model_whose_packed_rows_see_each_other_is_an_error(monkeypatch):
    opt = tiny_causal_lm("opt")
    with pytest.raises(ValueError, match="pack_sequences=True: OPTForCausalLM's packed rows see each other"):
        _ = packing_learner(opt, True).packs
    assert packing_learner(tiny_causal_lm("llama"), True).packs


def test_packing_by_default_pads_a_model_whose_packed_rows_see_each_other(monkeypatch):
    monkeypatch.setattr(learner_module, "PACKING_KERNELS", ("eager", "sdpa"))  # as if the CPU's kernels skipped rows
    opt = packing_learner(tiny_causal_lm("opt"), None)
    with pytest.warns(UserWarning, match="runs padded rows"):
        assert not opt.packs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probed once
        assert not opt.packs
    assert packing_learner(tiny_causal_lm("llama"), None).packs


def accepted_architectures():
    """(model_type, model) for every architecture that builds tiny and passes the load check."""
    return ((model_type, model) for model_type, model, refusal in checked_architectures() if refusal is None)


def test_every_accepted_architecture_samples_the_logprobs_it_trains_or_fails_loudly():
    """LeanSampler, StaticCacheSampler (CUDA's default, eager here) and HFGenerate over every accepted architecture: the
    sampler's own log-probs are the update's, rows of other lengths included, and greedy tokens are transformers'
    ``generate``'s, row by row; or the sampler raises (a model without a KV cache, or with a cache of its own). Never
    other numbers. Recurrent layers (linear attention, convolutions: Qwen3.5, Qwen3-Next, LFM2), whose cache cannot
    repeat or drop rows, and latent attention (DeepSeek-V3, MiniCPM3: values narrower than keys) sample right."""
    prompts, sampled = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]], set()
    for model_type, model in accepted_architectures():
        try:
            for engine in (LeanSampler(), StaticCacheSampler(), HFGenerate()):
                torch.manual_seed(0)
                batch = engine.sample(
                    model,
                    prompts,
                    num_generations=2,
                    max_new_tokens=5,
                    pad_id=0,
                    eos_id=[1, 7, 9],
                    return_logprobs=True,
                )
                with torch.no_grad():
                    trained = token_logprobs(model, batch).logprobs
                gap = (trained - batch.engine_logprobs)[batch.completion_mask].abs().max()
                assert gap <= 1e-5, (model_type, type(engine).__name__, float(gap))
            greedy = LeanSampler().sample(
                model, prompts, num_generations=1, max_new_tokens=4, pad_id=0, eos_id=1, greedy=True
            )
        except (RuntimeError, ValueError, AttributeError, NotImplementedError):
            continue  # loud
        for row, prompt in enumerate(prompts):
            with torch.no_grad():
                reference = model.generate(
                    torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=1
                )[0, len(prompt) :]
            got = greedy.input_ids[row, greedy.prompt_length :][greedy.completion_mask[row]]
            assert torch.equal(reference[: len(got)], got), (model_type, row)
        sampled.add(model_type)
    must = {"qwen3_5_text", "qwen3_next", "lfm2", "deepseek_v3", "minicpm3", "glm4_moe_lite", *EXPECTED}
    assert must <= sampled, sorted(must - sampled)


def test_the_load_check_draws_nothing_and_leaves_the_models_mode(tmp_path):
    """In train mode with dropout (a LoRA policy's, say) the check runs in eval mode: no draw from torch's RNG, the
    same verdict every time, and the mode restored."""
    model = tiny_causal_lm("llama", attention_dropout=0.5).train()
    state = torch.get_rng_state()
    check_policy_forward(model)
    assert torch.equal(torch.get_rng_state(), state) and model.training


def test_the_packing_probe_judges_in_the_dtype_the_states_are_computed_in(monkeypatch):
    """Under FSDP2's bf16 casts fp32 parameters compute bf16 states, which two packings of other lengths may round
    apart by a bf16 step (a GPU's GEMM tiles follow the shape; the CPU's here do not, so the step is added): not a
    refusal. OPT's rows, which see each other, still are in bf16."""
    from lit_gspo.rl import forward_checks

    packed, calls = forward_checks.completion_states_packed, []

    def in_bf16(model, batch):
        states = packed(model, batch).to(torch.bfloat16)
        calls.append(1)
        return states if len(calls) == 1 else states + states.abs() * 2**-8  # a bf16 step apart

    monkeypatch.setattr(forward_checks, "completion_states_packed", in_bf16)
    assert packing_keeps_rows_apart(tiny_causal_lm("llama"))  # fp32 parameters, bf16 states
    monkeypatch.undo()
    assert not packing_keeps_rows_apart(tiny_causal_lm("opt").to(torch.bfloat16))


@pytest.mark.parametrize(
    "model_type, text_overrides",
    [("gemma3", {"final_logit_softcapping": 0.5}), ("qwen3_5", {"num_hidden_layers": 4})],
    ids=["gemma3", "qwen3_5"],
)
def test_composite_checkpoints_train_and_sample_their_own_logprobs(model_type, text_overrides):
    """Gemma 3 (4B and up) and Qwen3.5 checkpoints are vision + text: ``AutoModelForCausalLM`` loads them whole. The
    load check passes, keeping the logit map their forward applies (Gemma 3's vision + text forward ignores the soft cap
    its text config names, here made to matter; its text-only forward applies it), and the three engines sample the
    log-probs the update computes."""
    model = tiny_composite_lm(model_type, **text_overrides)
    check_policy_forward(model)
    assert logit_map(model) == logit_maps.LogitMap()
    if model_type == "gemma3":
        text_only = tiny_causal_lm("gemma3_text", **text_overrides)
        check_policy_forward(text_only)
        assert logit_map(text_only) == logit_maps.LogitMap(softcap=0.5)
    for engine in (LeanSampler(), StaticCacheSampler(), HFGenerate()):
        torch.manual_seed(0)
        batch = engine.sample(
            model,
            [[5, 6, 7, 8], [3, 4]],
            num_generations=2,
            max_new_tokens=4,
            pad_id=0,
            eos_id=[1, 7],
            return_logprobs=True,
        )
        with torch.no_grad():
            trained = token_logprobs(model, batch).logprobs
        assert (trained - batch.engine_logprobs)[batch.completion_mask].abs().max() <= 1e-5, type(engine).__name__


def test_the_reference_policy_gets_the_logit_map_the_policy_was_checked_with(tmp_path):
    """The frozen reference is copied before the load check; it is checked too, so the KL to it is computed with the
    logit map its forward applies (a saved Gemma 3 whose text config names a soft cap its forward ignores)."""
    from lit_gspo.lightning.cli import cli_main
    from lit_gspo.models import char_tokenizer

    model = tiny_composite_lm("gemma3", vocab_size=128, final_logit_softcapping=0.5)
    model.save_pretrained(tmp_path / "gemma3")
    char_tokenizer().save_pretrained(tmp_path / "gemma3")
    args = ["--config", "configs/quickstart.yaml", "--model.policy.name", str(tmp_path / "gemma3")]
    args += ["--model.policy.config", "{}", "--trainer.default_root_dir", str(tmp_path / "run")]
    cli = cli_main(args, run=False)
    assert isinstance(cli.model.ref_policy, torch.nn.Module) and cli.model.ref_policy is not cli.model.policy
    assert logit_map(cli.model.ref_policy) == logit_map(cli.model.policy) == logit_maps.LogitMap()
