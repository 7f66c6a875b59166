"""Issue 39: every error names the option to type, with the value as the user wrote it (``--data.answer_column
ground_truth``, not ``answer_column=None``), and ``save_to_disk`` directories load as ``--data.train_source DIR``."""

import json

import pytest

from lit_gspo.data.prompts import encode_prompts, load_prompt_rows, prompt_length_limit
from lit_gspo.lightning.datamodule import PromptDataModule
from lit_gspo.models.tokenizer import char_tokenizer
from lit_gspo.rl.config import Generation
from lit_gspo.rl.rewards import CharAccuracy, ExactMatch, RewardSet
from lit_gspo.runtime.user_errors import option


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_option_writes_a_setting_as_it_is_typed():
    assert option("data.answer_column", "ground_truth") == "--data.answer_column ground_truth"
    assert option("data.answer_column", None) == "--data.answer_column null"
    assert (
        option("model.environment.init_args.chat_template", True) == "--model.environment.init_args.chat_template true"
    )
    assert option("model.reward_weights", [1.0, 0.5]) == "--model.reward_weights [1.0, 0.5]"
    assert option("data.train_source", "my data.jsonl") == "--data.train_source 'my data.jsonl'"
    assert option("data.val_source") == "--data.val_source"


@pytest.mark.parametrize("column", ["ground_truth", "solution", "label"])
def test_a_missing_answer_column_names_the_option_and_suggests_the_obvious_column(tmp_path, column):
    """Before: ``Set prompt_column / answer_column (answer_column=None for data without answers)``."""
    path = jsonl(tmp_path / "trl.jsonl", [{"prompt": "2+2=", column: "4"}])
    with pytest.raises(ValueError) as err:
        load_prompt_rows(path)
    text = str(err.value)
    assert "(--data.answer_column answer)" in text and f"--data.answer_column {column}" in text
    assert "--data.answer_column null for data without answers" in text and "answer_column=" not in text
    assert load_prompt_rows(path, answer_column=column)[0]["answer"] == "4"  # what the message says works


def test_a_missing_prompt_column_suggests_one_or_says_what_to_type(tmp_path):
    path = jsonl(tmp_path / "q.jsonl", [{"question": "2+2=", "answer": "4"}])
    with pytest.raises(
        ValueError,
        match=r"has no column 'prompt' \(--data.prompt_column prompt\).*"
        r"look like column 'question': --data.prompt_column question",
    ):
        load_prompt_rows(path)
    path = jsonl(tmp_path / "odd.jsonl", [{"zzz": "2+2=", "answer": "4"}])
    with pytest.raises(ValueError, match=r"Name the column holding the prompts: --data.prompt_column COLUMN"):
        load_prompt_rows(path)


def test_chat_prompts_without_a_template_name_the_options():
    tok = char_tokenizer()  # no chat template
    messages = [[{"role": "user", "content": "hi"}]]
    with pytest.raises(ValueError) as err:
        encode_prompts(tok, messages, max_prompt_length=64)
    text = str(err.value)
    assert "has no chat template" in text and "--model.policy.name" in text and "--data.prompt_column" in text
    assert "chat_template=" not in text
    with pytest.raises(ValueError) as err:
        encode_prompts(tok, ["hi"], chat_template=True, max_prompt_length=64)
    text = str(err.value)
    assert text.startswith("--model.environment.init_args.chat_template true, but")
    assert "--model.environment.init_args.chat_template null" in text
    assert "--model.environment.init_args.chat_template false" in text


