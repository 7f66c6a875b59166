import glob
import json
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from lit_gspo.data import TASKS, encode_prompts, is_held_out, load_prompt_rows, make_task, sft_examples, task_splits
from lit_gspo.lightning.datamodule import PromptDataModule, ResumableSampler


# ---------------------------------------------------------------- synthetic tasks
@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_deterministic_and_disjoint(name):
    train, val = task_splits(name, 50, 20, seed=3)
    assert (train, val) == task_splits(name, 50, 20, seed=3)
    assert train != task_splits(name, 50, 20, seed=4)[0]
    prompts = [r["prompt"] for r in train]
    assert len(set(prompts)) == 50 and not set(prompts) & {r["prompt"] for r in val}
    assert all(is_held_out(r["prompt"]) for r in val) and not any(is_held_out(p) for p in prompts)
    # held-out membership does not depend on the seed or the sizes: other draws never leak across
    other_val = task_splits(name, 5, 30, seed=9)[1]
    assert not set(prompts) & {r["prompt"] for r in other_val}
    assert make_task(name, 10, seed=3) == train[:10]
    columns = {"prompt", "answer"} | {"arithmetic": {"expression"}, "hidden_rule": {"rule", "string"}}.get(name, set())
    assert all(set(r) == columns and isinstance(r["answer"], str) for r in train + val)


def test_answers_are_correct():
    for row in make_task("arithmetic", 200, seed=0, digits=2, ops="+-*", negative=True):
        assert str(eval(row["prompt"].rstrip("="))) == row["answer"]  # noqa: S307 — operands and ops are generated here
    assert all(int(r["answer"]) >= 0 for r in make_task("arithmetic", 200, seed=0, ops="-"))
    for row in make_task("reversal", 50, seed=0, alphabet="abc12"):
        assert row["answer"] == row["prompt"][len("rev ") : -1][::-1]
    for row in make_task("sorting", 50, seed=0):
        assert row["answer"] == "".join(sorted(row["prompt"][len("sort ") : -1]))
    for row in make_task("counting", 50, seed=0):
        _, c, _, s = row["prompt"].rstrip("=").split(" ")
        assert row["answer"] == str(s.count(c))
    rows = make_task("hidden_rule", 300, seed=0)
    by_rule = {"keep": lambda x: x, "reverse": lambda x: x[::-1], "rotate": lambda x: x[1:] + x[0]}
    for row in rows:
        assert row["prompt"] == f"? {row['string']}=" and row["answer"] == by_rule[row["rule"]](row["string"])
    assert {r["rule"] for r in rows} == set(by_rule)  # each drawn, from the row's own draw
    assert {r["rule"] for r in make_task("hidden_rule", 50, seed=0, rules="keep,rotate")} == {"keep", "rotate"}
    row = make_task("arithmetic", 1, template="What is {a} {op} {b}? ")[0]
    assert row["prompt"].startswith("What is ") and sft_examples([row]) == [(row["prompt"], row["answer"])]


@pytest.mark.parametrize(
    "task_kwargs, setting",
    [({"seed": 3}, "seed: --data.seed"), ({"n": 5}, "n: --data.num_train and --data.num_val"), ({"digit": 1}, None)],
)
@pytest.mark.parametrize("val_source", [None, "arithmetic"])
def test_a_tasks_options_are_checked_when_the_data_module_is_built(task_kwargs, setting, val_source):
    """Not at the first batch, after the model and its warm start; the loader's own arguments (``seed``, ``n``) were a
    TypeError there ("got multiple values for keyword argument 'seed'"), with its traceback."""
    with pytest.raises(ValueError, match=r"synthetic task 'arithmetic' got unknown options") as error:
        PromptDataModule(train_source="arithmetic", val_source=val_source, task_kwargs={"digits": 1, **task_kwargs})
    assert (setting in str(error.value)) if setting else "set by other settings" not in str(error.value)


