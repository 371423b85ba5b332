"""Is the Hugging Face hub reachable? Decided once per process.

``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE`` / ``HF_DATASETS_OFFLINE``) set to a true value
means offline; otherwise one quick probe opens a TCP connection to the hub endpoint
(``HF_ENDPOINT``, or the HTTPS proxy when one is set) with a short timeout. The answer is
kept for the rest of the process. Offline, the hub libraries are switched to their offline
mode (cache only, no retries), so a model or data set that is not local fails at once in one
line instead of after a minute of retries; online, nothing changes.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.parse
import urllib.request

__all__ = ["offline_reason", "go_offline", "reset"]

PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}
_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_state: dict[str, str | None] = {}


def offline_reason() -> str | None:
    """Why the hub cannot be reached in this process (``None`` when it can), probed once.

    Offline, :func:`go_offline` has switched the hub libraries to their cache-only mode."""
    if "reason" not in _state:
        reason = _env_reason() or _probe()
        _state["reason"] = reason
        if reason is not None:
            go_offline()
    return _state["reason"]


def reset() -> None:
    """Forget the answer (tests)."""
    _state.clear()


def _env_reason() -> str | None:
    for name in _ENV:
        if os.environ.get(name, "").strip().upper() in _TRUE:
            return f"{name} is set"
    return None


def _target() -> tuple[str, int, str]:
    """(host, port, what) to probe: the HTTPS proxy when one applies, else the endpoint."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = urllib.parse.urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        purl = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if purl.hostname:
            return purl.hostname, purl.port or 80, f"the proxy {purl.hostname}"
    return host, port, host


def _probe() -> str | None:
    """One TCP connection to the hub (or its proxy); a reason when it fails or hangs."""
    host, port, what = _target()
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            result.append(None)
        except OSError as exc:
            result.append(" ".join(str(exc).split()) or type(exc).__name__)

    # a thread: name resolution ignores socket timeouts
    worker = threading.Thread(target=connect, name="prunelab-hub-probe", daemon=True)
    worker.start()
    worker.join(PROBE_TIMEOUT_S + 0.5)
    if not result:
        return f"{what} did not answer within {PROBE_TIMEOUT_S:.0f} s"
    return None if result[0] is None else f"{what} cannot be reached: {result[0]}"


def go_offline() -> None:
    """Switch huggingface_hub, transformers and datasets to their offline mode (cache only),
    whether or not they are imported yet."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    ds = sys.modules.get("datasets.config")
    if ds is not None:
        ds.HF_HUB_OFFLINE = True
        ds.HF_DATASETS_OFFLINE = True
