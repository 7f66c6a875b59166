"""Atomic, hashed checkpoint writes for a fit built without the CLI (which sets them already)."""

from __future__ import annotations

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback
from lightning.pytorch.plugins import AsyncCheckpointIO

from lit_gspo.lightning.checkpoint_io import AtomicCheckpointIO


class AtomicCheckpoints(Callback):
    """When the strategy has Lightning's plain ``TorchCheckpointIO``, :class:`AtomicCheckpointIO` instead (a public
    setter of the strategy): a kill mid-write leaves the previous checkpoint, and each has its sha256 beside it. An
    ``AsyncCheckpointIO`` around the plain one writes through an atomic one in its thread."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if stage == "fit" and type(io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        elif stage == "fit" and type(io) is AsyncCheckpointIO and type(io.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AsyncCheckpointIO(AtomicCheckpointIO())