def test_validation_draws_a_tasks_prompts_with_options_of_its_own():
    """``val_task_kwargs``: validation on longer strings than training's (length generalisation), or on another
    task's options; without it, validation takes training's options, its rows as they were."""
    three, five = {"min_length": 3, "max_length": 3}, {"min_length": 5, "max_length": 5}
    same = PromptDataModule("reversal", task_kwargs=three, num_train=16, num_val=8, prompts_per_step=4, seed=1)
    longer = PromptDataModule(
        "reversal", task_kwargs=three, val_task_kwargs=five, num_train=16, num_val=8, prompts_per_step=4, seed=1
    )
    same.setup(), longer.setup()
    assert longer.train_rows == same.train_rows == task_splits("reversal", 16, 8, seed=1, **three)[0]
    assert same.val_rows == task_splits("reversal", 16, 8, seed=1, **three)[1]
    assert longer.val_rows == task_splits("reversal", 16, 8, seed=1, **five)[1]
    assert {len(r["answer"]) for r in longer.train_rows} == {3} and {len(r["answer"]) for r in longer.val_rows} == {5}
    # another task for validation, with options that training's task does not take
    mixed = PromptDataModule(
        "arithmetic", val_source="reversal", task_kwargs={"digits": 1}, val_task_kwargs=three, num_train=16, num_val=4
    )
    mixed.setup()
    assert all(r["prompt"].startswith("rev ") and len(r["answer"]) == 3 for r in mixed.val_rows)
    assert all(len(r["expression"].split()[0]) == 1 for r in mixed.train_rows)


def test_the_errors_of_validations_task_options_name_the_setting_they_came_from(tmp_path):
    with pytest.raises(ValueError, match=r"task 'reversal' got unknown options \['digits'\] \(--data.val_task_kwargs"):
        PromptDataModule("reversal", val_task_kwargs={"digits": 2})
    with pytest.raises(ValueError, match=r"task 'reversal' got unknown options \['digits'\] \(--data.task_kwargs") as e:
        PromptDataModule("arithmetic", val_source="reversal", task_kwargs={"digits": 1})  # training's, inherited
    assert str(e.value).endswith("validation's task 'reversal' takes options of its own as --data.val_task_kwargs")
    small = {"min_length": 1, "max_length": 1}  # 10 strings, 2 or so held out
    with pytest.raises(ValueError, match=r"\(--data.val_task_kwargs \{min_length: 1, max_length: 1\}\) has only 10 "):
        PromptDataModule("reversal", val_task_kwargs=small, num_train=8, num_val=12).setup()
    with pytest.raises(ValueError, match=r"\(--data.task_kwargs \{min_length: 1, max_length: 1\}\) has only 10 "):
        PromptDataModule("reversal", task_kwargs=small, val_task_kwargs={}, num_train=20, num_val=5).setup()
    with pytest.raises(ValueError, match=r"--data.val_task_kwargs \{alphabet: ''\}: the alphabet must be non-empty"):
        PromptDataModule("reversal", val_task_kwargs={"alphabet": ""}, num_train=8, num_val=5).setup()
    val_file = tmp_path / "val.jsonl"
    val_file.write_text(json.dumps({"prompt": "rev 12=", "answer": "21"}) + "\n")
    with pytest.raises(
        ValueError,
        match=r"--data.val_task_kwargs \{min_length: 2\}: options of a built-in task .*"
        r"validation's prompts come from '.*val.jsonl'",
    ):
        PromptDataModule("reversal", val_source=str(val_file), val_task_kwargs={"min_length": 2})


def test_task_errors_name_values():
    with pytest.raises(ValueError, match=r"unknown synthetic task 'nope'.*'arithmetic'"):
        make_task("nope", 3)
    with pytest.raises(ValueError, match=r"unknown options \['digit'\].*'digits'"):
        make_task("arithmetic", 3, digit=2)
    with pytest.raises(ValueError, match="only 155 distinct prompts.*--data.num_train 300"):
        task_splits("arithmetic", 300, 10, digits=1)
    with pytest.raises(ValueError, match="two or more of keep, reverse, rotate.*got 'keep,flip'"):
        make_task("hidden_rule", 3, rules="keep,flip")
    with pytest.raises(ValueError, match="found only .* validation prompts for the --data.num_val 100 asked for"):
        task_splits("arithmetic", 10, 100, digits=1)


