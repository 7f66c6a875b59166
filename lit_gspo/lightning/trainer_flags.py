"""Every setting ``lit-gspo fit`` accepts from Lightning, classified once: honoured, mapped to lit_gspo's own setting,
or refused at start in one line.

One Lightning batch is one RL step and ``RLModule`` optimises by hand (K epochs × M minibatches of optimiser steps per
RL step: ``lit_gspo.rl.learn.learner``), so some of Lightning's flags, written for automatic optimisation over a
DataLoader, mean something else here. :data:`TRAINER_FLAGS` covers every parameter of ``lightning.pytorch.Trainer``
and :data:`TOP_LEVEL` every top-level key of ``lit-gspo fit``; ``tests/test_trainer_flags.py`` enumerates both from
Lightning and from the CLI's parser, so a setting a new Lightning release adds fails that test until it is classified
here. :func:`refuse_unsupported` is what the CLI runs at start (``RLCLI.before_instantiate_classes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_gspo.runtime.user_errors import SettingsError

HONOURED, MAPPED, REFUSED = "honoured", "mapped", "refused"


@dataclass(frozen=True)
class Flag:
    """How one setting is treated.

    ``kind``: :data:`HONOURED` (Lightning's meaning holds), :data:`MAPPED` (read as lit_gspo's own setting, ``note``
    says which; a value that cannot be mapped is refused by the mapping, ``lit_gspo.lightning.cli``), or
    :data:`REFUSED` (any value but the ``accepts`` ones stops the run at start: ``note`` is what to use instead).
    ``example``: a value a user might type, which the tests try (for a refused flag: one that is refused).
    """

    kind: str
    note: str
    accepts: Callable[[Any], bool] | None = None  # REFUSED: the values that are fine (the default, a no-op)
    example: Any = None

    def refusal(self, what: str) -> SettingsError:
        """The one-line error refusing ``what`` (a flag and its value, a class, a name): ``note`` says what to use."""
        return SettingsError(f"{what}: not supported by lit_gspo: {self.note}")


def _is(*values) -> Callable[[Any], bool]:
    return lambda value: value in values


#: ``lightning.pytorch.Trainer``'s parameters (``self`` aside).
TRAINER_FLAGS: dict[str, Flag] = {
    "accelerator": Flag(HONOURED, "cpu, gpu/cuda, auto", example="cpu"),
    "strategy": Flag(
        HONOURED,
        "ddp, ModelParallelStrategy (FSDP2, made atomic); each of Lightning's others is refused at start: "
        "lit_gspo/lightning/strategy.py",
        example="auto",
    ),
    "devices": Flag(HONOURED, "processes per node", example=1),
    "num_nodes": Flag(HONOURED, "nodes", example=1),
    "precision": Flag(
        HONOURED,
        "Lightning's precision plugin; `auto`: bf16-mixed where bf16 is native, 32-true elsewhere; 16-true fits and "
        "transformer-engine are refused at start (lit_gspo/lightning/precisions.py)",
        example="bf16-mixed",
    ),
    "logger": Flag(HONOURED, "default: metrics.csv (RunCSVLogger, continued by a resume); false: none", example=False),
    "callbacks": Flag(
        HONOURED, "each of Lightning's is honoured or refused at start: lit_gspo/lightning/lightning_callbacks.py"
    ),
    "fast_dev_run": Flag(HONOURED, "one RL step and one validation batch; writes nothing", example=True),
    "max_epochs": Flag(HONOURED, "epochs of the prompt set", example=1),
    "min_epochs": Flag(HONOURED, "EarlyStopping cannot stop before", example=1),
    "max_steps": Flag(HONOURED, "RL steps (one Lightning step per RL step)", example=4),
    "min_steps": Flag(HONOURED, "RL steps; EarlyStopping cannot stop before", example=2),
    "max_time": Flag(HONOURED, "the run stops after the RL step that passes it, then validates", example="00:00:10:00"),
    "limit_train_batches": Flag(HONOURED, "RL steps per epoch", example=2),
    "limit_val_batches": Flag(HONOURED, "batches of data.val_batch_size held-out prompts per validation", example=1),
    "limit_test_batches": Flag(HONOURED, "batches of held-out prompts for `lit-gspo test`", example=1),
    "limit_predict_batches": Flag(
        REFUSED, "lit-gspo predict is `lit-gspo eval`, which writes completions (--limit)", accepts=_is(None), example=2
    ),
    "overfit_batches": Flag(
        REFUSED,
        "lit_gspo's prompt loader is not cut by Lightning: to train on a few prompts use "
        "--data.num_train N (and --data.num_val N)",
        accepts=_is(0, 0.0, None),
        example=1,
    ),
    "val_check_interval": Flag(
        MAPPED,
        "an int is model.validation.every_n_steps (RL steps); a float keeps Lightning's fraction of an epoch",
        example=3,
    ),
    "check_val_every_n_epoch": Flag(
        MAPPED,
        "None when validation counts RL steps (set by the CLI); with a float val_check_interval, Lightning's meaning",
        example=None,
    ),
    "num_sanity_val_steps": Flag(
        HONOURED,
        "-1 by default: the sanity check over every held-out batch is val/reward at step 0 (0: none; n: n batches, "
        "a check that logs nothing)",
        example=1,
    ),
    "log_every_n_steps": Flag(HONOURED, "train/* rows every n RL steps (1 by default)", example=2),
    "enable_checkpointing": Flag(
        HONOURED, "<root>/checkpoints/last.ckpt every --checkpoint_every_n_steps", example=False
    ),
    "enable_progress_bar": Flag(HONOURED, "the RL-step bar", example=False),
    "enable_model_summary": Flag(HONOURED, "off by default", example=True),
    "accumulate_grad_batches": Flag(
        REFUSED,
        "one Lightning batch is one RL step, and its update is K epochs × M minibatches "
        "(--model.update.epochs, --model.update.num_minibatches); a minibatch too large "
        "for memory is accumulated over --model.update.micro_batch_size rows",
        accepts=_is(1, None),
        example=4,
    ),
    "gradient_clip_val": Flag(
        MAPPED, "model.update.max_grad_norm (the learner clips after each minibatch; 0: none)", example=0.5
    ),
    "gradient_clip_algorithm": Flag(MAPPED, "norm only (model.update.max_grad_norm); value is refused", example="norm"),
    "deterministic": Flag(
        HONOURED, "torch's deterministic algorithms (on CPU lit_gspo turns them on, warn_only)", example=True
    ),
    "benchmark": Flag(HONOURED, "cudnn.benchmark", example=False),
    "inference_mode": Flag(HONOURED, "validation under inference_mode (true) or no_grad (false)", example=False),
    "use_distributed_sampler": Flag(
        REFUSED,
        "the prompt loader always shards rows by rank itself (a DistributedSampler "
        "Lightning leaves alone): leave it unset",
        accepts=_is(True, None),
        example=False,
    ),
    "profiler": Flag(HONOURED, "simple, advanced, pytorch: profiles Lightning's hooks", example="simple"),
    "detect_anomaly": Flag(
        HONOURED, "autograd anomaly detection around the run (manual backward included)", example=True
    ),
    "barebones": Flag(
        REFUSED,
        "lit-gspo fit always writes metrics.csv, a checkpoint and a progress bar: turn them off with "
        "--trainer.logger false, --trainer.enable_checkpointing false, "
        "--trainer.enable_progress_bar false",
        accepts=_is(False, None),
        example=True,
    ),
    "plugins": Flag(
        HONOURED, "each of Lightning's is honoured or refused at start: lit_gspo/lightning/lightning_plugins.py"
    ),
    "sync_batchnorm": Flag(HONOURED, "Lightning converts BatchNorm layers (a causal LM has none)", example=True),
    "reload_dataloaders_every_n_epochs": Flag(
        REFUSED,
        "the prompt loader draws a new seeded order every epoch itself, "
        "and its position is saved in checkpoints: leave it 0",
        accepts=_is(0, None),
        example=1,
    ),
    "default_root_dir": Flag(HONOURED, "the run directory (one run per directory)", example="runs/x"),
    "enable_autolog_hparams": Flag(HONOURED, "the loggers get the module's hyperparameters", example=False),
    "model_registry": Flag(
        REFUSED,
        "lit_gspo does not upload to Lightning's model registry: --push_to_hub REPO uploads the exported model",
        accepts=_is(None),
        example="my-model",
    ),
}

#: The top-level keys of ``lit-gspo fit`` (beside ``trainer``).
TOP_LEVEL: dict[str, Flag] = {
    "config": Flag(HONOURED, "YAML files, later ones override"),
    "print_config": Flag(HONOURED, "prints the config with what null settings resolve to"),
    "seed_everything": Flag(HONOURED, "the run's seed: the policy's init, the sampling and the data order follow it"),
    "trainer": Flag(HONOURED, "the Trainer's flags: TRAINER_FLAGS"),
    "model": Flag(HONOURED, "RLModule's settings"),
    "data": Flag(HONOURED, "PromptDataModule's settings"),
    "optimizer": Flag(MAPPED, "model.optimizer (given both ways: refused)"),
    "lr_scheduler": Flag(
        MAPPED,
        "model.lr_scheduler (given both ways: refused); stepped after every optimiser step, "
        "a ReduceLROnPlateau when its monitored metric is logged",
    ),
    "ckpt_path": Flag(HONOURED, "resume (`last`: <root>/checkpoints/last.ckpt)"),
    "weights_only": Flag(HONOURED, "torch.load's weights_only when resuming"),
    "checkpoint_every_n_steps": Flag(HONOURED, "lit_gspo's: last.ckpt every n RL steps"),
    "push_to_hub": Flag(HONOURED, "lit_gspo's: upload the export after training"),
    "hub_private": Flag(HONOURED, "lit_gspo's: with push_to_hub"),
}


def refuse_unsupported(trainer) -> None:
    """Raise :class:`SettingsError` (one line: the flag, its value, what to use) for a refused Trainer flag set to a
    value other than its no-op default. ``trainer``: the parsed ``trainer`` group (a mapping)."""
    for name, flag in TRAINER_FLAGS.items():
        if flag.kind != REFUSED or name not in trainer:
            continue
        value = trainer[name]
        if not flag.accepts(value):
            raise flag.refusal(f"--trainer.{name} {_text(value)}")


def _text(value) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)
