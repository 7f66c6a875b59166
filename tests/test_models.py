"""Model layer: char tokenizer, tiny built-ins, load_policy resolution, LoRA, helpers."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lit_gspo.models import (
    apply_lora,
    char_tokenizer,
    count_parameters,
    enable_gradient_checkpointing,
    load_policy,
    merged_for_saving,
    reference_mode,
)

TEXT = "Q: 12+7=?\nA: (19) 'ok' \"x_y\" #!;<>[]-*/"


def logprobs(model, batch):
    logits = model(**batch).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def test_char_tokenizer_roundtrip(tmp_path):
    tok = char_tokenizer()
    ids = tok(TEXT).input_ids
    assert len(ids) == len(TEXT) and tok.unk_token_id not in ids
    assert tok.decode(ids) == TEXT
    assert tok.pad_token_id != tok.eos_token_id
    assert {tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token} == {"<pad>", "<bos>", "<eos>", "<unk>"}
    assert tok.chat_template is None
    assert tok.decode(tok("é").input_ids) == "<unk>"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(TEXT).input_ids == ids and again.pad_token_id == tok.pad_token_id


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_builtin_forward_generate_and_roundtrip(name, tmp_path):
    model, tok = load_policy(name, seed=3)
    again, _ = load_policy(name, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
    batch = tok(["1+2=", "10+20="], return_tensors="pt", padding=True)
    assert tok.padding_side == "left"
    model.eval()
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch.input_ids.shape[1] + 4)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_policy(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(logprobs(loaded.eval(), batch), logprobs(model, batch))
    assert tok2(TEXT).input_ids == tok(TEXT).input_ids
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(plain) is type(model)


def test_config_overrides_and_dtype():
    model, _ = load_policy("tiny-llama", config_overrides={"num_hidden_layers": 1, "hidden_size": 32}, dtype="bf16")
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        load_policy("tiny-llama", dtype="float8")


@pytest.mark.parametrize("source", ["built-in", "pretrained"])
def test_loading_arguments_in_the_config_overrides_are_refused_naming_their_setting(source, tmp_path):
    """TRL's ``model_init_kwargs: {torch_dtype: bfloat16}`` habit: a pretrained model's load failed on a keyword given
    twice (``dtype``, ``trust_remote_code``), a built-in model ignored them all (its parameters stayed fp32)."""
    from lit_gspo.models.loading import LOADING_ARGUMENTS

    name = "tiny-llama"
    if source == "pretrained":
        model, tok = load_policy(name)
        model.save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
        name = str(tmp_path)
    setting = {"dtype": "--trainer.precision", "torch_dtype": "--trainer.precision"}
    for key in LOADING_ARGUMENTS:
        with pytest.raises(ValueError, match=rf"--model.policy.config \['{key}'\]: .*{setting.get(key, key)}"):
            load_policy(name, config_overrides={"num_hidden_layers": 1, key: "bfloat16"})
    if source == "pretrained":  # a loading argument lit_gspo sets too, where the hub is unreachable: given once
        model, _ = load_policy(name, config_overrides={"local_files_only": True})
        assert next(model.parameters()).dtype == torch.float32


def test_pad_token_fallback(tmp_path, caplog):
    tok = char_tokenizer()
    tok.pad_token = None
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    model.config.pad_token_id = None
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lit_gspo.models.loading"):
        loaded, tok2 = load_policy(str(tmp_path))
    assert tok2.pad_token == tok2.eos_token == "<eos>"
    assert loaded.config.pad_token_id == tok2.eos_token_id
    assert "no pad token" in caplog.text


@pytest.mark.parametrize("name", ["tiny_lama", "./no/such/dir", "missing.gguf"])
def test_unknown_name_lists_builtins(name):
    with pytest.raises(ValueError, match="tiny-llama.*tiny-qwen3-moe"):
        load_policy(name)


def test_lora_trainable_reference_and_merge(tmp_path):
    base, tok = load_policy("tiny-llama", seed=0)
    batch = tok(["12+34=46", "5*5=25"], return_tensors="pt", padding=True)
    with torch.no_grad():
        base_lp = logprobs(base.eval(), batch)
    total_before = count_parameters(base).total
    model = apply_lora(base, r=4, alpha=8)
    counts = count_parameters(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert counts.total > total_before and 0 < counts.trainable < counts.total
    # make the adapters non-trivial (lora_B starts at zero)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    model.eval()
    with torch.no_grad():
        adapted = logprobs(model, batch)
        with reference_mode(model):
            ref = logprobs(model, batch)
        assert torch.allclose(ref, base_lp, atol=1e-6)
        assert not torch.allclose(adapted, base_lp, atol=1e-3)
        assert torch.equal(logprobs(model, batch), adapted)  # adapters back on after the context
    merged = merged_for_saving(model)
    assert not hasattr(merged, "peft_config") and any("lora_" in n for n, _ in model.named_parameters())
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(logprobs(reloaded, batch), adapted, atol=1e-5)
    with pytest.raises(TypeError, match="LoRA"):
        with reference_mode(reloaded):
            pass


def test_lora_bad_targets_lists_linear_modules():
    model, _ = load_policy("tiny-llama")
    with pytest.raises(ValueError, match="q_proj"):
        apply_lora(model, target_modules=("nope",))


def test_gradient_checkpointing_lora_backward():
    model, tok = load_policy("tiny-qwen3-moe")
    model = apply_lora(model, r=2)
    enable_gradient_checkpointing(model)
    model.train()
    batch = tok(["1+1=2"], return_tensors="pt")
    logprobs(model, batch).sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
