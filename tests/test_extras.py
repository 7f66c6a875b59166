"""Optional packages (issue 19): a feature whose package is missing says which extra installs it.

A missing package is simulated with ``sys.modules[name] = None`` (``import name`` then raises ImportError).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import tomllib

from lit_gspo.runtime import extras

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def missing(monkeypatch):
    def hide(name: str) -> None:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, module)
        monkeypatch.setitem(sys.modules, name, None)

    return hide


def test_every_extra_named_by_the_helper_is_in_pyproject_with_its_package():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for package, extra in extras.EXTRAS.items():
        assert any(req.startswith(package) for req in optional[extra]), (package, extra)
        assert any(req.startswith(package) for req in optional["test"]) or extra in ("bench", "vllm")  # own envs
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(req.startswith(tuple(extras.EXTRAS)) for req in core)


def test_the_gguf_extra_installs_what_transformers_needs_to_load_a_gguf():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = lambda extra: {re.split(r"[<>=!~\[ ]", req)[0] for req in optional[extra]}  # noqa: E731
    assert {"gguf", "accelerate"} <= names("gguf")  # transformers refuses a .gguf without accelerate
    for extra in ("lora", "gguf", "bnb", "plot"):  # `all` is every feature extra (bench pins TRL: not in it)
        assert names(extra) <= names("all"), extra


def test_a_gguf_without_accelerate_names_the_gguf_extra(missing, tmp_path):
    from lit_gspo.models import load_policy

    missing("accelerate")
    with pytest.raises(
        ImportError,
        match=r"loading GGUF checkpoints needs the optional package `accelerate`.*"
        r"pip install 'lit-gspo\[gguf\]'",
    ):
        load_policy(str(tmp_path), gguf_file="model.gguf")


def test_require_names_the_extra(missing):
    missing("peft")
    with pytest.raises(ImportError, match=r"LoRA needs the optional package `peft`.*pip install 'lit-gspo\[lora\]'"):
        extras.require("peft", "LoRA")


def test_lora_without_peft_names_the_lora_extra(missing):
    from lit_gspo.models import load_policy
    from lit_gspo.models.lora import apply_lora

    policy, _ = load_policy("tiny-llama", seed=0)
    missing("peft")
    with pytest.raises(ImportError, match=r"lit-gspo\[lora\]"):
        apply_lora(policy)


def test_gguf_without_the_package_names_the_gguf_extra(missing, tmp_path):
    from lit_gspo.models import load_policy

    missing("gguf")
    with pytest.raises(ImportError, match=r"lit-gspo\[gguf\]"):
        load_policy(str(tmp_path), gguf_file="model.gguf")


def test_an_8bit_optimizer_without_bitsandbytes_names_the_bnb_extra(missing, capsys):
    from lit_gspo.tools.main import cli_main

    missing("bitsandbytes")
    with pytest.raises(SystemExit):
        cli_main(
            [
                "fit",
                "--config",
                str(ROOT / "configs/quickstart.yaml"),
                "--model.optimizer",
                "bitsandbytes.optim.AdamW8bit",
            ],
            run=False,
        )
    assert "pip install 'lit-gspo[bnb]'" in capsys.readouterr().err


def test_an_ablation_report_without_matplotlib_is_written_without_plots_and_says_why(missing, tmp_path):
    from types import SimpleNamespace

    from lit_gspo.tools.ablate_report import write_report

    missing("matplotlib")
    ab = SimpleNamespace(
        report_dir=tmp_path,
        name="x",
        description="",
        base="b.yaml",
        source="a.yaml",
        seeds=[0],
        overrides={},
        arms=[],
        target_metric="val/reward",
        target_reward=0.5,
        collapse_fraction=0.5,
    )
    write_report(ab, [], {}, [])
    assert "lit-gspo[plot]" in (tmp_path / "report.md").read_text()


def test_trl_comparison_without_trl_names_the_bench_extra(missing, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vs_trl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    missing("trl")
    with pytest.raises(ImportError, match=r"lit-gspo\[bench\]"):
        vs_trl.trl_trainer(
            tmp_path, tmp_path, updates=1, precision="32", checkpointing=False, num_prompts=1, callbacks=[]
        )


def test_optional_packages_are_imported_through_the_helper_only():
    """No file of the package, scripts or benchmarks imports an optional package by ``import``, except to probe for it."""
    allowed = {("lit_gspo/models/lora.py", "peft")}  # is_lora: a probe (no peft means no adapters), not a feature
    offenders = []
    for path in [
        *ROOT.joinpath("lit_gspo").rglob("*.py"),
        *ROOT.joinpath("scripts").glob("*.py"),
        *ROOT.joinpath("benchmarks").glob("*.py"),
    ]:
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top in extras.EXTRAS and (rel, top) not in allowed and not rel.startswith("benchmarks/gpu_check"):
                    offenders.append(f"{rel}: import {name}")
    assert offenders == []


def test_the_vllm_engine_without_vllm_names_the_vllm_extra(missing):
    from lit_gspo.rl.engines import VLLMEngine

    missing("vllm")
    with pytest.raises(
        ImportError, match=r"VLLMEngine needs the optional package `vllm`.*pip install 'lit-gspo\[vllm\]'"
    ):
        VLLMEngine()
