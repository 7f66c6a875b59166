"""RewardModel: a sequence-classification model's logit as the reward, batched, on a tiny model built from a config."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.rewards import RewardModel, RewardSet


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    torch.manual_seed(0)
    tok = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_labels=2,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def one_by_one(path, texts, label):
    """The reference: each text alone (no padding), the logit read at its last token."""
    tok = char_tokenizer()
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, label]) for t in texts]


PROMPTS = ["rev 123=", "rev 45=", "what is 2+2?"]
COMPLETIONS = ["321", "5", "4, I think"]


@pytest.mark.parametrize("label", [0, 1])
def test_batched_scores_equal_each_text_alone(reward_dir, label):
    rm = RewardModel(reward_dir, label=label, batch_size=2, device="cpu")  # 2 + 1: padding in the first batch
    scores = rm(PROMPTS, COMPLETIONS)
    expected = one_by_one(reward_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)], label)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 3  # the texts are told apart
    assert rm(PROMPTS[:1], COMPLETIONS[:1]) == pytest.approx(scores[:1], abs=1e-5)  # batch size does not matter


def test_chat_prompts_without_template_are_joined(reward_dir):
    rm = RewardModel(reward_dir, device="cpu")
    chat = [[{"role": "user", "content": p}] for p in PROMPTS]
    assert rm(chat, COMPLETIONS) == pytest.approx(rm(PROMPTS, COMPLETIONS), abs=1e-6)


def test_reward_set_names_and_weights_it(reward_dir):
    rm = RewardModel(reward_dir, device="cpu", weight=0.5)
    scores = RewardSet([rm], [0.5]).score(PROMPTS, COMPLETIONS, {})
    assert "reward_model" in scores.per_function
    assert scores.total.tolist() == pytest.approx([0.5 * s for s in rm(PROMPTS, COMPLETIONS)], abs=1e-5)


def test_bad_settings_name_the_value(reward_dir):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        RewardModel(reward_dir, dtype="fp8")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        RewardModel(reward_dir, batch_size=0)
    with pytest.raises(ValueError, match="label 2 is out of range.*num_labels=2"):
        RewardModel(reward_dir, label=2, device="cpu")(PROMPTS, COMPLETIONS)
