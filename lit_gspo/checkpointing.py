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

Integrity: beside each checkpoint file :class:`AtomicCheckpointIO` writes ``<name>.sha256`` (``sha256sum``
format, hashed while the file is written) and checks it before loading; a mismatch, an empty or truncated
file, random bytes or a pickle that holds Python objects are reported as a :class:`CheckpointError` naming
the file (never with torch's advice to load it unsafely). Remote ``ckpt_path`` URLs are refused: Lightning
would unpickle a downloaded checkpoint without the safe loader, and nothing checks its content.

The Hugging Face export is written aside as well (:func:`written_aside`: ``.hf_model.tmp-<pid>``, then
swapped in), so a kill during ``save_pretrained`` leaves the previous export, or none, never a partial one.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_gspo.distributed import gather_objects


class CheckpointError(RuntimeError):
    """A checkpoint that is not loaded as it is: corrupt, truncated, changed since it was written, unsafe, or remote."""


SHA256_SUFFIX = ".sha256"


def sha256_path(path: str | Path) -> Path:
    """Where the content hash of checkpoint ``path`` is kept: ``<path>.sha256`` (``sha256sum -c`` reads it)."""
    path = Path(path)
    return path.parent / (path.name + SHA256_SUFFIX)


def refuse_remote(path: Any) -> None:
    """Checkpoints are loaded from local files only: a URL is refused with what to do instead."""
    text = str(path)
    if "://" in text and not text.startswith("file://"):
        raise CheckpointError(
            f"ckpt_path={text!r} is a remote URL; checkpoints are loaded from local files only (Lightning would unpickle "
            "a downloaded checkpoint without the safe loader, which can run arbitrary code, and nothing would check its "
            f"content). Download it, with its {SHA256_SUFFIX} file if it has one, and pass the local path: "
            "--ckpt_path /path/to/last.ckpt")


class _HashingWriter:
    """A file wrapper that hashes what is written through it (torch.save writes sequentially)."""

    def __init__(self, file) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _recorded_digests(path: Path) -> set[str]:
    """The hashes listed in ``<path>.sha256`` (two while a new checkpoint is being swapped in); empty if there is none."""
    try:
        text = sha256_path(path).read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return set()
    return {line.split()[0].lower() for line in text.splitlines() if line.strip()}


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` if the file at ``path`` is empty or differs from the hash recorded beside it."""
    path = Path(path)
    if not path.is_file():
        return  # a missing file is Lightning's FileNotFoundError; a directory is a distributed checkpoint
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): its write did not complete. Resume from another "
                              "checkpoint, or start the run again without --ckpt_path")
    expected = _recorded_digests(path)
    if expected:
        actual = _file_sha256(path)
        if actual not in expected:
            raise CheckpointError(
                f"checkpoint {path} does not match its hash in {sha256_path(path)} (sha256 {actual}, recorded "
                f"{' or '.join(sorted(expected))}): the file is corrupt or truncated, or was changed after it was written. "
                f"Resume from another checkpoint; if you changed it on purpose, delete {sha256_path(path).name}")


def describe_load_error(path: Path, err: BaseException) -> str | None:
    """What a failed ``torch.load`` of ``path`` means, or None when the error is not about the file's content."""
    if isinstance(err, EOFError) or (path.is_file() and not zipfile.is_zipfile(path)):
        return (f"checkpoint {path} is corrupt or truncated: it is not a complete torch checkpoint (a zip archive; "
                f"reading it raised {type(err).__name__})")
    if isinstance(err, RuntimeError) and ("PytorchStreamReader" in str(err) or "zip archive" in str(err)):
        return f"checkpoint {path} is corrupt or truncated: {str(err).splitlines()[0]}"
    if isinstance(err, pickle.UnpicklingError):
        detail = [line.strip() for line in str(err).splitlines()
                  if ("Unsupported" in line or "GLOBAL" in line or "error:" in line) and "weights_only" not in line]
        reason = detail[-1] if detail else "its pickle could not be read"
        if "GLOBAL" in reason or "global" in reason:
            return (f"checkpoint {path} holds Python objects that are not loaded ({reason}): only tensors and plain "
                    "data are read from checkpoints, so that loading one cannot run code. It was not written by "
                    "lit_gspo or comes from an untrusted source")
        return f"checkpoint {path} is corrupt: its content is not a readable checkpoint ({reason})"
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file next to the target, fsync, then ``os.replace``; a sha256 beside it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path)  # remote storage: no atomic rename to rely on
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        sidecar = sha256_path(path)
        try:
            with open(tmp, "wb") as f:
                writer = _HashingWriter(f)
                self._write(checkpoint, writer)
                f.flush()
                os.fsync(f.fileno())
            digest = writer.sha256.hexdigest()
            # the sidecar lists the new hash and the old one until the swap is done: at every instant it
            # holds the hash of whatever file is in place
            previous = sorted(_recorded_digests(path) - {digest}) if path.exists() else []
            _write_text_atomically(sidecar, "".join(f"{d}  {path.name}\n" for d in [digest, *previous]))
            os.replace(tmp, path)
            _write_text_atomically(sidecar, f"{digest}  {path.name}\n")
        finally:
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(path.parent)

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        """Serialise ``checkpoint`` into the open file ``f`` (a hook for tests that crash mid-write)."""
        torch.save(checkpoint, f)

    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Refuse URLs, check the recorded sha256, and say what is wrong with a file that does not load."""
        refuse_remote(path)
        verify_checkpoint(path)
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except (EOFError, RuntimeError, pickle.UnpicklingError, KeyError, ValueError) as err:
            message = describe_load_error(Path(path), err)
            if message is None:
                raise
            raise CheckpointError(message) from None  # torch's text would suggest the unsafe loader

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        if isinstance(get_filesystem(path), LocalFileSystem) and sha256_path(path).exists():
            sha256_path(path).unlink()


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


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def written_aside(path: str | Path) -> Iterator[Path]:
    """Yield an empty directory beside ``path`` to write into; when the block succeeds, swap it in for ``path``.

    The directory is ``.<name>.tmp-<pid>``; the old ``path`` (if any) is renamed to ``.<name>.old-<pid>``, the new
    one renamed into place, then the old one deleted. A kill before the swap leaves the previous ``path`` whole; in
    the instant between the two renames there is no ``path`` (a resume writes it again), never a partial one.
    Leftovers of killed writers are removed by ``lit_gspo.safe_ends.clean_stale_temporaries`` at the next start.
    """
    path = Path(path)
    tmp, old = path.parent / f".{path.name}.tmp-{os.getpid()}", path.parent / f".{path.name}.old-{os.getpid()}"
    for leftover in (tmp, old):
        _remove(leftover)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        _remove(tmp)
        raise
    if path.exists() or path.is_symlink():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _remove(old)


def export_is_complete(path: str | Path) -> bool:
    """A Hugging Face model directory with its config and weights (what ``save_pretrained`` writes)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(
        any(path.glob(pattern)) for pattern in ("*.safetensors", "pytorch_model*.bin", "adapter_model.*"))


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints (directories) are swapped in whole. lit_gspo shards over
    data-parallel ranks only: give ``data_parallel_size`` = every process and ``tensor_parallel_size=1`` (the CLI fills
    them in for a ``ModelParallelStrategy`` given without sizes: ``lit_gspo.rlcli.atomic_strategy``).

    Every rank writes its shard into ``.<name>.tmp``; rank 0 then renames the old checkpoint away,
    the new one into place, and deletes the old one. A crash before the swap leaves the previous
    checkpoint untouched; in the instant between the two renames only ``.<name>.old`` exists, which
    :meth:`load_checkpoint` falls back to.
    """

    def __init__(self, *args, save_distributed_checkpoint: bool = True, **kwargs) -> None:
        super().__init__(*args, save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.distributed_checkpoint = save_distributed_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self.distributed_checkpoint:
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


# ---------------------------------------------------------------------- RNG states
def local_rng_state(refill_generator: torch.Generator | None = None) -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and python RNG states (and the refill generator's)."""
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
    return gather_objects(local_rng_state(refill_generator))


def restore_rng_states(states: list[dict[str, Any]], rank: int, refill_generator: torch.Generator | None = None) -> None:
    """Restore this rank's RNG states saved by :func:`rng_states` (needs the same number of ranks)."""
    if rank >= len(states):
        raise ValueError(f"the checkpoint holds RNG states of {len(states)} processes; this is rank {rank}: resume with "
                         "the same number of processes to continue exactly")
    restore_local_rng_state(states[rank], refill_generator)


def restore_local_rng_state(state: dict[str, Any], refill_generator: torch.Generator | None = None) -> None:
    """Restore this process's RNG states saved by :func:`local_rng_state`."""
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
class LastCheckpoint(ModelCheckpoint):
    """``<root>/checkpoints/last.ckpt`` every n optimiser steps, and after the final step too: a 60-step run with
    n = 50 ends with step 60's ``last.ckpt``, not step 50's (Lightning's ``ModelCheckpoint`` saves on its interval only).
    Nothing under ``fast_dev_run``."""

    def __init__(self, dirpath, every_n_train_steps: int | None) -> None:
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps)
        self.every = every_n_train_steps

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run or (self.every and trainer.global_step % self.every == 0):  # saved on the interval
            return
        trainer.save_checkpoint(os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION))


def configure_checkpointing(config: dict, callbacks: list, every_n_steps: int | None) -> None:
    """Trainer defaults of the CLI: FSDP1 refused, atomic writes, and ``<root>/checkpoints/last.ckpt`` every n steps.

    With ``trainer.enable_checkpointing`` (Lightning's default), a :class:`LastCheckpoint` writes ``last.ckpt``
    every ``every_n_steps`` optimiser steps (0/None: at the end of each epoch) and after the final step, into
    ``<default_root_dir>/checkpoints``, so that ``--ckpt_path last`` finds it whatever logger version directory a
    run gets; unless a ``ModelCheckpoint`` the user gives keeps a last checkpoint itself (``save_last``). A user's
    ``ModelCheckpoint(monitor="val/reward", save_top_k=k)`` keeps its k best beside it.
    """
    from lightning.fabric.plugins import CheckpointIO

    from lit_gspo.distributed import check_strategy, strategy_from_path

    strategy = config.get("strategy")
    check_strategy(strategy)
    if strategy is not None:
        config["strategy"] = strategy_from_path(strategy)
    plugins = config.get("plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        config["plugins"] = plugins + [AtomicCheckpointIO()]
    if config.get("enable_checkpointing") is False:
        return
    if any(isinstance(c, ModelCheckpoint) and c.save_last for c in callbacks):
        return
    root = Path(config.get("default_root_dir") or os.getcwd())
    callbacks.append(LastCheckpoint(root / "checkpoints", every_n_train_steps=every_n_steps or None))
