"""A subclass of RLModule overriding a LightningModule hook, as a Lightning user writes one: every hook is classified
from Lightning's own classes; a free or extended one is called by a fit, validate, test, predict and resume; a refused
one, or an extended one that drops RLModule's work, stops the subclass when it is built
(``lit_gspo/lightning/module_hooks.py``)."""

import functools
import re
from collections import Counter

import lightning as L
import pytest
import torch
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

from lit_gspo import GSPO, CharAccuracy, Generation, Policy, PromptDataModule, RLModule
from lit_gspo.lightning.module_hooks import EXTENDED, HOOKS, METHODS, calls_parent, check_hooks
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED
from lit_gspo.runtime.user_errors import SettingsError

ROWS = [{"prompt": f"rev {i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(0, 1000, 7)]
CALLS: Counter = Counter()


def subclass(names, calls_super: bool = True) -> type:
    """``class Mine(RLModule)`` overriding ``names``, each counting its calls in :data:`CALLS` and (``calls_super``)
    returning RLModule's, written as source as a user writes it."""
    body = "".join(
        f"    def {name}(self, *args, **kwargs):\n        CALLS[{name!r}] += 1\n"
        + (f"        return super().{name}(*args, **kwargs)\n" if calls_super else "")
        for name in names
    )
    namespace = {"RLModule": RLModule, "CALLS": CALLS}
    exec(f"class Mine(RLModule):\n{body or '    pass'}\n", namespace)
    return namespace["Mine"]


def build(cls=RLModule) -> RLModule:
    return cls(
        policy=Policy("tiny-llama", config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}),
        objective=GSPO(),
        rewards=[CharAccuracy()],
        generation=Generation(num_generations=2, max_new_tokens=3),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.5, total_iters=8),
    )


def trainer(root, **flags) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, default_root_dir=root, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, **flags)  # fmt: skip


def data() -> PromptDataModule:
    return PromptDataModule.from_datasets(ROWS, eval_dataset=ROWS[:4], prompts_per_step=2, val_batch_size=4)


def test_every_hook_of_a_lightning_module_is_classified():
    """From Lightning's classes: a hook a new release adds fails here until module_hooks.py classifies it."""
    hooks = {name for klass in (ModelHooks, DataHooks, CheckpointHooks) for name in vars(klass) if name[0] != "_"}
    own = {name for name in vars(L.LightningModule) if name[0] != "_" and callable(getattr(L.LightningModule, name))}
    assert sorted(HOOKS) == sorted(hooks | (own - set(METHODS)))
    assert set(METHODS) <= own and not set(METHODS) & hooks
    assert {flag.kind for flag in HOOKS.values()} == {HONOURED, EXTENDED, REFUSED}
    implemented = {name for name in HOOKS if getattr(RLModule, name) is not getattr(L.LightningModule, name)}
    assert {name for name, flag in HOOKS.items() if flag.kind == EXTENDED} == implemented


def every_run(root, cls=RLModule, callbacks=()) -> tuple[RLModule, RLModule]:
    """A fit of 2 RL steps (validated after each), a validate, test and predict of its policy, and a fit resumed from
    its checkpoint for a third step, of ``cls`` with ``callbacks``: (the fitted module, the resumed one)."""
    L.seed_everything(0)
    model = build(cls)
    fit = trainer(root, max_steps=2, val_check_interval=1, check_val_every_n_epoch=None, callbacks=list(callbacks))
    fit.fit(model, datamodule=data())
    assert model.rl_step == 2 and "val/reward" in fit.callback_metrics
    fit.save_checkpoint(root / "two.ckpt")
    for run in ("validate", "test", "predict"):
        getattr(trainer(root, callbacks=list(callbacks)), run)(model, datamodule=data())
    resumed = build(cls)
    trainer(root, max_steps=3, val_check_interval=1, check_val_every_n_epoch=None, callbacks=list(callbacks)).fit(
        resumed, datamodule=data(), ckpt_path=root / "two.ckpt"
    )
    assert resumed.rl_step == 3
    return model, resumed