def test_the_prompt_length_error_reports_the_configured_value_and_why_less_is_left():
    """Before: ``longer than max_prompt_length=250`` for a config saying 256 (the context less the completion)."""
    tok = char_tokenizer()
    generation = Generation(max_prompt_length=256, max_new_tokens=6)
    limit = prompt_length_limit(generation, context=256)
    assert limit == 250
    with pytest.raises(ValueError) as err:
        encode_prompts(tok, ["x" * 251], max_prompt_length=limit)
    text = str(err.value)
    assert "--model.generation.max_prompt_length 256" in text and "--model.generation.max_new_tokens 6" in text
    assert "context of 256 tokens" in text and "leaves 250" in text and "=250" not in text
    # the setting itself is the limit: named with its value
    limit = prompt_length_limit(Generation(max_prompt_length=8, max_new_tokens=6), context=2048)
    with pytest.raises(ValueError, match=r"longer than --model.generation.max_prompt_length 8: raise it"):
        encode_prompts(tok, ["x" * 9], max_prompt_length=limit)


def test_mismatched_reward_weights_name_both_options():
    """Before: ``RewardSet got 1 weights for 2 functions``."""
    with pytest.raises(ValueError) as err:
        RewardSet([CharAccuracy(), ExactMatch()], weights=[1.0])
    text = str(err.value)
    assert text.startswith("--model.reward_weights [1.0] gives 1 weight for the 2 reward functions of --model.rewards")
    assert "char_accuracy, exact_match" in text and "--model.reward_weights null" in text


def test_data_module_errors_name_options_with_values(tmp_path):
    with pytest.raises(ValueError, match=r"--data.prompts_per_step 0: must be >= 1"):
        PromptDataModule("reversal", prompts_per_step=0)
    with pytest.raises(ValueError, match=r"--data.val_fraction 1.5: must be in \(0, 1\)"):
        PromptDataModule("reversal", val_fraction=1.5)
    with pytest.raises(
        ValueError,
        match=r"task 'reversal' \(--data.task_kwargs \{min_length: 1, max_length: 1\}\) has only 10 .*"
        r"cannot draw --data.num_train 20",
    ):
        PromptDataModule("reversal", task_kwargs={"min_length": 1, "max_length": 1}, num_train=20, num_val=2).setup()
    # options that no prompt satisfies are named as such, not as a task of 0 prompts
    with pytest.raises(
        ValueError, match=r"^--data.task_kwargs \{min_length: 3, max_length: 2\}: need 1 <= min_length <= max_length$"
    ):
        PromptDataModule("reversal", task_kwargs={"min_length": 3, "max_length": 2}, num_train=8, num_val=2).setup()


# ------------------------------------------------------------------------------------------- save_to_disk
def rows(n, start=0):
    return {
        "prompt": [f"rev {i:03d}=" for i in range(start, start + n)],
        "answer": [f"{i:03d}"[::-1] for i in range(start, start + n)],
    }


def test_a_dataset_saved_with_save_to_disk_loads_as_train_source(tmp_path):
    """Before: ``Please use load_from_disk instead``."""
    from datasets import Dataset

    path = tmp_path / "saved"
    Dataset.from_dict(rows(20)).save_to_disk(str(path))
    dm = PromptDataModule(str(path), prompts_per_step=4, num_val=4)
    dm.setup()
    assert len(dm.train_rows) == 18 and len(dm.val_rows) == 2  # one split: rows held out for validation
    assert (
        dm.train_rows[0]["prompt"].startswith("rev ")
        and dm.train_rows[0]["answer"] == dm.train_rows[0]["prompt"][4:7][::-1]
    )


def test_a_dataset_dict_saved_with_save_to_disk_gives_train_and_val_from_its_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    path = tmp_path / "saved_dict"
    DatasetDict({"train": Dataset.from_dict(rows(12)), "test": Dataset.from_dict(rows(3, start=500))}).save_to_disk(
        str(path)
    )
    dm = PromptDataModule(str(path), prompts_per_step=4)
    dm.setup()
    assert len(dm.train_rows) == 12 and [r["prompt"] for r in dm.val_rows] == ["rev 500=", "rev 501=", "rev 502="]
    with pytest.raises(ValueError, match=r"has no split 'dev'.*\['test', 'train'\].*--data.train_split"):
        load_prompt_rows(str(path), split="dev")
