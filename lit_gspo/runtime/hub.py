"""Is the Hugging Face Hub reachable? Asked once per process, in a few seconds, before loading a hub id (the
opt-in push of a run's export is ``lit_gspo.models.push``).

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
    return (
        f"{what} is not in the local Hugging Face cache. Check the network, or download it where there is one "
        "(the cache is shared through HF_HOME) and set HF_HUB_OFFLINE=1, or give a local path instead "
        f"(LIT_GSPO_HUB_TIMEOUT sets how long the hub is tried: {DEFAULT_TIMEOUT_S:g} s by default)"
    )
