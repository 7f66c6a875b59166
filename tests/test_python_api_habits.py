"""A run built in Python, as a Lightning (or TRL) user writes it: rows from a ``datasets.Dataset``
(``PromptDataModule.from_datasets``, TRL's ``train_dataset``/``eval_dataset``), a plain ``lightning.Trainer`` and
``ModelCheckpoint``. Its checkpoints hold plain data (the settings as the CLI's config writes them), so Lightning's own
``trainer.fit(ckpt_path=...)`` resumes it bit for bit and ``RLModule.load_from_checkpoint`` rebuilds its settings, both
with ``torch.load``'s safe default (``weights_only=True``). Loaders given without a data module, or batches that are not
rows (a DataLoader's default collate), are refused in one line."""

import dataclasses
import json
import re
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch
import yaml
from datasets import Dataset, DatasetDict
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_gspo import GSPO, CharAccuracy, Generation, LoRA, Policy, PromptDataModule, RLModule, Update, WarmStart
from lit_gspo.lightning.plain_settings import from_plain, is_plain, plain
from lit_gspo.rl.config import Validation
from lit_gspo.rl.learn import mismatch

ROWS = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(0, 1000, 7)]


def module() -> RLModule:
    return RLModule(
        policy=Policy(
            "tiny-llama",
            config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64},
            warm_start=WarmStart(steps=5, lr=3e-3, batch_size=16),
        ),
        objective=GSPO(),
        rewards=[CharAccuracy()],
        generation=Generation(num_generations=4, max_new_tokens=4),
        update=Update(num_minibatches=2, mismatch=mismatch.Mismatch(corrections=[mismatch.TIS(cap=3.0)])),
        validation=Validation(num_generations=2),
    )


