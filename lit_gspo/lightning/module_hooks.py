"""Every hook of a LightningModule, classified once for a subclass of RLModule: free, extended, or refused when the
subclass is built, in one line that says what to do instead.

A Lightning user subclasses a module to log, inspect or adjust it (``class Mine(RLModule): def on_train_batch_end``).
Two things go silently wrong there unless they are refused:

* RLModule implements the hook (the RL step, validation, checkpoints, the warm start, ...): an override that never
  calls the parent's drops that work (no ``val/reward``, no warm start, a resume that restores nothing). :data:`EXTENDED`
  hooks are refused unless the override's code names the hook (``super().on_validation_epoch_end()``): the necessary
  condition for calling it, which a check can see before any run.
* Lightning never calls it for RLModule: RLModule optimises by hand (``automatic_optimization = False``: K epochs × M
  minibatches of optimiser steps per RL step), so ``optimizer_step``, ``optimizer_zero_grad`` and the gradient-clipping
  hooks are skipped, and its prompts come from the data module, whose loaders Lightning takes over the module's.

Every other hook is free: Lightning calls it as for any LightningModule. :data:`HOOKS` covers every hook of
``lightning.pytorch.core.hooks``' three classes and LightningModule's own (its other methods, :data:`METHODS`, are for a
module to call); ``tests/test_module_hooks.py`` enumerates them from Lightning, so a hook a new release adds fails that
test until it is classified here. :func:`check_hooks` runs in ``RLModule.__init__``, the one method a subclass cannot
skip, before any fit, validation, test or prediction. A subclass of ``PromptDataModule`` is checked the same way
against :data:`DATA_HOOKS` (it loads the rows, deals them per rank, resumes where it was).
"""

from __future__ import annotations

import inspect
from types import CodeType

from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED, Flag
from lit_gspo.runtime.user_errors import SettingsError

#: an override must call the parent's implementation (``Flag.note``: what the parent does there)
EXTENDED = "extended"

_LOADERS = (
    "the prompts come from the data module, whose {name} Lightning takes (PromptDataModule: rows in memory by "
    "from_datasets, a file or task by train_source)"
)
_BY_HAND = (
    "RLModule optimises by hand (K epochs x M minibatches of optimiser steps per RL step), so Lightning never calls it"
)

