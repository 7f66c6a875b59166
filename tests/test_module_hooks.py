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
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
from test_predict import ROWS, trainer

from lit_gspo import GSPO, CharAccuracy, Generation, Policy, PromptDataModule, RLModule
from lit_gspo.lightning.module_hooks import (
    DATA_HOOKS,
    DATA_METHODS,
    EXTENDED,
    HOOKS,
    METHODS,
    calls_parent,
    check_hooks,
)
from lit_gspo.lightning.trainer_flags import REFUSED
from lit_gspo.runtime.user_errors import SettingsError

CALLS: Counter = Counter()


def subclass(names, calls_super: bool = True, base: type = RLModule) -> type:
    """``class Mine(base)`` overriding ``names``, each counting its calls in :data:`CALLS` (as ``"Mine.name"``) and
    (``calls_super``) returning ``base``'s, written as source as a user writes it."""
    body = "".join(
        f"    def {name}(self, *args, **kwargs):\n        CALLS['Mine.{name}'] += 1\n"
        + (f"        return super().{name}(*args, **kwargs)\n" if calls_super else "")
        for name in names
    )
    namespace = {base.__name__: base, "CALLS": CALLS}
    exec(f"class Mine({base.__name__}):\n{body or '    pass'}\n", namespace)
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


def data(cls=PromptDataModule) -> PromptDataModule:
    return cls.from_datasets(ROWS, eval_dataset=ROWS[:4], prompts_per_step=2, val_batch_size=4)


def public_methods(cls) -> set[str]:
    return {name for name in vars(cls) if name[0] != "_" and callable(getattr(cls, name))}


@pytest.mark.parametrize(
    "lightning_class, hook_classes, hooks, methods, ours",
    [
        (L.LightningModule, (ModelHooks, DataHooks, CheckpointHooks), HOOKS, METHODS, RLModule),
        (L.LightningDataModule, (DataHooks,), DATA_HOOKS, DATA_METHODS, PromptDataModule),
    ],
)
def test_every_hook_of_a_lightning_module_and_data_module_is_classified(
    lightning_class, hook_classes, hooks, methods, ours
):
    """From Lightning's classes: a hook a new release adds fails here until module_hooks.py classifies it; the
    extended hooks are exactly those our class implements."""
    hook_names = set().union(*(public_methods(klass) for klass in hook_classes))
    own = public_methods(lightning_class)
    assert sorted(hooks) == sorted(hook_names | (own - set(methods)))
    assert set(methods) <= own and not set(methods) & hook_names
    implemented = {name for name in hooks if getattr(ours, name) is not getattr(lightning_class, name)}
    assert {name for name, flag in hooks.items() if flag.kind == EXTENDED} == implemented


def every_run(root, cls=RLModule, callbacks=(), data_cls=PromptDataModule) -> tuple[RLModule, RLModule]:
    """A fit of 2 RL steps (validated after each), a validate, test and predict of its policy, and a fit resumed from
    its checkpoint for a third step, of ``cls`` and ``data_cls`` with ``callbacks``: (the fitted module, the resumed
    one)."""
    L.seed_everything(0)
    model = build(cls)
    fit = trainer(root, max_steps=2, val_check_interval=1, check_val_every_n_epoch=None, callbacks=list(callbacks))
    fit.fit(model, datamodule=data(data_cls))
    assert model.rl_step == 2 and "val/reward" in fit.callback_metrics
    fit.save_checkpoint(root / "two.ckpt")
    for run in ("validate", "test", "predict"):
        getattr(trainer(root, callbacks=list(callbacks)), run)(model, datamodule=data(data_cls))
    resumed = build(cls)
    trainer(root, max_steps=3, val_check_interval=1, check_val_every_n_epoch=None, callbacks=list(callbacks)).fit(
        resumed, datamodule=data(data_cls), ckpt_path=root / "two.ckpt"
    )
    assert resumed.rl_step == 3
    return model, resumed


def test_each_free_or_extended_hook_is_called_by_a_fit_validate_test_predict_and_resume(tmp_path):
    """A subclass of RLModule and one of PromptDataModule override every hook they may (extended ones calling the
    parent's): each is called by a fit, validate, test, predict, resume and a run that raises, and the parents' work
    still happens (val/reward logged, the learning rate scheduled, a resume restoring the RL step). The module's
    batch-transfer hooks are Lightning's pick over the data module's; a data module's state is kept when it has one."""
    names = sorted(name for name, flag in HOOKS.items() if flag.kind != REFUSED)
    data_names = sorted(name for name in DATA_HOOKS if "batch_transfer" not in name and "transfer_batch" not in name)

    class MineData(subclass(data_names, base=PromptDataModule)):
        def state_dict(self):
            super().state_dict()
            return {"seen": True}

    CALLS.clear()
    _, resumed = every_run(tmp_path, subclass(names), data_cls=MineData)
    assert resumed.optimizers().param_groups[0]["lr"] != 1e-3 * 0.5  # the schedule stepped, through lr_scheduler_step
    with pytest.raises(RuntimeError, match="^stop here$"):
        trainer(tmp_path, callbacks=[LambdaCallback(on_validation_start=stop_here)]).validate(build(), data(MineData))
    assert sorted(name for name in names + data_names if not CALLS[f"Mine.{name}"]) == []


def stop_here(*args):
    raise RuntimeError("stop here")


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


EXTENDED_HOOKS = [
    (base, hooks, name)
    for base, hooks in ((RLModule, HOOKS), (PromptDataModule, DATA_HOOKS))
    for name, flag in hooks.items()
    if flag.kind == EXTENDED
]


@pytest.mark.parametrize("base, hooks, name", EXTENDED_HOOKS, ids=[f"{b.__name__}.{n}" for b, _, n in EXTENDED_HOOKS])
def test_an_extended_hook_that_does_not_call_the_parent_s_is_refused_when_the_subclass_is_built(base, hooks, name):
    note = re.escape(hooks[name].note)
    parent = base.__name__
    expected = rf"^Mine\.{name} overrides {parent}'s without calling it: {parent} {note}; call super\(\)\.{name}"
    with pytest.raises(SettingsError, match=expected):
        check_hooks(subclass([name], calls_super=False, base=base), base, hooks)
    check_hooks(subclass([name], base=base), base, hooks)


def test_a_data_module_subclass_that_drops_the_loading_of_rows_is_refused_when_it_is_built():
    Mine = subclass(["setup"], calls_super=False, base=PromptDataModule)
    with pytest.raises(SettingsError, match=r"^Mine\.setup overrides PromptDataModule's without calling it"):
        data(Mine)


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
