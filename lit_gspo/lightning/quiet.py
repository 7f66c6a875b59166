"""Lightning's messages that a user of lit_gspo cannot act on, silenced at their source.

Each filter names one message exactly (a regex on its start) and says why it does not apply here;
every other warning, Lightning's included, still shows. Installed by ``RLModule.__init__`` (before
``Trainer.fit`` validates its configuration) and by ``RLCLI``; installing twice changes nothing.
Imports nothing heavy: ``RLModule`` and the CLI call it, and it stays free of Lightning itself.
"""

from __future__ import annotations

import logging
import warnings

WARNINGS = (
    # The frozen reference policy is in eval mode by design, and the policy samples in eval mode.
    r"Found \d+ module\(s\) in eval mode at the start of training",
    # A checkpoint is the state after an RL step's updates (resuming continues with the next step); the
    # warning's sample code saves `pl_module.layer`, which RLModule does not have.
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state",
    # Lightning's own pytree helper calls an API torch 2.13 deprecated; nothing in a user's run can change it.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)

# Lightning logs an advertisement for its cloud logger at every Trainer construction.
_INFO = (
    "try installing [litlogger]",
    # and for its model registry, at every Trainer that checkpoints (a validate or predict too)
    "try installing [litmodels]",
    # trainer.validate, then trainer.fit (from Python): the module's own callbacks are attached to each, the second
    # time over those of the first (RLModule.configure_callbacks), which is what is meant
    "returned in `LightningModule.configure_callbacks` will override existing callbacks passed to Trainer",
)


class _DropLightningTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _INFO)


_TIP_FILTER = _DropLightningTips()


def silence_lightning_noise() -> None:
    """Install the filters (idempotent: ``warnings.filterwarnings`` moves an existing one to the front)."""
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _TIP_FILTER not in logger.filters:
            logger.addFilter(_TIP_FILTER)


# Only `lit-gspo ablate`: it consumed sys.argv and hands each arm's arguments to LightningCLI itself, so
# LightningCLI's guard against passing both `args` and command-line arguments is a false alarm there.
CLI_ARGS_WARNING = r"LightningCLI's args parameter is intended to run from within Python"
