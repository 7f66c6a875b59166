"""Every callback Lightning ships, classified once: honoured, or refused when a fit starts, in one line that says what to
use instead.

One Lightning batch is one RL step, ``RLModule`` optimises by hand (K epochs × M minibatches of optimiser steps per RL
step) and its loss is a policy-gradient surrogate, so a callback written for supervised training over a DataLoader may
mean nothing here, or something wrong. :data:`CALLBACKS` covers every name of ``lightning.pytorch.callbacks.__all__``;
``tests/test_lightning_callbacks.py`` enumerates them from Lightning, so a callback a new Lightning release adds fails
that test until it is classified here. :func:`refuse_unsupported_callbacks` runs in ``RLModule.configure_callbacks``,
which Lightning calls before any callback's ``setup``, from the command line and from Python alike; a subclass of a
refused callback is refused with it. Lightning calls every hook of ``Callback`` for RLModule but
:data:`HOOKS_NOT_CALLED`: a callback that has one of those is refused the same way.
"""

from __future__ import annotations

import lightning.pytorch.callbacks as lightning_callbacks
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_gspo.lightning.module_hooks import HOOKS
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED, Flag
from lit_gspo.runtime.user_errors import SettingsError

#: ``lightning.pytorch.callbacks``' names → how an RL fit treats them (``Flag.note``: what it does here, or, refused,
#: what to use instead)
CALLBACKS: dict[str, Flag] = {
    "Callback": Flag(HONOURED, "a callback of your own: every hook, an RL step per training batch"),
    "Checkpoint": Flag(HONOURED, "the base of ModelCheckpoint"),
    "ModelCheckpoint": Flag(HONOURED, "every_n_train_steps counts RL steps; monitors are checked at start"),
    "OnExceptionCheckpoint": Flag(HONOURED, "a checkpoint when the fit raises"),
    "EarlyStopping": Flag(
        HONOURED, "on any logged metric (val/reward, train/kl, ...); its monitor is checked at start"
    ),
    "LearningRateMonitor": Flag(HONOURED, "the learning rate at each RL step"),
    "DeviceStatsMonitor": Flag(HONOURED, "device statistics at each RL step (needs a logger)"),
    "ThroughputMonitor": Flag(HONOURED, "a batch is an RL step's prompts: batch_size_fn=len"),
    "Timer": Flag(HONOURED, "stops the fit after its duration, checked after each RL step"),
    "LambdaCallback": Flag(HONOURED, "outputs of on_train_batch_end: {'loss': the RL step's mean surrogate loss}"),
    "ModelSummary": Flag(HONOURED, "the policy's parameters"),
    "RichModelSummary": Flag(HONOURED, "the policy's parameters"),
    "ProgressBar": Flag(HONOURED, "the base of the progress bars"),
    "TQDMProgressBar": Flag(HONOURED, "counts RL steps (lit_gspo's RLProgressBar is one)"),
    "RichProgressBar": Flag(HONOURED, "counts RL steps"),
    "BasePredictionWriter": Flag(HONOURED, "trainer.predict's rows, completions and rewards, per batch or per epoch"),
    "BaseFinetuning": Flag(HONOURED, "a subclass freezes and thaws the modules it names (pl_module.policy...)"),
    "WeightAveraging": Flag(
        HONOURED,
        "an average of the policy over RL steps: validation and the export use it, rollouts the current policy "
        "(not under FSDP2)",
    ),
    "EMAWeightAveraging": Flag(
        HONOURED,
        "an exponential average of the policy over RL steps: validation and the export use it, rollouts the current "
        "policy (not under FSDP2)",
    ),
    "BackboneFinetuning": Flag(
        REFUSED,
        "RLModule has no `backbone`: train low-rank adapters with model.policy.lora, or freeze modules with a "
        "BaseFinetuning subclass",
    ),
    "BatchSizeFinder": Flag(
        REFUSED,
        "an RL step's prompts are data.prompts_per_step; its micro-batches are sized by "
        "model.update.micro_batch_tokens (auto: from free GPU memory)",
    ),
    "LearningRateFinder": Flag(
        REFUSED,
        "a learning-rate sweep reads a supervised loss; a policy-gradient surrogate's has no scale to compare: sweep "
        "the optimizer's lr with `lit-gspo ablate` and compare val/reward",
    ),
    "GradientAccumulationScheduler": Flag(
        REFUSED,
        "an RL step's optimiser steps are model.update.epochs × num_minibatches; a minibatch's micro-batches "
        "are accumulated by model.update.micro_batch_size or micro_batch_tokens",
    ),
    "StochasticWeightAveraging": Flag(
        REFUSED,
        "it averages per data epoch and replaces the learning-rate schedule: EMAWeightAveraging or "
        "WeightAveraging(avg_fn=...) average per RL step",
    ),
    "ModelPruning": Flag(
        REFUSED,
        "by default it prunes every module of the RLModule that has a weight, the frozen reference policy's too (the "
        "KL would be to a pruned reference): prune the exported hf_model",
    ),
    "SpikeDetection": Flag(
        REFUSED,
        "a policy-gradient surrogate's loss has mean ~0 and changes sign, so relative spikes flag nothing real: stop "
        "on train/kl or train/grad_norm with EarlyStopping(monitor=..., divergence_threshold=...)",
    ),
}


