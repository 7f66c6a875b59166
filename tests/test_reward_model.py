"""RewardModel: a sequence-classification model's logit as the reward, batched, on a tiny model built from a config."""

import shutil
import warnings

import pytest
import torch
from test_remote_code import with_own_code
from tokenizers.processors import TemplateProcessing
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


def with_tokenizer(tmp_path, reward_dir, tok):
    """The reward model of ``reward_dir`` saved with another tokenizer."""
    path = tmp_path / "rm"
    shutil.copytree(reward_dir, path)
    tok.save_pretrained(path)
    return str(path)


def last_token_scores(path, rows, label):
    """The reference by ids: each row alone, the logit read at its last token (no pad id to look for)."""
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = None
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([row])).logits[0, label]) for row in rows]


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
    with pytest.raises(ValueError, match="max_length must be >= 1 or None .*got 0"):
        RewardModel(reward_dir, max_length=0)
    with pytest.raises(ValueError, match="label 2 is out of range.*num_labels=2"):
        RewardModel(reward_dir, label=2, device="cpu")(PROMPTS, COMPLETIONS)


def bos_tokenizer():
    """The char tokenizer with a BOS put before every text, as Llama's tokenizers do."""
    tok = char_tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return tok


def test_a_text_gets_the_special_tokens_its_tokenizer_adds(tmp_path, reward_dir):
    path = with_tokenizer(tmp_path, reward_dir, bos_tokenizer())
    rm = RewardModel(path, batch_size=2, device="cpu")
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    with_bos = [bos_tokenizer()(t)["input_ids"] for t in texts]
    assert all(row[0] == 1 and row[1] != 1 for row in with_bos)
    assert [rm.token_ids(p, c) for p, c in zip(PROMPTS, COMPLETIONS)] == with_bos
    scores = rm(PROMPTS, COMPLETIONS)
    assert scores == pytest.approx(last_token_scores(path, with_bos, 0), abs=1e-5)
    without_bos = last_token_scores(path, [row[1:] for row in with_bos], 0)
    assert all(abs(a - b) > 1e-4 for a, b in zip(scores, without_bos))  # the BOS moves every score


def test_a_conversation_gets_only_the_special_tokens_its_template_writes(tmp_path, reward_dir):
    tok = bos_tokenizer()
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    rm = RewardModel(with_tokenizer(tmp_path, reward_dir, tok), device="cpu")
    ids = rm.token_ids([{"role": "user", "content": "rev 12="}], "21")
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", *"u: rev 12=\na: 21\n"]  # one BOS: the template's


@pytest.mark.parametrize("pad", [None, "<eos>"])
def test_the_score_is_read_at_the_last_token_whatever_the_pad(tmp_path, reward_dir, pad):
    """No pad token (a Llama tokenizer) or the pad set to the EOS a text ends with: each text scores as it does
    alone, read at its last token."""
    tok = char_tokenizer()
    tok.pad_token = pad
    path = with_tokenizer(tmp_path, reward_dir, tok)
    completions = [c + "<eos>" for c in COMPLETIONS[:2]] + COMPLETIONS[2:]
    rm = RewardModel(path, batch_size=3, device="cpu")
    rows = [rm.token_ids(p, c) for p, c in zip(PROMPTS, completions)]
    assert [row[-1] for row in rows] == [2, 2, tok.convert_tokens_to_ids("k")]
    assert rm(PROMPTS, completions) == pytest.approx(last_token_scores(path, rows, 0), abs=1e-5)