def test_each_free_or_extended_hook_is_called_by_a_fit_validate_test_predict_and_resume(tmp_path):
    """One subclass overrides every hook it may (extended ones calling RLModule's): each is called, and RLModule's
    work still happens (val/reward logged, the learning rate scheduled, a resume restoring the RL step)."""
    names = sorted(name for name, flag in HOOKS.items() if flag.kind != REFUSED)
    CALLS.clear()
    _, resumed = every_run(tmp_path, subclass(names))
    assert resumed.optimizers().param_groups[0]["lr"] != 1e-3 * 0.5  # the schedule stepped, through lr_scheduler_step
    assert sorted(name for name in names if not CALLS[name]) == []


def test_a_subclass_s_lr_scheduler_step_steps_the_schedule(tmp_path):
    """Lightning's hook for a schedule its default cannot step (timm's take the epoch): the override decides."""

    class Halving(RLModule):
        def lr_scheduler_step(self, scheduler, metric):
            for group in scheduler.optimizer.param_groups:
                group["lr"] /= 2

    L.seed_everything(0)
    model = build(Halving)
    trainer(tmp_path, max_steps=2).fit(model, datamodule=data())
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 / 2**model.optimizer_steps)


@pytest.mark.parametrize("name", sorted(name for name, flag in HOOKS.items() if flag.kind == REFUSED))
def test_a_hook_lightning_never_calls_for_rlmodule_is_refused_when_the_subclass_is_built(name):
    with pytest.raises(SettingsError, match=rf"^Mine\.{name}: not called by lit_gspo: {re.escape(HOOKS[name].note)}$"):
        build(subclass([name]))


@pytest.mark.parametrize("name", sorted(name for name, flag in HOOKS.items() if flag.kind == EXTENDED))
def test_an_extended_hook_that_does_not_call_rlmodule_s_is_refused_when_the_subclass_is_built(name):
    note = re.escape(HOOKS[name].note)
    expected = rf"^Mine\.{name} overrides RLModule's without calling it: RLModule {note}; call super\(\)\.{name}"
    with pytest.raises(SettingsError, match=expected):
        check_hooks(subclass([name], calls_super=False), RLModule)
    check_hooks(subclass([name]), RLModule)


def test_the_whole_chain_of_overrides_is_checked_and_a_free_hook_may_skip_super():
    class Logs(RLModule):
        def on_validation_epoch_end(self):
            super().on_validation_epoch_end()

        def on_train_batch_end(self, outputs, batch, batch_idx):  # free: nothing of RLModule's to call
            pass

    class Forgets(Logs):
        def on_validation_epoch_end(self):
            pass

    class Mixin:
        def on_fit_start(self):
            pass

    check_hooks(Logs, RLModule)
    with pytest.raises(SettingsError, match=r"^Forgets\.on_validation_epoch_end overrides"):
        check_hooks(Forgets, RLModule)
    with pytest.raises(SettingsError, match=r"^Mixin\.on_fit_start overrides RLModule's without calling it"):
        check_hooks(type("Mine", (Mixin, RLModule), {}), RLModule)
    with pytest.raises(SettingsError, match=r"^Forgets\.on_validation_epoch_end overrides"):
        build(Forgets)


def test_an_override_calls_the_parent_only_if_its_code_names_the_hook():
    def explicit(self):
        return RLModule.on_fit_start(self)

    def nested(self):
        return (lambda: super(RLModule, self).on_fit_start())()

    def elsewhere(self):
        return self.on_fit_end()

    assert calls_parent(explicit, "on_fit_start") and calls_parent(nested, "on_fit_start")
    assert not calls_parent(elsewhere, "on_fit_start")
    assert calls_parent(functools.wraps(explicit)(lambda self: explicit(self)), "on_fit_start")  # unwrapped
    assert calls_parent(print, "on_fit_start")  # no code to read: not refused
