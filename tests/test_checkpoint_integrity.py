"""Checkpoint integrity (issue 20): a sha256 beside each checkpoint, checked on load; corrupt, empty, truncated,
random or unsafe files reported as such with their path (never with advice to load them unsafely); remote
``ckpt_path`` URLs refused."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lit_gspo.lightning.checkpoint_io import AtomicCheckpointIO
from lit_gspo.runtime.checkpoint_files import CheckpointError, sha256_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.arange(1000.0)}, "global_step": 7}, path)
    return path


def load(path):
    return AtomicCheckpointIO().load_checkpoint(path)


def test_a_sha256_is_written_beside_each_checkpoint_in_sha256sum_format(saved):
    import hashlib

    digest = hashlib.sha256(saved.read_bytes()).hexdigest()
    assert sha256_path(saved).read_text() == f"{digest}  last.ckpt\n"
    assert load(saved)["global_step"] == 7


def test_a_changed_byte_is_caught_by_the_hash(saved):
    """torch loads a checkpoint with a flipped byte inside a tensor without complaint: only the hash notices."""
    data = bytearray(saved.read_bytes())
    position = data.index(torch.arange(1000.0)[500:502].numpy().tobytes())
    data[position] ^= 0x01
    saved.write_bytes(bytes(data))
    torch.load(saved, weights_only=True)  # (torch itself sees nothing wrong)
    with pytest.raises(CheckpointError, match=rf"checkpoint {saved} does not match its hash in {sha256_path(saved)}"):
        load(saved)
    sha256_path(saved).unlink()  # deleted on purpose: loads without the check
    assert load(saved)["global_step"] == 7


@pytest.mark.parametrize("damage", ["empty", "truncated", "random", "text"])
def test_a_damaged_checkpoint_is_reported_as_such_with_its_path(tmp_path, saved, damage):
    data = saved.read_bytes()
    sha256_path(saved).unlink()  # as written by an older version, or by another tool: no hash to compare with
    saved.write_bytes(
        {"empty": b"", "truncated": data[: len(data) // 2], "random": os.urandom(4096), "text": b"hello\n"}[damage]
    )
    with pytest.raises(CheckpointError) as err:
        load(saved)
    message = str(err.value)
    assert str(saved) in message
    assert ("empty" if damage == "empty" else "corrupt") in message
    assert "weights_only" not in message and "will likely succeed" not in message


def test_a_checkpoint_holding_python_objects_is_refused_without_advice_to_load_it_unsafely(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"x": os.system}, path)  # unpickling would import (and could call) os.system
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} holds Python objects that are not loaded") as err:
        load(path)
    assert "weights_only" not in str(err.value)


@pytest.mark.parametrize("url", ["https://example.com/run/last.ckpt", "s3://bucket/last.ckpt"])
def test_a_remote_ckpt_path_is_refused_at_once(url):
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="is a remote URL; checkpoints are loaded from local files only"):
        load(url)
    assert time.perf_counter() - start < 1  # no network attempt


def test_a_crash_between_the_hash_and_the_rename_leaves_a_checkpoint_that_still_verifies(saved, monkeypatch):
    """The sidecar lists the new and the old hash until the new file is in place."""
    import lit_gspo.runtime.checkpoint_files as checkpoint_files

    real_replace = os.replace

    def crash_on_checkpoint(src, dst):
        if Path(dst) == saved:
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint_files.os, "replace", crash_on_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 8}, saved)
    monkeypatch.setattr(checkpoint_files.os, "replace", real_replace)
    assert len(sha256_path(saved).read_text().splitlines()) == 2
    assert load(saved)["global_step"] == 7
    assert [p.name for p in saved.parent.iterdir() if ".tmp-" in p.name] == []


def test_removing_a_checkpoint_removes_its_hash(saved):
    AtomicCheckpointIO().remove_checkpoint(saved)
    assert not saved.exists() and not sha256_path(saved).exists()


def test_fit_from_an_empty_checkpoint_names_it(tmp_path):
    from lit_gspo.tools.main import cli_main

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"")
    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.max_steps",
            "2",
            "--model.policy.warm_start.steps",
            "0",
            "--data.num_train",
            "8",
            "--data.num_val",
            "4",
            "--data.prompts_per_step",
            "4",
            "--trainer.enable_progress_bar",
            "false",
        ],
        run=False,
    )
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt} is empty \(0 bytes\)"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(ckpt))


@pytest.mark.parametrize("error", [IndexError, TypeError, AttributeError, OverflowError])
def test_whatever_the_unpickler_raises_on_a_file_that_is_no_checkpoint_is_reported_as_corrupt(tmp_path, error):
    """Random bytes reach torch's unpickler, which then raises whatever the bytes lead it to (IndexError seen)."""
    from lit_gspo.runtime.checkpoint_files import load_verified

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"\x80\x02garbage")

    def load():
        raise error("from the unpickler")

    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt or truncated.*raised {error.__name__}"):
        load_verified(path, load)
