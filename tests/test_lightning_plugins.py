"""Every plugin Lightning ships, for RLModule: honoured, or refused at start in one line
(``lit_gspo/lightning/lightning_plugins.py``), enumerated from ``lightning.pytorch.plugins`` so that a new one fails here
until it is classified; an asynchronous checkpoint IO writes atomic, hashed checkpoints a resume reads."""

import re

import lightning as L
import lightning.pytorch.plugins as P
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_module_hooks import build, data
from test_predict import trainer

from lit_gspo.lightning.lightning_plugins import PLUGINS, check_plugins
from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED
from lit_gspo.runtime.checkpoint_files import sha256_path
from lit_gspo.runtime.user_errors import SettingsError


def bare(cls):
    """An instance of ``cls`` (an abstract base: of a subclass) without its ``__init__``: some need a GPU or a package
    to build, and the check reads types."""
    concrete = type(cls.__name__, (cls,), {})
    concrete.__abstractmethods__ = frozenset()
    return concrete.__new__(concrete)


def test_every_plugin_lightning_ships_is_classified():
    assert sorted(PLUGINS) == sorted(P.__all__)
    assert {flag.kind for flag in PLUGINS.values()} == {HONOURED, REFUSED}


@pytest.mark.parametrize("name", sorted(name for name, flag in PLUGINS.items() if flag.kind == REFUSED))
def test_a_refused_plugin_or_its_subclass_is_one_error_saying_what_to_use(name):
    cls = getattr(P, name)
    with pytest.raises(SettingsError, match=rf"^{name}: not supported by lit_gspo: {re.escape(PLUGINS[name].note)}$"):
        check_plugins([P.TorchCheckpointIO(), bare(cls)])
    with pytest.raises(SettingsError, match=rf"^Mine: not supported by lit_gspo: {re.escape(PLUGINS[name].note)}$"):
        check_plugins([bare(type("Mine", (cls,), {}))])


@pytest.mark.parametrize("name", sorted(name for name, flag in PLUGINS.items() if flag.kind == HONOURED))
def test_an_honoured_plugin_passes_the_check(name):
    check_plugins([bare(getattr(P, name))])


def test_a_fit_with_lightning_s_asynchronous_checkpoint_io_writes_hashed_checkpoints_that_resume(tmp_path):
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    L.seed_everything(0)
    trainer(tmp_path, max_steps=2, plugins=[P.AsyncCheckpointIO()], callbacks=[saved]).fit(build(), datamodule=data())
    checkpoints = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert [path.name for path in checkpoints] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert all(sha256_path(path).exists() for path in checkpoints)
    assert torch.load(checkpoints[-1], weights_only=True)["rl_step"] == 2
    resumed = build()
    trainer(tmp_path, max_steps=3).fit(resumed, datamodule=data(), ckpt_path=checkpoints[-1])
    assert resumed.rl_step == 3
