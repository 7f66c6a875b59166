"""Checkpoint files that survive a crash mid-write and are checked before they are read.

:func:`save_hashed` writes ``torch.save`` output to ``.<name>.tmp-<pid>`` in the same directory, hashing it as it is
written, fsyncs it and ``os.replace``-s it over the target (atomic on POSIX), so the previous file stays loadable
until the new one is complete; beside it ``<name>.sha256`` (``sha256sum`` format). :func:`verify_checkpoint` checks
that hash before loading; :func:`describe_load_error` says what a failed load means. A mismatch, an empty or truncated
file, random bytes or a pickle that holds Python objects are reported as a :class:`CheckpointError` naming the file
(never with torch's advice to load it unsafely). Remote URLs are refused (:func:`refuse_remote`).

Used by Lightning's checkpoint IO (``lit_gspo.lightning.checkpoint_io.AtomicCheckpointIO``) and by the rollout files
of ``lit-gspo compare`` (``lit_gspo.rl.rollout_io``). No Lightning here.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lit_gspo.runtime.files import fsync_dir, write_text_atomically
from lit_gspo.runtime.user_errors import UserError


class CheckpointError(UserError, RuntimeError):
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
            "--ckpt_path /path/to/last.ckpt"
        )


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


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` if the file at ``path`` is empty or differs from the hash recorded beside it."""
    path = Path(path)
    if not path.is_file():
        return  # a missing file is Lightning's FileNotFoundError; a directory is a distributed checkpoint
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {path} is empty (0 bytes): its write did not complete. Resume from another "
            "checkpoint, or start the run again without --ckpt_path"
        )
    expected = _recorded_digests(path)
    if expected:
        actual = _file_sha256(path)
        if actual not in expected:
            raise CheckpointError(
                f"checkpoint {path} does not match its hash in {sha256_path(path)} (sha256 {actual}, recorded "
                f"{' or '.join(sorted(expected))}): the file is corrupt or truncated, or was changed after it was written. "
                f"Resume from another checkpoint; if you changed it on purpose, delete {sha256_path(path).name}"
            )


def describe_load_error(path: Path, err: BaseException) -> str | None:
    """What a failed ``torch.load`` of ``path`` means, or None when the error is not about the file's content."""
    if isinstance(err, EOFError) or (path.is_file() and not zipfile.is_zipfile(path)):
        return (
            f"checkpoint {path} is corrupt or truncated: it is not a complete torch checkpoint (a zip archive; "
            f"reading it raised {type(err).__name__})"
        )
    if isinstance(err, RuntimeError) and ("PytorchStreamReader" in str(err) or "zip archive" in str(err)):
        return f"checkpoint {path} is corrupt or truncated: {str(err).splitlines()[0]}"
    if isinstance(err, pickle.UnpicklingError):
        detail = [
            line.strip()
            for line in str(err).splitlines()
            if ("Unsupported" in line or "GLOBAL" in line or "error:" in line) and "weights_only" not in line
        ]
        reason = detail[-1] if detail else "its pickle could not be read"
        if "GLOBAL" in reason or "global" in reason:
            return (
                f"checkpoint {path} holds Python objects that are not loaded ({reason}): only tensors and plain "
                "data are read from checkpoints, so that loading one cannot run code. lit_gspo writes its settings as "
                "plain data: these objects come from another program, or are init arguments of an RLModule subclass "
                "that plain data cannot describe (an object is described by its init arguments, each kept as an "
                "attribute of the same name)"
            )
        return f"checkpoint {path} is corrupt: its content is not a readable checkpoint ({reason})"
    return None


def save_hashed(obj: Any, path: str | Path, write: Callable[[Any, Any], None] = torch.save) -> None:
    """``write(obj, file)`` into a temporary file beside ``path``, fsync, ``os.replace`` it over ``path``; the sha256
    of what was written in ``<path>.sha256``. At every instant the sidecar holds the hash of whatever file is in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    sidecar = sha256_path(path)
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        digest = writer.sha256.hexdigest()
        # the sidecar lists the new hash and the old one until the swap is done
        previous = sorted(_recorded_digests(path) - {digest}) if path.exists() else []
        write_text_atomically(sidecar, "".join(f"{d}  {path.name}\n" for d in [digest, *previous]))
        os.replace(tmp, path)
        write_text_atomically(sidecar, f"{digest}  {path.name}\n")
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def load_verified(path: str | Path, load: Callable[[], Any]) -> Any:
    """``load()`` of the checkpoint at ``path`` after :func:`refuse_remote` and :func:`verify_checkpoint`; a file that
    does not load is a :class:`CheckpointError` saying why (not torch's advice to load it unsafely)."""
    refuse_remote(path)
    verify_checkpoint(path)
    try:
        return load()
    except Exception as err:  # noqa: BLE001 - random bytes reach the unpickler as IndexError, TypeError, ...
        message = describe_load_error(Path(path), err)
        if message is None:
            raise
        raise CheckpointError(message) from None