# ---------------------------------------------------------------- loading rows
ROWS = [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(10)]


def write(tmp_path, fmt):
    import pandas as pd

    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)
    else:
        pd.DataFrame(ROWS).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_load_local_files(tmp_path, fmt):
    path = write(tmp_path, fmt)
    rows = load_prompt_rows(str(path), prompt_column="question", answer_column="solution")
    assert [r["prompt"] for r in rows] == [f"q{i}" for i in range(10)]
    assert rows[3]["answer"] == "3" and rows[4]["level"] == ("1" if fmt == "csv" else 1)  # a CSV cell is text
    assert rows[0]["question"] == "q0" and rows[0]["solution"] == "0"  # each column also under its own name
    subset = load_prompt_rows(str(path), prompt_column="question", answer_column="solution", n=4, seed=1)
    assert len(subset) == 4 and subset == load_prompt_rows(
        str(path), prompt_column="question", answer_column="solution", n=4, seed=1
    )
    no_answer = load_prompt_rows(str(path), prompt_column="question", answer_column=None)
    assert "answer" not in no_answer[0] and no_answer[0]["solution"] is not None


def test_load_directory_split(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "b", "answer": "2"}) + "\n")
    assert load_prompt_rows(str(tmp_path), split="test") == [{"prompt": "b", "answer": "2"}]


def test_missing_column_names_available(tmp_path):
    path = write(tmp_path, "jsonl")
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['question', 'solution', 'level'\]"):
        load_prompt_rows(str(path))
    with pytest.raises(ValueError, match=r"no column 'answer'"):
        load_prompt_rows(str(path), prompt_column="question")


@pytest.mark.parametrize(
    "prompt, what",
    [
        ("", "empty"),
        ("  \n", "empty"),
        (None, "neither a string"),
        (7, "neither a string"),
        ([], "empty"),
        (["hi"], "neither a string"),
        ([{"role": "user"}], "neither a string"),
    ],
)
def test_a_bad_prompt_row_is_refused_at_load_naming_file_and_row(tmp_path, prompt, what):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": "fine", "answer": "2"}, {"prompt": prompt, "answer": "3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"{path}.* row 2: the prompt is {what}"):
        load_prompt_rows(str(path))
    messages = [{"role": "user", "content": "hi"}]  # a list of chat messages is a prompt
    path.write_text(json.dumps({"prompt": messages, "answer": None}) + "\n")
    assert load_prompt_rows(str(path)) == [{"prompt": messages, "answer": None}]


def test_unknown_source_error_is_clear(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time by both libraries, so patch them too
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"'no-such/dataset-xyz' is neither a built-in task.*HF_HUB_OFFLINE"):
        load_prompt_rows("no-such/dataset-xyz")


def test_load_task_rows():
    assert load_prompt_rows("counting", "validation", n=5, seed=2) == task_splits("counting", 1, 5, seed=2)[1]
    with pytest.raises(ValueError, match="needs n"):
        load_prompt_rows("counting")


# ---------------------------------------------------------------- encoding
def char_tokenizer(chat_template=None):
    chars = "abcdefghijklmnopqrstuvwxyz0123456789 +-=:<>|/\n"
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *chars])}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = chat_template
    return tok


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def test_encode_with_chat_template():
    tok = char_tokenizer(TEMPLATE)
    ids = encode_prompts(tok, ["1+2="], max_prompt_length=64, system_prompt="be brief")
    assert tok.decode(ids[0]) == "<s>be brief\n<u>1+2=\n<a>"
    assert (
        tok.decode(encode_prompts(tok, [[{"role": "user", "content": "hi"}]], max_prompt_length=64)[0]) == "<u>hi\n<a>"
    )
    raw = encode_prompts(tok, ["1+2="], chat_template=False, max_prompt_length=64)
    assert tok.decode(raw[0]) == "1+2="