#: every hook of a LightningModule → how a subclass of RLModule may override it
HOOKS: dict[str, Flag] = {
    # the steps
    "training_step": Flag(EXTENDED, "is the RL step: rollout, advantages, the update's optimiser steps, its metrics"),
    "validation_step": Flag(EXTENDED, "samples the batch's held-out prompts and scores them"),
    "test_step": Flag(EXTENDED, "samples the batch's test prompts and scores them"),
    "predict_step": Flag(EXTENDED, "draws the batch's completions and scores them"),
    # set-up
    "configure_optimizers": Flag(
        EXTENDED,
        "builds model.optimizer and model.lr_scheduler over the policy's (and a value head's) parameters, sharded "
        "under FSDP2: choose them there (RLModule(optimizer=..., lr_scheduler=...))",
    ),
    "configure_callbacks": Flag(
        EXTENDED,
        "checks the trainer's strategy and callbacks and adds the run lock, resumed logs and the checkpoint on SIGTERM",
    ),
    "configure_model": Flag(EXTENDED, "shards the policy under FSDP2 (ModelParallelStrategy)"),
    "configure_sharded_model": Flag(REFUSED, "deprecated by Lightning: extend configure_model (it shards the policy)"),
    "prepare_data": Flag(HONOURED, "once per node, before setup"),
    "setup": Flag(EXTENDED, "checks the settings against the trainer and seeds each rank's refill prompts"),
    "teardown": Flag(HONOURED, "after each fit, validate, test and predict"),
    "train_dataloader": Flag(REFUSED, _LOADERS.format(name="train_dataloader")),
    "val_dataloader": Flag(REFUSED, _LOADERS.format(name="val_dataloader")),
    "test_dataloader": Flag(REFUSED, _LOADERS.format(name="test_dataloader")),
    "predict_dataloader": Flag(REFUSED, _LOADERS.format(name="predict_dataloader")),
    "transfer_batch_to_device": Flag(HONOURED, "a batch is a list of prompt rows (dicts)"),
    "on_before_batch_transfer": Flag(HONOURED, "a batch is a list of prompt rows (dicts)"),
    "on_after_batch_transfer": Flag(HONOURED, "a batch is a list of prompt rows (dicts)"),
    # fit
    "on_fit_start": Flag(EXTENDED, "checks the data and makes a fresh run's warm start"),
    "on_fit_end": Flag(EXTENDED, "writes hf_model/ if the end of training did not"),
    "on_train_start": Flag(HONOURED, "after the warm start"),
    "on_train_end": Flag(EXTENDED, "writes the policy to hf_model/"),
    "on_train_epoch_start": Flag(HONOURED, "each pass over the prompts"),
    "on_train_epoch_end": Flag(EXTENDED, "steps a learning-rate schedule of interval epoch"),
    "on_train_batch_start": Flag(HONOURED, "before each RL step (returning -1 ends the epoch)"),
    "on_train_batch_end": Flag(HONOURED, "after each RL step: outputs are {'loss': its mean surrogate loss}"),
    # the update
    "backward": Flag(HONOURED, "each micro-batch's backward"),
    "on_before_backward": Flag(HONOURED, "each micro-batch's loss"),
    "on_after_backward": Flag(HONOURED, "each micro-batch's gradients, accumulated"),
    "on_before_optimizer_step": Flag(EXTENDED, "clips fp16's unscaled gradients"),
    "lr_scheduler_step": Flag(HONOURED, "each step of the learning-rate schedule, at its cadence"),
    "optimizer_step": Flag(
        REFUSED,
        f"{_BY_HAND}: a warm-up or decay is model.lr_scheduler (e.g. LinearLR); on_before_optimizer_step runs before "
        "each optimiser step",
    ),
    "optimizer_zero_grad": Flag(REFUSED, f"{_BY_HAND}: on_before_optimizer_step sees each step's gradients"),
    "on_before_zero_grad": Flag(REFUSED, f"{_BY_HAND}: on_before_optimizer_step sees each step's gradients"),
    "configure_gradient_clipping": Flag(
        REFUSED, f"{_BY_HAND}: the gradient norm is clipped by model.update.max_grad_norm (Trainer's gradient_clip_val)"
    ),
    "clip_gradients": Flag(
        REFUSED, f"{_BY_HAND}: the gradient norm is clipped by model.update.max_grad_norm (Trainer's gradient_clip_val)"
    ),
    # validation, test, predict
    "on_validation_start": Flag(EXTENDED, "sets the run's random state aside and seeds a sampled validation"),
    "on_validation_end": Flag(EXTENDED, "restores the run's random state"),
    "on_validation_epoch_start": Flag(EXTENDED, "hands the engine the weights to sample with"),
    "on_validation_epoch_end": Flag(EXTENDED, "logs val/reward and the validation's metrics"),
    "on_validation_batch_start": Flag(HONOURED, "before each batch of held-out prompts"),
    "on_validation_batch_end": Flag(HONOURED, "after each batch of held-out prompts"),
    "on_validation_model_eval": Flag(HONOURED, "before a validation"),
    "on_validation_model_train": Flag(HONOURED, "after a validation within a fit"),
    "on_validation_model_zero_grad": Flag(HONOURED, "before a validation within a fit"),
    "on_test_start": Flag(EXTENDED, "sets the random state aside and seeds a sampled test"),
    "on_test_end": Flag(EXTENDED, "restores the random state"),
    "on_test_epoch_start": Flag(EXTENDED, "hands the engine the weights to sample with"),
    "on_test_epoch_end": Flag(EXTENDED, "logs test/reward and the test's metrics"),
    "on_test_batch_start": Flag(HONOURED, "before each batch of test prompts"),
    "on_test_batch_end": Flag(HONOURED, "after each batch of test prompts"),
    "on_test_model_eval": Flag(HONOURED, "before a test"),
    "on_test_model_train": Flag(HONOURED, "after a test"),
    "on_predict_start": Flag(EXTENDED, "sets the random state aside and seeds sampled predictions"),
    "on_predict_end": Flag(EXTENDED, "restores the random state"),
    "on_predict_epoch_start": Flag(EXTENDED, "hands the engine the weights to sample with"),
    "on_predict_epoch_end": Flag(HONOURED, "after the predictions"),
    "on_predict_batch_start": Flag(HONOURED, "before each batch of prompts"),
    "on_predict_batch_end": Flag(HONOURED, "after each batch: outputs are its completions"),
    "on_predict_model_eval": Flag(HONOURED, "before the predictions"),
    # checkpoints
    "on_save_checkpoint": Flag(EXTENDED, "saves the run's state (RL steps, every random stream, ...)"),
    "on_load_checkpoint": Flag(EXTENDED, "restores the run's state (RL steps, every random stream, ...)"),
}

