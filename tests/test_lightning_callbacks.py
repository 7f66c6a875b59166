"""Every callback Lightning ships, in an RL fit: each is honoured or refused at start in one line
(``lit_gspo/lightning/lightning_callbacks.py``), enumerated from ``lightning.pytorch.callbacks.__all__`` so that a new
one fails here until it is classified; the honoured ones that act on the weights or the loss do what they say; every hook
of ``Callback`` is called or refused."""

import copy
import csv
import re
from collections import Counter

import lightning as L
import lightning.pytorch.callbacks as C
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from test_module_hooks import build, every_run, stop_here
from test_predict import ROWS, module
from test_predict import trainer as quiet_trainer
from transformers import AutoModelForCausalLM

from lit_gspo import PromptDataModule, RLModule
from lit_gspo.lightning.lightning_callbacks import CALLBACKS, HOOKS_NOT_CALLED, refuse_unsupported_callbacks
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED
from lit_gspo.rl.engines import HFGenerate
from lit_gspo.runtime.user_errors import SettingsError


def fit(root, callbacks, steps: int = 2, ckpt_path=None, **kwargs) -> tuple[RLModule, L.Trainer]:
    """``steps`` RL steps with a validation after each (``ckpt_path``: resumed by Lightning from it)."""
    L.seed_everything(0)
    model = module(**kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=root,
        logger=CSVLogger(root),
        callbacks=callbacks,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule.from_datasets(ROWS, eval_dataset=ROWS[:8], prompts_per_step=4)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model, trainer


class FreezeEmbeddings(C.BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.policy.get_input_embeddings())

    def finetune_function(self, pl_module, epoch, optimizer):
        pass


class Writer(C.BasePredictionWriter):
    def __init__(self):
        super().__init__(write_interval="batch")


def instance(name: str, tmp_path):
    """An instance of Lightning's callback ``name`` as a user would configure it (a minimal subclass of a base)."""
    made = {
        "BackboneFinetuning": lambda: C.BackboneFinetuning(unfreeze_backbone_at_epoch=1),
        "BaseFinetuning": FreezeEmbeddings,
        "BasePredictionWriter": Writer,
        "EarlyStopping": lambda: C.EarlyStopping(monitor="val/reward", mode="max"),
        "GradientAccumulationScheduler": lambda: C.GradientAccumulationScheduler(scheduling={0: 2}),
        "LambdaCallback": lambda: C.LambdaCallback(on_train_start=lambda *args: None),
        "ModelPruning": lambda: C.ModelPruning(pruning_fn="l1_unstructured", amount=0.5),
        "OnExceptionCheckpoint": lambda: C.OnExceptionCheckpoint(dirpath=tmp_path / "on_exception"),
        "StochasticWeightAveraging": lambda: C.StochasticWeightAveraging(swa_lrs=1e-3),
        "ThroughputMonitor": lambda: C.ThroughputMonitor(batch_size_fn=len),
        "Timer": lambda: C.Timer(duration="00:00:10:00"),
    }
    return made.get(name, getattr(C, name))()


def test_every_lightning_callback_is_classified():
    assert sorted(CALLBACKS) == sorted(C.__all__)
    assert {flag.kind for flag in CALLBACKS.values()} == {HONOURED, REFUSED}


@pytest.mark.parametrize("name", sorted(name for name, flag in CALLBACKS.items() if flag.kind == REFUSED))
def test_a_refused_callback_stops_the_fit_at_start_saying_what_to_use(name, tmp_path):
    L.seed_everything(0)
    model = module()
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, callbacks=[instance(name, tmp_path)])  # fmt: skip
    with pytest.raises(SettingsError, match=rf"^{name}: not supported by lit_gspo: {re.escape(CALLBACKS[name].note)}$"):
        trainer.fit(model, datamodule=PromptDataModule.from_datasets(ROWS, prompts_per_step=4))
    assert not model.warm_started and model.rl_step == 0
    yours = instance(name, tmp_path)
    yours.__class__ = type("Yours", (type(yours),), {})  # a subclass is refused with what it extends
    with pytest.raises(SettingsError, match=r"^Yours: not supported by lit_gspo: "):
        refuse_unsupported_callbacks([C.Callback(), yours])