#: honoured, but not under FSDP2 (``ModelParallelStrategy``): what to use there
NOT_SHARDED = {
    "WeightAveraging": "it copies the whole module unsharded (Lightning: it does not support sharding): average "
    "the policy over checkpoints instead, or use DDP",
}


#: hooks of ``Callback`` that Lightning never calls for RLModule → what to use instead (it calls every other one)
HOOKS_NOT_CALLED = {"on_before_zero_grad": HOOKS["on_before_zero_grad"].note}  # as the module's own hook


def overrides(callback, hook: str) -> bool:
    """Whether ``callback`` has a ``hook`` of its own: its class's, or an attribute (``LambdaCallback``'s)."""
    base = lightning_callbacks.Callback
    return hook in getattr(callback, "__dict__", {}) or getattr(type(callback), hook) is not getattr(base, hook)


def refuse_unsupported_callbacks(callbacks, strategy=None) -> None:
    """Raise :class:`SettingsError` (``lit-gspo``: one line) naming the first refused callback among ``callbacks`` (a
    trainer's), or the first hook of one that would never be called (:data:`HOOKS_NOT_CALLED`), and what to use;
    ``strategy``: the trainer's (under FSDP2 :data:`NOT_SHARDED` are refused too)."""
    sharded = isinstance(strategy, ModelParallelStrategy)
    for callback in callbacks:
        for hook, note in HOOKS_NOT_CALLED.items():
            if overrides(callback, hook):
                raise SettingsError(f"{type(callback).__name__}.{hook}: not called by lit_gspo: {note}")
        for name, flag in CALLBACKS.items():
            refused = getattr(lightning_callbacks, name, None)
            if flag.kind == REFUSED and refused is not None and isinstance(callback, refused):
                raise flag.refusal(type(callback).__name__)
        for name, note in NOT_SHARDED.items():
            if sharded and isinstance(callback, getattr(lightning_callbacks, name)):
                raise SettingsError(
                    f"{type(callback).__name__}: not supported under FSDP2 (ModelParallelStrategy): {note}"
                )


def restart_weight_averages(module) -> None:
    """After the warm start: a ``WeightAveraging`` callback copied the module at its ``setup``, before the warm start
    changed the policy, and validation swaps that copy in until its first update (step 0's ``val/reward`` would be
    the policy's before the warm start). Its public ``setup``, called again, copies the warm-started policy."""
    for callback in module.trainer.callbacks:
        if isinstance(callback, lightning_callbacks.WeightAveraging):
            callback.setup(module.trainer, module, "fit")