#: LightningModule's other methods: a module calls them (overriding one changes what the call does, as anywhere)
METHODS = (
    "all_gather", "forward", "freeze", "load_from_checkpoint", "log", "log_dict", "lr_schedulers", "manual_backward",
    "optimizers", "print", "to_onnx", "to_tensorrt", "to_torchscript", "toggle_optimizer", "toggled_optimizer",
    "unfreeze", "untoggle_optimizer",
)  # fmt: skip


#: every hook of a LightningDataModule → how a subclass of PromptDataModule may override it
DATA_HOOKS: dict[str, Flag] = {
    "prepare_data": Flag(HONOURED, "once per node, before setup"),
    "setup": Flag(
        EXTENDED,
        "loads the train and held-out rows that the RL step, the warm start and dynamic sampling's refills read",
    ),
    "teardown": Flag(HONOURED, "after each fit, validate, test and predict"),
    "train_dataloader": Flag(
        EXTENDED,
        "deals each rank its own prompts_per_step rows per RL step, shuffled by its seed, resumed where it was",
    ),
    "val_dataloader": Flag(EXTENDED, "gives every rank the same held-out batches (validation_step samples its share)"),
    "test_dataloader": Flag(EXTENDED, "gives every rank the same held-out batches (test_step samples its share)"),
    "predict_dataloader": Flag(EXTENDED, "gives every rank the same held-out batches (predict_step samples its share)"),
    "transfer_batch_to_device": Flag(HONOURED, "a batch is a list of prompt rows (dicts)"),
    "on_before_batch_transfer": Flag(HONOURED, "a batch is a list of prompt rows (dicts)"),
    "on_after_batch_transfer": Flag(HONOURED, "a batch is a list of prompt rows (dicts)"),
    "state_dict": Flag(HONOURED, "kept in checkpoints, given back on resume"),
    "load_state_dict": Flag(HONOURED, "a checkpoint's state_dict, on resume"),
    "on_exception": Flag(HONOURED, "when a run raises"),
}

#: LightningDataModule's other methods: class methods that build one
DATA_METHODS = ("from_datasets", "load_from_checkpoint")


def names_in(code: CodeType) -> set[str]:
    """The attribute and global names ``code`` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= names_in(const)
    return names


def calls_parent(function, name: str) -> bool:
    """Whether ``function`` (an override of hook ``name``) may call the parent's: its code names the hook
    (``super().name(...)``, ``RLModule.name(self, ...)``). Without code to read (a builtin, a callable object) it may."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is None or name in names_in(code)


def check_hooks(cls: type, base: type, hooks: dict[str, Flag] = HOOKS) -> None:
    """Raise :class:`SettingsError` (``lit-gspo``: one line) naming the first hook of ``cls`` (``base``: RLModule, or
    PromptDataModule with :data:`DATA_HOOKS`, or a subclass) that Lightning would not call, or that overrides
    ``base``'s without calling it, and what to do instead. Every class before ``base`` in ``cls``'s method resolution
    order is read (a mixin's override breaks the chain too)."""
    for klass in cls.__mro__[: cls.__mro__.index(base)]:
        for name, flag in hooks.items():
            override = klass.__dict__.get(name)
            if override is None:
                continue
            where = f"{klass.__name__}.{name}"
            if flag.kind == REFUSED:
                raise SettingsError(f"{where}: not called by lit_gspo: {flag.note}")
            if flag.kind == EXTENDED and callable(override) and not calls_parent(override, name):
                raise SettingsError(
                    f"{where} overrides {base.__name__}'s without calling it: {base.__name__} {flag.note}; call "
                    f"super().{name}(...) in yours"
                )