def fit(root, steps: int, ckpt_path=None) -> tuple[RLModule, L.Trainer]:
    L.seed_everything(0)  # as a reproducible Lightning script starts
    model = module()
    data = PromptDataModule.from_datasets(Dataset.from_list(ROWS), eval_dataset=ROWS[:6], prompts_per_step=4, seed=3)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        default_root_dir=root,
        logger=CSVLogger(root),
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)],
        val_check_interval=2,
        check_val_every_n_epoch=None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four RL steps straight, and two then two more resumed from the step-2 checkpoint by Lightning's ``ckpt_path``
    (no ``weights_only`` given: Lightning's and torch's safe default)."""
    root = tmp_path_factory.mktemp("python_api")
    straight, _ = fit(root / "straight", 4)
    fit(root / "split", 2)
    (ckpt,) = (root / "split" / "checkpoints").glob("*step=2.ckpt")
    resumed, trainer = fit(root / "resumed", 4, ckpt_path=str(ckpt))
    return straight, resumed, trainer, ckpt


def test_lightnings_resume_of_a_python_built_run_continues_it_bit_for_bit(runs):
    straight, resumed, trainer, _ = runs
    assert resumed.rl_step == straight.rl_step == 4 and trainer.global_step == 4
    for (name, a), (_, b) in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().items()):
        assert torch.equal(a, b), name


def test_its_checkpoint_holds_plain_data_and_load_from_checkpoint_rebuilds_its_settings(runs):
    straight, _, _, ckpt = runs
    checkpoint = torch.load(ckpt, weights_only=True)  # refused before: Policy, Update, ... were pickled objects
    assert is_plain(checkpoint["hyper_parameters"]) and is_plain(checkpoint["datamodule_hyper_parameters"])
    assert checkpoint["hyper_parameters"]["update"]["mismatch"]["corrections"] == [
        {"class_path": "lit_gspo.rl.learn.mismatch.TIS", "init_args": {"cap": 3.0, "low": None}}
    ]
    assert checkpoint["datamodule_hyper_parameters"]["train_source"] == "train_dataset"  # a name, not the rows
    with pytest.raises(ValueError, match=r"^'train_dataset' names rows a run got from Python .*\.from_datasets\(rows"):
        PromptDataModule.load_from_checkpoint(ckpt).setup()  # not a Hub dataset of that name
    loaded = RLModule.load_from_checkpoint(ckpt)  # Lightning's habit, with its default weights_only
    assert loaded.settings == straight.settings and loaded.generation == straight.generation
    assert loaded.validation == straight.validation
    assert plain(loaded.learner.cfg) == plain(straight.learner.cfg)
    assert isinstance(loaded.learner.cfg.mismatch.corrections[0], mismatch.TIS)
    assert loaded.learner.cfg.mismatch.corrections[0].cap == 3.0
    for name, tensor in checkpoint["state_dict"].items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_loggers_hparams_are_plain_yaml(runs):
    _, _, trainer, _ = runs
    saved = yaml.safe_load((Path(trainer.logger.log_dir) / "hparams.yaml").read_text())  # no Python object tags
    assert saved["policy"]["warm_start"] == dataclasses.asdict(WarmStart(steps=5, lr=3e-3, batch_size=16))
    assert saved["generation"]["num_generations"] == 4


@pytest.mark.parametrize("correction", mismatch.Correction.__subclasses__(), ids=lambda c: c.__name__)
def test_every_settings_group_and_correction_round_trips_through_plain_data(correction):
    """Each settings dataclass with values off its defaults (nested ones included), and each mismatch correction, is
    the same object after :func:`plain` and :func:`from_plain`."""
    policy = Policy("tiny-qwen3", config={"hidden_size": 48}, lora=LoRA(r=4, target_modules=["q_proj"]))
    policy = dataclasses.replace(policy, warm_start=WarmStart(steps=7), kl_to_ref=True)
    update = Update(epochs=2, micro_batch_tokens=None, mismatch=mismatch.Mismatch(corrections=[correction()]))
    for cls, value in ((Policy, policy), (Generation, Generation(top_k=5, stop=["\n"])), (Update, update)):
        data = plain(value)
        assert is_plain(data)
        back = from_plain(cls, data, "model.x")
        assert plain(back) == data and type(back) is cls
    (back_correction,) = from_plain(Update, plain(update), "model.update").mismatch.corrections
    assert type(back_correction) is correction
    assert from_plain(Policy, policy, "model.policy") is policy  # an object is taken as it is
    with pytest.raises(ValueError, match=r"^model.update: not the settings of a Update: .*epoch"):
        from_plain(Update, {"epoch": 2}, "model.update")


# ------------------------------------------------------------------------ rows from Python (TRL's datasets)
@pytest.mark.parametrize(
    "train",
    [Dataset.from_list(ROWS), ROWS, pd.DataFrame(ROWS), DatasetDict(train=Dataset.from_list(ROWS))],
    ids=["Dataset", "list", "DataFrame", "DatasetDict"],
)
def test_rows_from_python_are_the_rows_a_file_of_them_gives(train, tmp_path):
    """The same rows from memory and from a .jsonl file: the same training and held-out rows, in the same order."""
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    from_file = PromptDataModule(str(file), prompts_per_step=4, seed=1)
    in_memory = PromptDataModule.from_datasets(train, prompts_per_step=4, seed=1)
    from_file.setup(), in_memory.setup()
    assert in_memory.train_rows == from_file.train_rows and in_memory.val_rows == from_file.val_rows
    assert in_memory.describe_row("val", 0) == from_file.describe_row("val", 0).replace(str(file), "train_dataset")


def test_a_dataset_dicts_own_test_split_validates_as_a_directorys_does():
    data = PromptDataModule.from_datasets(
        DatasetDict(train=Dataset.from_list(ROWS), test=Dataset.from_list(ROWS[:5])), prompts_per_step=4
    )
    data.setup()
    assert data.val_rows == ROWS[:5] and len(data.train_rows) == len(ROWS)  # nothing held out of training
    assert data.describe_row("val", 2) == "train_dataset [test] row 2"
    given = PromptDataModule.from_datasets(ROWS, eval_dataset=DatasetDict(test=Dataset.from_list(ROWS[3:9])))
    given.setup()
    assert given.val_rows == ROWS[3:9] and given.describe_row("val", 0) == "eval_dataset row 0"


def test_rows_that_are_not_rows_are_refused_when_the_data_module_is_built():
    with pytest.raises(TypeError, match=r"^train_source names where the rows are .* got a Dataset: .*from_datasets"):
        PromptDataModule(Dataset.from_list(ROWS))
    with pytest.raises(TypeError, match=r"^eval_dataset must be .* got a list whose item 1 is a str$"):
        PromptDataModule.from_datasets(ROWS, eval_dataset=[ROWS[0], "rev 12="])
    with pytest.raises(TypeError, match=r"got a generator \(a stream: .*without streaming=True\)$"):
        PromptDataModule.from_datasets(row for row in ROWS)
    with pytest.raises(TypeError, match=r"got the text 'reversal' \(a task, file or Hub dataset by name is"):
        PromptDataModule.from_datasets("reversal")
    with pytest.raises(ValueError, match=r"^train_dataset has the splits \['training'\], not --data.train_split train"):
        PromptDataModule.from_datasets(DatasetDict(training=Dataset.from_list(ROWS)))
    with pytest.raises(TypeError, match="from_datasets takes rows as train_dataset and eval_dataset, not val_source"):
        PromptDataModule.from_datasets(ROWS, val_source="x.jsonl")
    with pytest.raises(ValueError, match=r"'train_dataset' has no column 'prompt' .*'question'"):
        PromptDataModule.from_datasets([{"question": "q", "answer": "a"}] * 8).setup()


class Tagged(RLModule):
    """A user's subclass with an argument of its own."""

    def __init__(self, tag=None, **settings):
        super().__init__(**settings)


class Opaque:
    def __init__(self, size: int):
        self.n = size  # keeps no attribute named after its argument: no config can describe it


