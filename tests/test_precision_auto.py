"""``--trainer.precision auto``: bf16-mixed where bf16 is native (a bf16 GPU, a CPU with AMX-BF16/AVX512-BF16), 32-true
elsewhere, said at start in one line; an explicit choice stays the user's; the SmolLM2 configs default to it."""

from pathlib import Path

import pytest
import yaml

from lit_gspo.lightning import cli
from lit_gspo.lightning.cli import resolve_auto_precision_args
from lit_gspo.runtime import hardware
from lit_gspo.runtime.hardware import resolve_auto_precision

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "device, flags, cuda_bf16, want",
    [
        ("cpu", {"avx512_bf16", "avx2"}, None, "bf16-mixed"),
        ("cpu", {"amx_bf16"}, None, "bf16-mixed"),
        ("cpu", {"avx2", "avx512f"}, None, "32-true"),  # AVX2 / AVX-512 without BF16: bf16 emulated
        ("cpu", set(), None, "32-true"),
        ("cuda", None, True, "bf16-mixed"),
        ("cuda", None, False, "32-true"),  # e.g. a V100/T4: no bf16
        ("mps", None, None, "32-true"),
    ],
)
def test_auto_resolves_per_hardware(device, flags, cuda_bf16, want):
    precision, note = resolve_auto_precision(device, flags=flags, cuda_bf16=cuda_bf16)
    assert precision == want
    assert note.startswith(f"precision auto → {want} (") and "\n" not in note


def test_auto_uses_this_cpus_detected_features(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset())
    assert resolve_auto_precision("cpu")[0] == "32-true"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert resolve_auto_precision("cpu")[0] == "bf16-mixed"


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset())


def test_a_flag_a_config_file_and_yaml_text_are_resolved_in_place(no_bf16_cpu):
    args, note = resolve_auto_precision_args(
        ["fit", "--config", "c.yaml", "--trainer.precision", "auto", "--trainer.accelerator", "cpu"]
    )
    assert args == ["fit", "--config", "c.yaml", "--trainer.precision", "32-true", "--trainer.accelerator", "cpu"]
    assert "32-true" in note
    args, _ = resolve_auto_precision_args(
        ["--config", "trainer: {precision: auto, accelerator: cpu}", "--trainer.precision", "bf16-true"]
    )
    # the config's auto is resolved in its text, so the later explicit choice still wins
    assert [yaml.safe_load(args[1]), args[2:]] == [
        {"trainer": {"precision": "32-true", "accelerator": "cpu"}},
        ["--trainer.precision", "bf16-true"],
    ]
    assert (
        resolve_auto_precision_args(["--trainer.precision=auto", "--trainer.accelerator=cpu"])[0][0]
        == "--trainer.precision=32-true"
    )


def test_an_explicit_precision_is_left_alone():
    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.precision", "bf16-mixed"]
    assert resolve_auto_precision_args(args) == (args, None)


def test_the_accelerator_decides_the_device(monkeypatch, no_bf16_cpu):
    monkeypatch.setattr(hardware.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    args, _ = resolve_auto_precision_args(["--trainer.precision", "auto", "--trainer.accelerator", "gpu"])
    assert args[1] == "bf16-mixed"
    args, _ = resolve_auto_precision_args(["--trainer.precision", "auto", "--trainer.accelerator", "cpu"])
    assert args[1] == "32-true"


def test_the_cli_accepts_precision_auto_and_says_what_it_chose(no_bf16_cpu, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        built = cli.cli_main(
            [
                "--config",
                str(ROOT / "configs/quickstart.yaml"),
                "--trainer.precision",
                "auto",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--model.policy.warm_start.steps",
                "0",
            ],
            run=False,
        )
    assert built.trainer.precision == "32-true"
    assert built.config.trainer.precision == "32-true"  # what the run's config records
    assert any("precision auto → 32-true" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path", sorted((ROOT / "configs/smollm2").glob("*.yaml")), ids=lambda p: p.stem)
def test_smollm2_configs_default_to_auto(path):
    assert yaml.safe_load(path.read_text())["trainer"]["precision"] == "auto"
    sys_args = ["--config", str(path)]
    args, note = resolve_auto_precision_args(sys_args)
    assert yaml.safe_load(args[1])["trainer"]["precision"] == resolve_auto_precision("cpu")[0] and note
