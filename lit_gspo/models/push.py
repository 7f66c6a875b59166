"""The opt-in push of a run's export to the Hugging Face Hub (``lit-gspo fit ... --push_to_hub owner/name``):
checked before training (:func:`check_can_push`), uploaded after it (:func:`push_export`)."""

from __future__ import annotations

import os

from lit_gspo.runtime.hub import hub_offline, hub_unreachable
from lit_gspo.runtime.user_errors import UserError


class HubPushError(UserError, RuntimeError):
    """The export cannot be pushed (offline, the hub unreachable, or nothing to push); it stays on disk."""


def check_can_push(repo_id: str) -> None:
    """Fail before training, not after it, when ``repo_id`` cannot be pushed to: the hub is offline or unreachable."""
    if "/" not in repo_id.strip("/"):
        raise HubPushError(
            f"push_to_hub={repo_id!r}: give a repo id with its owner, e.g. `--push_to_hub my-name/my-model`"
        )
    if hub_offline():
        raise HubPushError(
            f"push_to_hub={repo_id!r}, but HF_HUB_OFFLINE is set: unset it, or leave out --push_to_hub "
            "and upload the export later (`hf upload <repo_id> <run>/hf_model`)"
        )
    reason = hub_unreachable()
    if reason:
        raise HubPushError(
            f"push_to_hub={repo_id!r}, but {reason}. Check the network, or leave out --push_to_hub and "
            "upload the export later (`hf upload <repo_id> <run>/hf_model`)"
        )


def push_export(
    root: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> list[str]:
    """Upload ``<root>/hf_model`` to the hub model repo ``repo_id`` (created if needed, ``private`` then), and
    ``<root>/hf_adapter`` (a LoRA run's adapter alone) into its ``adapter/`` folder. Returns the commit URLs.

    Load them back with ``AutoModelForCausalLM.from_pretrained(repo_id)`` and
    ``PeftModel.from_pretrained(base, repo_id, subfolder="adapter")``.
    """
    from pathlib import Path

    import huggingface_hub

    root = Path(root)
    export = root / "hf_model"
    if not (export / "config.json").is_file():
        raise HubPushError(f"nothing to push to {repo_id}: {export} holds no saved model")
    check_can_push(repo_id)
    huggingface_hub.create_repo(repo_id, private=private, exist_ok=True, token=token)
    message = commit_message or f"lit_gspo: {root.name}"
    urls = [huggingface_hub.upload_folder(repo_id=repo_id, folder_path=export, commit_message=message, token=token)]
    adapter = root / "hf_adapter"
    if (adapter / "adapter_config.json").is_file():
        urls.append(
            huggingface_hub.upload_folder(
                repo_id=repo_id,
                folder_path=adapter,
                path_in_repo="adapter",
                commit_message=message + " (LoRA adapter)",
                token=token,
            )
        )
    return [str(getattr(url, "commit_url", url)) for url in urls]