@pytest.mark.parametrize(
    "name", sorted(name for name, flag in CALLBACKS.items() if flag.kind == HONOURED and "ProgressBar" not in name)
)
def test_an_honoured_callback_runs_through_a_fit(name, tmp_path):
    """Each in a fit of 2 RL steps with a validation after each (the progress bars: ``tests/test_progress.py``)."""
    model, trainer = fit(tmp_path, [instance(name, tmp_path)])
    assert model.rl_step == 2 and "val/reward" in trainer.callback_metrics


def test_callbacks_receive_the_rl_steps_loss_as_its_outputs(tmp_path):
    """``on_train_batch_end``'s ``outputs["loss"]``, as a Lightning callback reads a training step's loss: the RL step's
    logged ``train/loss`` (was ``{}``)."""
    seen = []
    fit(tmp_path, [C.LambdaCallback(on_train_batch_end=lambda t, m, outputs, *rest: seen.append(outputs["loss"]))])
    logged = [row["train/loss"] for row in _metrics(tmp_path) if row.get("train/loss")]
    assert len(seen) == 2 and [float(loss) for loss in seen] == [float(value) for value in logged]


class OwnCopy(HFGenerate):
    """HFGenerate sampling from the weights its last ``sync_weights`` was given: a copy of its own, as vLLM keeps."""

    def sync_weights(self, policy) -> None:
        self.copy = copy.deepcopy(policy)

    def generate(self, policy, *args, **kwargs):
        return super().generate(self.copy, *args, **kwargs)


def test_an_exponential_average_is_what_validation_samples_and_the_export_holds_whichever_engine(tmp_path):
    """``EMAWeightAveraging``: rollouts sample the current policy; each validation, the average, which an engine that
    holds its own weights receives too (it was given the current policy's before the callback swapped the average
    in), starting from the warm-started policy (the callback copied the module before the warm start); at the end
    the policy and ``hf_model`` are the average, W ← d·W + (1 − d)·W_step from the first step's."""
    weights = []  # the current policy's lm_head after each step, before the average is taken
    record = C.LambdaCallback(
        on_train_batch_end=lambda t, m, *rest: weights.append(m.policy.lm_head.weight.detach().clone())
    )
    decay, steps = 0.8, 4
    reading, _ = fit(tmp_path / "reads", [record, C.EMAWeightAveraging(decay=decay)], steps=steps, lr=1e-1)
    fit(tmp_path / "owns", [C.EMAWeightAveraging(decay=decay)], steps=steps, lr=1e-1, engine=OwnCopy())
    fit(tmp_path / "current", [], steps=steps, lr=1e-1)
    shown = {run: _completions(tmp_path / run) for run in ("reads", "owns", "current")}
    assert shown["owns"] == shown["reads"]  # every validation's completions and rewards
    assert shown["reads"][0] == shown["current"][0]  # step 0: the warm-started policy
    assert shown["reads"][1:] != shown["current"][1:]  # after: the average is not the current policy
    average = weights[0]
    for step_weights in weights[1:]:
        average = decay * average + (1 - decay) * step_weights
    assert torch.allclose(reading.policy.lm_head.weight, average, atol=1e-7)
    assert not torch.allclose(average, weights[-1], atol=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "reads" / "hf_model")
    assert torch.allclose(exported.lm_head.weight, average, atol=1e-7)


def test_a_weight_average_is_refused_under_fsdp2_only():
    average = C.EMAWeightAveraging()
    refuse_unsupported_callbacks([average], DDPStrategy())
    with pytest.raises(
        SettingsError, match=r"^EMAWeightAveraging: not supported under FSDP2 \(ModelParallelStrategy\)"
    ):
        refuse_unsupported_callbacks([average], ModelParallelStrategy())