def test_a_subclass_argument_is_written_as_plain_data_when_it_can_be_and_kept_as_it_is_when_not():
    described = Tagged(tag=mismatch.TIS(cap=2.5), generation=Generation(num_generations=3))
    assert described.hparams["tag"] == {
        "class_path": "lit_gspo.rl.learn.mismatch.TIS",
        "init_args": {"cap": 2.5, "low": None},
    }
    assert described.hparams["generation"]["num_generations"] == 3
    opaque = Tagged(tag=Opaque(3))  # built as before; its checkpoints need the object's class to load
    assert isinstance(opaque.hparams["tag"], Opaque)


def trainer(root, **flags) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, default_root_dir=root, logger=False, enable_progress_bar=False, **flags
    )


def test_a_fit_given_loaders_without_a_data_module_is_refused_at_start(tmp_path):
    """Lightning's ``trainer.fit(model, train_dataloaders=..., val_dataloaders=...)``: the warm start and dynamic
    sampling draw from the data module's rows (was an AttributeError on None, with its traceback)."""
    data = PromptDataModule.from_datasets(ROWS, prompts_per_step=4)
    data.setup()
    model = module()
    with pytest.raises(
        TypeError, match=r"^RLModule reads its prompts from a PromptDataModule, got loaders and no data"
    ):
        trainer(tmp_path, max_steps=1).fit(model, data.train_dataloader(), data.val_dataloader())
    assert model.rl_step == 0 and not model.warm_started


def test_a_loader_of_rows_validates_as_the_data_module_does_and_one_of_columns_is_refused(tmp_path):
    model, rows = module(), ROWS[:8]
    with_module = trainer(tmp_path).validate(
        model, datamodule=PromptDataModule.from_datasets(ROWS, eval_dataset=rows, val_batch_size=4), verbose=False
    )
    with_loader = trainer(tmp_path).validate(
        model, dataloaders=DataLoader(rows, batch_size=4, collate_fn=lambda batch: batch), verbose=False
    )
    for metrics in (with_module[0], with_loader[0]):
        del metrics["time/val_s"]
    assert with_loader == with_module
    with pytest.raises(
        TypeError, match=r"^a batch of prompts is a list of row dicts .* got a dict of columns \['answer', 'prompt'\]"
    ):
        trainer(tmp_path).validate(model, dataloaders=DataLoader(rows, batch_size=4), verbose=False)  # default collate


@pytest.mark.parametrize(
    "reward, hint",
    [
        (
            "OpenAssistant/reward-model-deberta-v3-large-v2",
            "is RewardModel('OpenAssistant/reward-model-deberta-v3-large-v2')",
        ),
        ("my_rewards.exact", "a function by its import path is the function itself"),
    ],
)
def test_a_reward_given_as_text_as_trls_reward_funcs_takes_it_says_what_it_is_here(reward, hint):
    with pytest.raises(TypeError, match=rf"^reward function '{reward}' is not callable; .*{re.escape(hint)}"):
        RLModule(rewards=[reward])


def test_trls_peft_config_a_peft_lora_config_is_the_policys_lora():
    """TRL's ``GRPOTrainer(peft_config=LoraConfig(...))``: the same config given as ``Policy(lora=...)`` trains the same
    adapters; its settings lit_gspo does not apply are refused by name, not dropped (was: an AttributeError 'alpha')."""
    from peft import LoraConfig

    from lit_gspo.models.lora import is_lora

    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["v_proj", "q_proj"], task_type="CAUSAL_LM"
    )
    policy = Policy(
        "tiny-llama", config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}, lora=config
    )
    assert policy.lora == LoRA(r=4, alpha=8, dropout=0.05, target_modules=["q_proj", "v_proj"])
    model = RLModule(policy=policy)
    assert is_lora(model.policy)
    trainable = {name.split(".")[-3] for name, p in model.policy.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B"}
    adapted = {name.split(".")[-4] for name, p in model.policy.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj", "v_proj"}
    assert Policy(lora=LoraConfig(target_modules="all-linear")).lora.target_modules == ["all-linear"]
    for off in ({"use_dora": True}, {"use_rslora": True}, {"bias": "all"}, {"modules_to_save": ["lm_head"]}):
        name, value = next(iter(off.items()))
        with pytest.raises(ValueError, match=rf"^policy.lora: the LoraConfig sets {name}={re.escape(repr(value))}, "):
            Policy(lora=LoraConfig(target_modules="all-linear", **off))
    with pytest.raises(ValueError, match=r"sets task_type='SEQ_CLS', which lit_gspo does not apply"):
        Policy(lora=LoraConfig(target_modules="all-linear", task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match=r"leaves target_modules to peft's choice .* name them"):
        Policy(lora=LoraConfig(r=8))
    with pytest.raises(TypeError, match=r"^policy.lora takes LoRA\(r=, alpha=, dropout=, target_modules=\) or a peft"):
        Policy(lora={"r": 8})
