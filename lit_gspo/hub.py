"""Is the Hugging Face Hub reachable? Asked once per process, in a few seconds, before loading a hub id; and the
opt-in push of a run's export (``lit-gspo fit ... --push_to_hub owner/name``: :func:`push_export`).

Without ``HF_HUB_OFFLINE`` and without a network, ``from_pretrained("org/name")`` and ``load_dataset("org/name")``
retry for about a minute (more where packets are dropped) before failing. :func:`hub_unreachable` opens one TCP
connection to the hub endpoint (or the HTTPS proxy) with a short timeout (``LIT_GSPO_HUB_TIMEOUT`` seconds, default
5; name resolution included) and remembers the answer; callers then load from the local cache only
(``local_files_only``) and fail at once, saying so, when the files are not there.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

DEFAULT_TIMEOUT_S = 5.0
_answer: dict[tuple[str, int], str | None] = {}


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub read it (at import time)."""
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover
        return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        return constants.ENDPOINT
    except ImportError:  # pragma: no cover
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _target() -> tuple[str, int, str]:
    """(host, port, description) of the first hop: the HTTPS proxy if one is set, else the hub endpoint."""
    endpoint = hub_endpoint()
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlsplit(proxy if proxy and endpoint.startswith("https") else endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.hostname or "", port, f"{endpoint}" + (f" (through the proxy {proxy})" if proxy else "")


def hub_unreachable(timeout_s: float | None = None) -> str | None:
    """None when a TCP connection to the hub (or proxy) opens within ``timeout_s``; else why not (cached per target)."""
    host, port, description = _target()
    if (host, port) in _answer:
        return _answer[(host, port)]
    timeout_s = float(os.environ.get("LIT_GSPO_HUB_TIMEOUT", DEFAULT_TIMEOUT_S)) if timeout_s is None else timeout_s
    result: list[str | None] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result.append(None)
        except OSError as err:
            result.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=probe, daemon=True)  # name resolution ignores socket timeouts: bound it here
    thread.start()
    thread.join(timeout_s)
    reason = result[0] if result else f"no connection within {timeout_s:g} s"
    _answer[(host, port)] = None if reason is None else f"cannot reach {description}: {reason}"
    return _answer[(host, port)]


def offline_hint(what: str) -> str:
    return (f"{what} is not in the local Hugging Face cache. Check the network, or download it where there is one "
            "(the cache is shared through HF_HOME) and set HF_HUB_OFFLINE=1, or give a local path instead "
            f"(LIT_GSPO_HUB_TIMEOUT sets how long the hub is tried: {DEFAULT_TIMEOUT_S:g} s by default)")


# ---------------------------------------------------------------------- pushing a run's export
class HubPushError(RuntimeError):
    """The export cannot be pushed (offline, the hub unreachable, or nothing to push); it stays on disk."""


def check_can_push(repo_id: str) -> None:
    """Fail before training, not after it, when ``repo_id`` cannot be pushed to: the hub is offline or unreachable."""
    if "/" not in repo_id.strip("/"):
        raise HubPushError(f"push_to_hub={repo_id!r}: give a repo id with its owner, e.g. `--push_to_hub my-name/my-model`")
    if hub_offline():
        raise HubPushError(f"push_to_hub={repo_id!r}, but HF_HUB_OFFLINE is set: unset it, or leave out --push_to_hub "
                           "and upload the export later (`hf upload <repo_id> <run>/hf_model`)")
    reason = hub_unreachable()
    if reason:
        raise HubPushError(f"push_to_hub={repo_id!r}, but {reason}. Check the network, or leave out --push_to_hub and "
                           "upload the export later (`hf upload <repo_id> <run>/hf_model`)")


def push_export(root: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None,
                commit_message: str | None = None) -> list[str]:
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
        urls.append(huggingface_hub.upload_folder(repo_id=repo_id, folder_path=adapter, path_in_repo="adapter",
                                                  commit_message=message + " (LoRA adapter)", token=token))
    return [str(getattr(url, "commit_url", url)) for url in urls]
