"""bf16 on a CPU that emulates it is slower than fp32: fit says so, and only then."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import lit_gspo.hardware as hardware
from lit_gspo.cli import cli_main
from lit_gspo.hardware import SlowPrecisionWarning, bf16_on_cpu_warning

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("native", [True, False])
def test_advice_only_for_bf16_on_a_cpu_without_native_bf16(monkeypatch, native):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    for precision in ("32-true", "32", 32, "16-mixed", None):
        assert bf16_on_cpu_warning(precision, "cpu") is None
    for precision in ("bf16-mixed", "bf16-true"):
        advice = bf16_on_cpu_warning(precision, "cpu")
        assert (advice is None) == native
        if not native:
            assert repr(precision) in advice and "--trainer.precision 32-true" in advice
    assert bf16_on_cpu_warning("bf16-mixed", "cuda") is None  # a GPU's bf16 is native


def test_native_bf16_follows_the_cpu_flags(monkeypatch):
    for amx, avx512_bf16 in [(False, False), (True, False), (False, True)]:
        monkeypatch.setattr(hardware.torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(hardware.torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        assert hardware.cpu_has_native_bf16() == (amx or avx512_bf16)


@pytest.mark.parametrize("native", [True, False])
def test_fit_warns_for_bf16_on_a_cpu_without_native_bf16(monkeypatch, tmp_path, native):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.accelerator", "cpu", "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "1",
            "--trainer.enable_progress_bar", "false", "--model.warm_start.steps", "0", "--model.val_every_n_steps", "0",
            "--data.num_train", "8", "--data.num_val", "4", "--data.prompts_per_step", "2",
            "--model.generation.num_generations", "2", "--model.generation.max_new_tokens", "2"]
    cli = cli_main(args, run=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    slow = [w for w in caught if issubclass(w.category, SlowPrecisionWarning)]
    assert len(slow) == (0 if native else 1)