def test_a_text_longer_than_max_length_is_scored_on_its_start_with_a_warning(reward_dir):
    rm = RewardModel(reward_dir, batch_size=3, device="cpu", max_length=9)
    rows = [rm.token_ids(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    with pytest.warns(UserWarning, match="2 of 3 texts are longer than max_length 9 tokens \\(the longest 22\\)"):
        scores = rm(PROMPTS, COMPLETIONS)
    assert [len(row) for row in rows] == [11, 8, 22]
    assert scores == pytest.approx(last_token_scores(reward_dir, [row[:9] for row in rows], 0), abs=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm(PROMPTS[1:2], COMPLETIONS[1:2])  # none too long: no warning


def test_a_pair_model_reads_the_prompt_and_the_completion_as_a_text_pair(tmp_path, reward_dir):
    """As a DeBERTa reward model's card scores: ``tokenizer(question, answer)``, [CLS] q [SEP] a [SEP]."""
    tok = char_tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> $B:1 <eos>:1", special_tokens=[("<bos>", 1), ("<eos>", 2)]
    )
    path = with_tokenizer(tmp_path, reward_dir, tok)
    paired = RewardModel(path, device="cpu", pair=True, batch_size=2)
    rows = [paired.token_ids(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert tok.convert_ids_to_tokens(rows[1]) == ["<bos>", *"rev 45=", "<eos>", "5", "<eos>"]
    scores = paired(PROMPTS, COMPLETIONS)
    assert scores == pytest.approx(last_token_scores(path, rows, 0), abs=1e-5)
    joined = RewardModel(path, device="cpu")(PROMPTS, COMPLETIONS)  # [CLS] q a [SEP]: another input, another score
    assert all(abs(a - b) > 1e-4 for a, b in zip(scores, joined))
    with pytest.raises(ValueError, match="pair=True, which scores .* text pairs, but a prompt is a list of chat"):
        paired([[{"role": "user", "content": "hi"}]], ["x"])


def test_a_fit_scores_with_a_reward_model_written_as_the_error_for_trls_model_id_says(tmp_path, reward_dir, capsys):
    """TRL's ``reward_funcs`` takes a model id; lit_gspo's ``model.rewards`` names the RewardModel class, and says so
    in one line when given an id. The form it suggests runs a fit."""
    from pathlib import Path

    from lit_gspo.tools.main import cli_main, main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    base = ["--config", config, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1"]
    base += ["--model.policy.warm_start.steps", "0", "--data.num_val", "4", "--data.prompts_per_step", "2"]
    base += ["--trainer.enable_progress_bar", "false"]
    with pytest.raises(SystemExit):
        main(["fit", *base, "--model.rewards", f"[{reward_dir}]"])
    error = capsys.readouterr().err
    suggested = f"{{class_path: lit_gspo.rl.rewards.RewardModel, init_args: {{model: {reward_dir}}}}}"
    assert f"a reward model (TRL's reward_funcs takes its id) is {suggested}" in error
    cli = cli_main([*base, "--model.rewards", f"[{suggested}]"], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    import csv
    import math

    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    scored = [float(r["train/rewards/reward_model/mean"]) for r in rows if r.get("train/rewards/reward_model/mean")]
    assert len(scored) == 1 and math.isfinite(scored[0])


def test_a_sequence_classification_model_given_as_a_reward_function_scores_as_trl_scores_one(reward_dir):
    """TRL's reward_funcs takes the model itself: RewardSet wraps it in a RewardModel (its tokenizer from its
    name_or_path, or given), which scores as the same model named by its directory."""
    model = LlamaForSequenceClassification.from_pretrained(reward_dir)
    scores = RewardSet([model]).score(PROMPTS, COMPLETIONS, {})
    assert list(scores.per_function) == ["reward_model"]
    assert scores.total.tolist() == pytest.approx(RewardModel(reward_dir, device="cpu")(PROMPTS, COMPLETIONS), abs=1e-5)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config._name_or_path = ""  # built in memory, not loaded
    nameless = LlamaForSequenceClassification(config)
    with pytest.raises(ValueError, match="without a name_or_path to load its tokenizer from: give its tokenizer"):
        RewardSet([nameless])
    given = RewardModel(nameless, tokenizer=char_tokenizer())
    assert given(PROMPTS, COMPLETIONS) == pytest.approx(one_by_one_model(nameless, PROMPTS, COMPLETIONS), abs=1e-5)


def one_by_one_model(model, prompts, completions):
    tok = char_tokenizer()
    with torch.no_grad():
        return [
            float(model.eval()(**tok(p + c, return_tensors="pt")).logits[0, 0]) for p, c in zip(prompts, completions)
        ]


def test_a_reward_model_with_its_own_code_loads_only_when_trusted_and_then_scores_as_its_base_class(
    reward_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)  # transformers would ask on a terminal
    remote = tmp_path / "rm"
    shutil.copytree(reward_dir, remote)
    name = with_own_code(remote, "LlamaForSequenceClassification", "AutoModelForSequenceClassification")
    with pytest.raises(ValueError) as refused:
        RewardModel(str(remote), device="cpu")(PROMPTS, COMPLETIONS)
    assert str(refused.value) == (
        f"RewardModel {str(remote)!r}: its config maps it to Python of its own (auto_map), which runs only with "
        "RewardModel(trust_remote_code=True) (TRL's trust_remote_code; only for a source you trust)"
    )
    trusted = RewardModel(str(remote), device="cpu", trust_remote_code=True)
    scores = trusted(PROMPTS, COMPLETIONS)
    assert type(trusted._model).__name__ == name
    assert scores == pytest.approx(RewardModel(reward_dir, device="cpu")(PROMPTS, COMPLETIONS), abs=1e-6)