def test_encode_without_chat_template():
    tok = char_tokenizer()
    ids = encode_prompts(tok, ["rev 123=", "ab"], max_prompt_length=8, system_prompt=None)
    assert [tok.decode(x) for x in ids] == ["rev 123=", "ab"] and len(ids[0]) == 8
    assert tok.decode(encode_prompts(tok, ["ab"], max_prompt_length=8, system_prompt="s")[0]) == "s\nab"
    with pytest.raises(
        ValueError, match=r"--model.environment.init_args.chat_template true, but .* has no chat template"
    ):
        encode_prompts(tok, ["ab"], chat_template=True, max_prompt_length=8)


@pytest.mark.parametrize(
    "template, expected",
    [
        ("<bos> $A <eos>", ["<bos>", "a", "b"]),  # add_eos_token: the EOS goes, the BOS stays
        ("$A <eos>", ["a", "b"]),
        ("<bos> $A", ["<bos>", "a", "b"]),
        ("$A", ["a", "b"]),
        ("<eos> $A <eos>", ["<eos>", "a", "b"]),  # OPT's BOS is its EOS token: the leading one stays
    ],
)
def test_a_text_prompt_keeps_the_tokenizers_bos_but_never_ends_with_an_eos_it_appends(template, expected):
    from tokenizers.processors import TemplateProcessing

    from lit_gspo.models.tokenizer import char_tokenizer as char_tok

    tok = char_tok()
    specials = [(t, tok.convert_tokens_to_ids(t)) for t in ("<bos>", "<eos>") if t in template]
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=template, special_tokens=specials)
    if template.startswith("<eos>"):
        tok.bos_token = "<eos>"
    (ids,) = encode_prompts(tok, ["ab"], chat_template=False, max_prompt_length=16)
    assert tok.convert_ids_to_tokens(ids) == expected
    (empty,) = encode_prompts(tok, [""], chat_template=False, max_prompt_length=16)
    assert tok.convert_ids_to_tokens(empty) == expected[:-2]


def test_too_long_prompt_raises():
    with pytest.raises(ValueError, match="prompt 1 is 9 tokens, longer than --model.generation.max_prompt_length 8"):
        encode_prompts(char_tokenizer(), ["ab", "rev 1234="], max_prompt_length=8)


# ---------------------------------------------------------------- datamodule
def datamodule(**kw):
    kw = {
        "train_source": "reversal",
        "num_train": 20,
        "num_val": 6,
        "prompts_per_step": 4,
        "val_batch_size": 4,
        "task_kwargs": {"min_length": 3, "max_length": 3},
        **kw,
    }
    return PromptDataModule(**kw)


def prompts(batches):
    return [[r["prompt"] for r in b] for b in batches]


def test_datamodule_batches():
    dm = datamodule()
    loader = dm.train_dataloader()
    epoch0, epoch1 = prompts(loader), prompts(loader)
    assert len(loader) == 5 and len(epoch0) == 5 and all(len(b) == 4 for b in epoch0)
    assert sorted(sum(epoch0, [])) == sorted(r["prompt"] for r in dm.train_rows)  # every row once per epoch
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, []))  # reshuffled
    assert prompts(datamodule().train_dataloader()) == epoch0  # deterministic
    val = prompts(dm.val_dataloader())
    assert val == prompts(dm.val_dataloader()) and [len(b) for b in val] == [4, 2]
    assert not set(sum(val, [])) & set(sum(epoch0, []))


def test_datamodule_file_val_fraction(tmp_path):
    path = write(tmp_path, "jsonl")
    dm = PromptDataModule(
        str(path), prompt_column="question", answer_column="solution", num_val=64, prompts_per_step=2, val_fraction=0.3
    )
    dm.setup()
    assert len(dm.val_rows) == 3 and len(dm.train_rows) == 7
    assert not {r["prompt"] for r in dm.val_rows} & {r["prompt"] for r in dm.train_rows}


def write_rows(path, n):
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


