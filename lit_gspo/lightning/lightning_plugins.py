"""Every plugin Lightning ships, classified once for RLModule: honoured, or refused when a run starts, in one line that
says what to use instead.

:data:`PLUGINS` covers every name of ``lightning.pytorch.plugins.__all__``; ``tests/test_lightning_plugins.py``
enumerates them from Lightning, so a plugin a new release adds fails that test until it is classified here.
:func:`check_plugins` runs in ``RLModule.setup`` on the trainer's precision plugin and checkpoint IO (a precision
given as text is checked by ``precisions.py``); a subclass is treated as the plugin it extends.
"""

from __future__ import annotations

import lightning.pytorch.plugins as lightning_plugins

from lit_gspo.lightning.strategy import STRATEGIES
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED, Flag

#: ``lightning.pytorch.plugins``' names → how an RL run treats them
PLUGINS: dict[str, Flag] = {
    "Precision": Flag(HONOURED, "full precision (32-true), and the base of every precision plugin"),
    "MixedPrecision": Flag(HONOURED, "16-mixed or bf16-mixed autocast, as --trainer.precision gives it"),
    "HalfPrecision": Flag(HONOURED, "bf16-true (16-true fits are refused: lit_gspo/lightning/precisions.py)"),
    "DoublePrecision": Flag(HONOURED, "64-true"),
    "BitsandbytesPrecision": Flag(
        REFUSED,
        "it quantises the policy's Linear layers and freezes them, so the update would train only the embeddings and "
        "norms: train LoRA adapters (model.policy.lora) on a bf16 policy, with an 8-bit optimiser "
        "(bitsandbytes.optim.AdamW8bit) to save memory",
    ),
    "TransformerEnginePrecision": Flag(
        REFUSED, "it swaps the policy's Linear layers for Transformer Engine's, never run with the update: bf16-mixed"
    ),
    "DeepSpeedPrecision": Flag(REFUSED, f"DeepSpeed's: {STRATEGIES['deepspeed'].note}"),
    "FSDPPrecision": Flag(REFUSED, f"FSDP1's: {STRATEGIES['fsdp'].note}"),
    "XLAPrecision": Flag(REFUSED, f"XLA's: {STRATEGIES['xla'].note}"),
    "CheckpointIO": Flag(HONOURED, "a checkpoint IO of your own: every checkpoint is written and read through it"),
    "TorchCheckpointIO": Flag(HONOURED, "made atomic and hashed (AtomicCheckpointIO)"),
    "AsyncCheckpointIO": Flag(HONOURED, "checkpoints written in a thread, each atomic and hashed (AtomicCheckpointIO)"),
    "XLACheckpointIO": Flag(REFUSED, f"XLA's: {STRATEGIES['xla'].note}"),
    "LayerSync": Flag(HONOURED, "the base of TorchSyncBatchNorm"),
    "TorchSyncBatchNorm": Flag(HONOURED, "converts BatchNorm layers (a causal LM has none)"),
}


def check_plugins(plugins) -> None:
    """Raise :class:`SettingsError` (``lit-gspo``: one line) naming the first refused plugin among ``plugins`` (a
    trainer's precision plugin and checkpoint IO) and what to use; a plugin is classified by the nearest of Lightning's
    classes it is an instance of."""
    for plugin in plugins:
        for klass in type(plugin).__mro__:
            flag = PLUGINS.get(klass.__name__)
            if flag is not None and getattr(lightning_plugins, klass.__name__) is klass:
                if flag.kind == REFUSED:
                    raise flag.refusal(type(plugin).__name__)
                break
