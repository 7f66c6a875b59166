"""Atomic, hashed checkpoint writes for a fit built without the CLI (which sets them already)."""

from __future__ import annotations

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback

from lit_gspo.lightning.checkpoint_io import AtomicCheckpointIO


class AtomicCheckpoints(Callback):
    """When the strategy has Lightning's plain ``TorchCheckpointIO``, :class:`AtomicCheckpointIO` instead (a public
    setter of the strategy): a kill mid-write leaves the previous checkpoint, and each has its sha256 beside it."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
