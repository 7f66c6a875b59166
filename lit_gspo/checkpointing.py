"""Checkpoints that resume exactly and survive a crash mid-write.

What a Lightning checkpoint of an ``RLModule`` run holds: the module's state (policy, reference,
critic), the optimiser state (bitsandbytes 8-bit state included), LR schedulers, the loops' progress
(``global_step``), the train loader's (epoch, position) (``PromptLoader.state_dict``) and — added by
``RLModule.on_save_checkpoint`` through :func:`rng_states` — every rank's torch / numpy / python (and
CUDA) RNG states and the dynamic-sampling refill generator. Lightning itself does not save RNG states.

Atomic writes: Lightning's ``TorchCheckpointIO`` writes the file in place, so a process killed during
the write leaves a truncated ``last.ckpt``. :class:`AtomicCheckpointIO` writes ``.<name>.tmp-<pid>``
in the same directory, fsyncs it and ``os.replace``-s it over the target (atomic on POSIX), so the
previous checkpoint stays loadable until the new one is complete. The temporary name does not match
``last*.ckpt`` or ``*.ckpt``, so ``--ckpt_path last`` never picks it up. Distributed (sharded)
checkpoints of ``ModelParallelStrategy`` are directories: :class:`AtomicModelParallelStrategy` writes them
to a temporary directory and swaps it in with two renames.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_gspo.distributed import gather_objects


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file next to the target, fsync, then ``os.replace``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path)  # remote storage: no atomic rename to rely on
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(path.parent)

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        """Serialise ``checkpoint`` into the open file ``f`` (a hook for tests that crash mid-write)."""
        torch.save(checkpoint, f)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints (directories) are swapped in whole.

    Every rank writes its shard into ``.<name>.tmp``; rank 0 then renames the old checkpoint away,
    the new one into place, and deletes the old one. A crash before the swap leaves the previous
    checkpoint untouched; in the instant between the two renames only ``.<name>.old`` exists, which
    :meth:`load_checkpoint` falls back to.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        tmp, old = path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()
        if self.global_rank == 0:
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        old = path.parent / f".{path.name}.old"
        if not path.exists() and old.exists():
            checkpoint_path = old
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


def make_atomic(strategy: Any) -> Any:
    """Switch a plain ``ModelParallelStrategy`` instance to :class:`AtomicModelParallelStrategy` (in place)."""
    if type(strategy) is ModelParallelStrategy:
        strategy.__class__ = AtomicModelParallelStrategy
    return strategy


# ---------------------------------------------------------------------- RNG states
def _local_rng_state(refill_generator: torch.Generator | None) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if refill_generator is not None:
        state["refill"] = refill_generator.get_state()
    return state


def rng_states(refill_generator: torch.Generator | None = None) -> list[dict[str, Any]]:
    """Every rank's RNG states, rank-ordered (collective: all ranks must call it)."""
    return gather_objects(_local_rng_state(refill_generator))


def restore_rng_states(states: list[dict[str, Any]], rank: int, refill_generator: torch.Generator | None = None) -> None:
    """Restore this rank's RNG states saved by :func:`rng_states` (needs the same number of ranks)."""
    if rank >= len(states):
        raise ValueError(f"the checkpoint holds RNG states of {len(states)} processes; this is rank {rank}: resume with "
                         "the same number of processes to continue exactly")
    state = states[rank]
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if refill_generator is not None and "refill" in state:
        refill_generator.set_state(state["refill"])


# ---------------------------------------------------------------------- CLI defaults
def configure_checkpointing(config: dict, callbacks: list, every_n_steps: int | None) -> None:
    """Trainer defaults of the CLI: FSDP1 refused, atomic writes, and ``<root>/checkpoints/last.ckpt`` every n steps.

    With ``trainer.enable_checkpointing`` (Lightning's default) and no ``ModelCheckpoint`` given, one is
    added that writes ``last.ckpt`` only (``save_top_k=0``) every ``every_n_steps`` optimiser steps
    (0/None: at the end of each epoch), into ``<default_root_dir>/checkpoints`` so that a new run with
    ``--ckpt_path last`` finds it whatever logger version directory it gets.
    """
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_gspo.distributed import check_strategy

    strategy = config.get("strategy")
    check_strategy(strategy)
    make_atomic(strategy)
    plugins = config.get("plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        config["plugins"] = plugins + [AtomicCheckpointIO()]
    if config.get("enable_checkpointing") is False:
        return
    given = list(callbacks) + list(config.get("callbacks") or [])
    if any(isinstance(c, ModelCheckpoint) for c in given):
        return
    root = Path(config.get("default_root_dir") or os.getcwd())
    callbacks.append(ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, save_top_k=0,
                                     every_n_train_steps=every_n_steps or None))
