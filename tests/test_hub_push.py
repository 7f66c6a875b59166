"""The opt-in push of a run's export to the Hugging Face Hub (issue 19, finding 9): ``--push_to_hub owner/name``.

No network here: ``huggingface_hub.create_repo``/``upload_folder`` are replaced by recorders, and the reachability
probe by a stub.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_gspo.models import push as hub
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def uploads(monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(
        huggingface_hub,
        "upload_folder",
        lambda **kw: calls.append(("upload", kw["repo_id"], kw)) or f"https://hub/{kw['repo_id']}/commit/1",
    )
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout_s=None: None)
    return calls


def fake_run(root: Path, adapter: bool = False) -> Path:
    (root / "hf_model").mkdir(parents=True)
    (root / "hf_model" / "config.json").write_text("{}")
    if adapter:
        (root / "hf_adapter").mkdir()
        (root / "hf_adapter" / "adapter_config.json").write_text("{}")
    return root


def test_push_export_uploads_the_model_and_the_adapter_into_its_folder(tmp_path, uploads):
    urls = hub.push_export(fake_run(tmp_path, adapter=True), "me/model", private=True)
    assert uploads[0] == ("create", "me/model", {"private": True, "exist_ok": True, "token": None})
    model, adapter = uploads[1][2], uploads[2][2]
    assert Path(model["folder_path"]) == tmp_path / "hf_model" and model.get("path_in_repo") is None
    assert Path(adapter["folder_path"]) == tmp_path / "hf_adapter" and adapter["path_in_repo"] == "adapter"
    assert urls == ["https://hub/me/model/commit/1"] * 2


def test_push_offline_fails_at_once_saying_so(tmp_path, uploads, monkeypatch):
    monkeypatch.setattr(hub, "hub_offline", lambda: True)
    with pytest.raises(hub.HubPushError, match="HF_HUB_OFFLINE is set.*hf upload"):
        hub.push_export(fake_run(tmp_path), "me/model")
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout_s=None: "cannot reach https://huggingface.co: timed out")
    with pytest.raises(hub.HubPushError, match="cannot reach https://huggingface.co: timed out. Check the network"):
        hub.push_export(tmp_path, "me/model")
    assert [c for c in uploads if c[0] == "upload"] == []


def test_push_without_an_export_or_an_owner_is_refused(tmp_path, uploads):
    with pytest.raises(hub.HubPushError, match="holds no saved model"):
        hub.push_export(tmp_path, "me/model")
    with pytest.raises(hub.HubPushError, match="with its owner"):
        hub.check_can_push("model")


def fit_args(root: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        "1",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "0",
        "--data.num_train",
        "16",
        "--data.num_val",
        "4",
        "--data.prompts_per_step",
        "2",
        "--model.generation.num_generations",
        "2",
        "--model.generation.max_new_tokens",
        "3",
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]


def test_fit_pushes_its_export_when_asked_and_only_then(tmp_path, uploads):
    cli_main(fit_args(tmp_path / "off"))
    assert uploads == []  # off by default
    cli_main(fit_args(tmp_path / "on", "--push_to_hub", "me/model", "--hub_private", "true"))
    assert [c[0] for c in uploads] == ["create", "upload"] and uploads[0][2]["private"] is True
    assert Path(uploads[1][2]["folder_path"]) == tmp_path / "on" / "hf_model"


def test_fit_with_push_to_hub_offline_fails_before_training(tmp_path, uploads, monkeypatch):
    monkeypatch.setattr(hub, "hub_offline", lambda: True)
    with pytest.raises(hub.HubPushError, match="HF_HUB_OFFLINE"):
        cli_main(fit_args(tmp_path, "--push_to_hub", "me/model"))
    assert not list(tmp_path.glob("**/metrics.csv")) and not (tmp_path / "hf_model").exists()