@pytest.fixture
def info_log(caplog, monkeypatch):
    """Lightning's logger does not propagate to the root logger that caplog listens on: let it, for the test."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def test_datamodule_uses_every_row_of_a_file_and_says_so(tmp_path, info_log):
    path = write_rows(tmp_path / "x.jsonl", 5000)
    dm = PromptDataModule(path)
    dm.setup()
    assert (
        len(dm.val_rows) == 64 and len(dm.train_rows) == 5000 - 64
    )  # every row is used: 64 held out, the rest trained on
    assert f"train: 4936 rows from {path}, val: 64 rows held out of it" in info_log.text
    info_log.clear()
    val = write_rows(tmp_path / "val.jsonl", 300)
    dm = PromptDataModule(path, val_source=val)
    dm.setup()
    assert len(dm.train_rows) == 5000 and len(dm.val_rows) == 300
    assert f"train: 5000 rows from {path}, val: 300 rows from {val}" in info_log.text


def test_datamodule_explicit_limits_still_cut(tmp_path, info_log):
    path = write_rows(tmp_path / "x.jsonl", 5000)
    dm = PromptDataModule(path, num_train=1000)
    dm.setup()
    assert len(dm.train_rows) == 1000 and len(dm.val_rows) == 64
    assert f"train: 1000 of 4936 rows (--data.num_train 1000) from {path}" in info_log.text
    val = write_rows(tmp_path / "val.jsonl", 300)
    dm = PromptDataModule(path, val_source=val, num_train=200, num_val=10)
    dm.setup()
    assert len(dm.train_rows) == 200 and len(dm.val_rows) == 10
    assert dm.train_rows == load_prompt_rows(path, n=200)  # the same seeded subset load_prompt_rows takes
    assert f"val: 10 of 300 rows (--data.num_val 10) from {val}" in info_log.text
    with pytest.raises(ValueError, match="--data.num_val -1: must be >= 0, or null"):
        PromptDataModule(path, num_val=-1)


def test_datamodule_task_defaults_unchanged(info_log):
    dm = PromptDataModule("arithmetic")
    dm.setup()
    assert len(dm.train_rows) == 1000 and len(dm.val_rows) == 64
    assert (dm.train_rows, dm.val_rows) == task_splits("arithmetic", 1000, 64, seed=0)
    assert (
        "train: 1000 rows from task 'arithmetic' (train split), val: 64 rows from task 'arithmetic' (validation split)"
        in info_log.text
    )


def test_sampler_resume_and_ranks():
    loader = datamodule().train_dataloader()
    list(loader)  # epoch 0
    it = iter(loader)
    head = [next(it), next(it)]  # two batches into epoch 1
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 8
    tail = list(it)
    resumed = datamodule().train_dataloader()
    resumed.load_state_dict(state)
    assert prompts(resumed) == prompts(tail) and len(tail) == 3
    fresh = datamodule().train_dataloader()
    list(fresh)
    assert prompts(fresh) == prompts(head + tail)  # epoch 1 order is a function of (seed, epoch)
    with pytest.raises(
        ValueError,
        match="training data had 20 rows shuffled with seed 0, this run.s has 20 rows and seed 1 .--data.seed",
    ):
        datamodule(seed=1).train_dataloader().load_state_dict(state)
    samplers = [ResumableSampler(10, seed=1, rank=r, world_size=3) for r in range(3)]
    shards = [list(s) for s in samplers]
    assert [len(s) for s in shards] == [3, 3, 3] and len(set(sum(shards, []))) == 9


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, rows, batch_idx):
        self.seen.append([r["prompt"] for r in rows])
        return (self.w**2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module, steps, ckpt_path=None, callbacks=()):
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(module, datamodule=datamodule(), ckpt_path=ckpt_path)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("stop", [3, 5])  # mid-epoch, and at the end of the first epoch (5 batches)
def test_lightning_resume_continues_at_same_position(tmp_path, stop):
    full = Recorder()
    fit(full, 9)
    first = Recorder()
    fit(first, stop, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=stop, save_top_k=-1)])
    (ckpt,) = glob.glob(str(tmp_path / "*.ckpt"))
    assert (
        torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"]
        == 4 * stop
    )
    rest = Recorder()
    fit(rest, 9, ckpt_path=ckpt)
    assert len(first.seen) == stop and first.seen + rest.seen == full.seen
