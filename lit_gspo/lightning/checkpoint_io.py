"""Lightning's checkpoint IO with atomic, hashed writes and checked reads (``lit_gspo.runtime.checkpoint_files``).

What a Lightning checkpoint of an ``RLModule`` run holds: the module's state (policy, reference, critic), the
optimiser state (bitsandbytes 8-bit state included), LR schedulers, the loops' progress (``global_step``), the train
loader's (epoch, position) (``PromptLoader.state_dict``) and — added by ``RLModule.on_save_checkpoint`` through
``lit_gspo.runtime.rng.rng_states`` — every rank's RNG states and the dynamic-sampling refill generator.

Lightning's ``TorchCheckpointIO`` writes the file in place, so a process killed during the write leaves a truncated
``last.ckpt``. :class:`AtomicCheckpointIO` writes it aside and swaps it in, with a sha256 beside it that is checked
before loading. The temporary name does not match ``last*.ckpt`` or ``*.ckpt``, so ``--ckpt_path last`` never picks
it up. Distributed (sharded) checkpoints of FSDP2 are directories: ``lit_gspo.lightning.strategy`` swaps them in whole.
"""

from __future__ import annotations

from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from lit_gspo.runtime.checkpoint_files import load_verified, save_hashed, sha256_path


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file next to the target, fsync, then ``os.replace``; a sha256 beside it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path)  # remote storage: no atomic rename to rely on
        save_hashed(checkpoint, path, self._write)

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        """Serialise ``checkpoint`` into the open file ``f`` (a hook for tests that crash mid-write)."""
        torch.save(checkpoint, f)

    def load_checkpoint(
        self, path, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Refuse URLs, check the recorded sha256, and say what is wrong with a file that does not load."""
        return load_verified(
            path,
            lambda: super(AtomicCheckpointIO, self).load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            ),
        )

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        if isinstance(get_filesystem(path), LocalFileSystem) and sha256_path(path).exists():
            sha256_path(path).unlink()
