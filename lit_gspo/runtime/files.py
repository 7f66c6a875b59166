"""Files and directories written so that a kill never leaves a partial one: written aside, fsynced, swapped in.

``written_aside`` writes a directory (the Hugging Face export) as ``.<name>.tmp-<pid>`` and swaps it in; leftovers of
killed writers (``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>``) are removed at the next start
(``lit_gspo.lightning.callbacks.temporaries``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
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


def fsync_dir(directory: Path) -> None:
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


def fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def remove(path: Path) -> None:
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
    Leftovers of killed writers are removed by ``lit_gspo.lightning.callbacks.temporaries.clean_stale_temporaries`` at the next start.
    """
    path = Path(path)
    tmp, old = path.parent / f".{path.name}.tmp-{os.getpid()}", path.parent / f".{path.name}.old-{os.getpid()}"
    for leftover in (tmp, old):
        remove(leftover)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        remove(tmp)
        raise
    if path.exists() or path.is_symlink():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    remove(old)


def export_is_complete(path: str | Path) -> bool:
    """A Hugging Face model directory with its config and weights (what ``save_pretrained`` writes)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(
        any(path.glob(pattern)) for pattern in ("*.safetensors", "pytorch_model*.bin", "adapter_model.*")
    )