def _completions(root, by_step: bool = False):
    """The completions each validation showed (``completions.csv``): (prompt, completion, reward) per step, in order
    (``by_step``: keyed by step)."""
    (path,) = root.glob("lightning_logs/version_*/completions.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    steps = sorted({int(row["step"]) for row in rows})
    shown = {
        step: [(r["prompt"], r["completion"], r["reward"]) for r in rows if int(r["step"]) == step] for step in steps
    }
    return shown if by_step else list(shown.values())


def _metrics(root) -> list[dict]:
    (path,) = root.glob("lightning_logs/version_*/metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_run_with_an_exponential_average_resumes_exactly(tmp_path):
    """2 RL steps, then 2 more resumed by Lightning's ``ckpt_path``, equal 4 straight: the policy, the average (what
    the checkpoint's ``state_dict`` holds, and the export) and every validation."""

    def run(root, steps, ckpt_path=None):
        saved = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)
        model, _ = fit(root, [C.EMAWeightAveraging(decay=0.8), saved], steps, ckpt_path=ckpt_path, lr=1e-1)
        return model

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "first", 2)
    (ckpt,) = (tmp_path / "first" / "checkpoints").glob("*step=2.ckpt")
    resumed = run(tmp_path / "resumed", 4, ckpt_path=str(ckpt))
    for name, value in straight.policy.state_dict().items():
        assert torch.equal(resumed.policy.state_dict()[name], value), name
    resumed_shown, straight_shown = (
        _completions(tmp_path / "resumed", by_step=True),
        _completions(tmp_path / "straight", by_step=True),
    )
    assert sorted(resumed_shown) == [3, 4]
    assert resumed_shown == {step: straight_shown[step] for step in (3, 4)}


def test_a_checkpoint_every_rl_step_is_named_by_its_step_and_none_overwrites_another(tmp_path):
    """``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)`` with a validation every 2 steps: ModelCheckpoint names
    a checkpoint by a logged ``step`` before ``global_step``, and the validation's (its loggers' x-axis) named the
    later checkpoints until the next one: steps 3 and 4 were both written as ``step=2``, over step 2's, and step 5 as
    ``step=4``. Each now holds the step its name says."""
    L.seed_everything(0)
    saved = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, callbacks=[saved], val_check_interval=2,
                        default_root_dir=tmp_path, check_val_every_n_epoch=None, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module(), datamodule=PromptDataModule.from_datasets(ROWS, eval_dataset=ROWS[:8], prompts_per_step=4))
    held = {path.name: torch.load(path, weights_only=True)["rl_step"] for path in tmp_path.glob("*.ckpt")}
    assert held == {f"epoch=0-step={step}.ckpt": step for step in range(1, 6)}


def test_every_hook_of_a_callback_is_called_but_those_refused_in_a_callback_that_has_one(tmp_path):
    """A callback overriding every hook of ``Callback`` (``state_dict`` not empty, so a checkpoint keeps it and the
    resume loads it): a fit, validate, test, predict, resume and a run that raises call each, but
    :data:`HOOKS_NOT_CALLED`, which are refused (a ``LambdaCallback``'s too)."""
    hooks = {name for name in vars(C.Callback) if name[0] != "_" and callable(getattr(C.Callback, name))}
    calls = Counter()

    def counting(name):
        def hook(self, *args, **kwargs):
            calls[name] += 1
            return {"seen": True} if name == "state_dict" else getattr(C.Callback, name)(self, *args, **kwargs)

        return hook

    Recorder = type("Recorder", (C.Callback,), {name: counting(name) for name in hooks - set(HOOKS_NOT_CALLED)})
    every_run(tmp_path, callbacks=[Recorder()])
    with pytest.raises(RuntimeError, match="^stop here$"):
        quiet_trainer(tmp_path, callbacks=[Recorder(), C.LambdaCallback(on_validation_start=stop_here)]).validate(
            build(), datamodule=PromptDataModule.from_datasets(ROWS, eval_dataset=ROWS[:4])
        )
    assert sorted(name for name in hooks - set(HOOKS_NOT_CALLED) if not calls[name]) == []
    for name, note in HOOKS_NOT_CALLED.items():
        refused = type("Mine", (C.Callback,), {name: counting(name)})
        for callback in (refused(), C.LambdaCallback(**{name: print})):
            expected = rf"^{type(callback).__name__}\.{name}: not called by lit_gspo: {re.escape(note)}$"
            with pytest.raises(SettingsError, match=expected):
                quiet_trainer(tmp_path, max_steps=1, callbacks=[callback]).fit(
                    build(), datamodule=PromptDataModule.from_datasets(ROWS, prompts_per_step=2)
                )
