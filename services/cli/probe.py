"""Is a service answering? For container health checks: images carry no curl.

    python -m kvmesh.services.cli.probe URL [TIMEOUT_S]     (or `kvmesh probe URL`)

http(s)://... passes on a 2xx answer; tcp://host:port passes when a connection opens
(the ZMQ services' ROUTER ports, which speak no HTTP). The module imports only the
standard library: a health check runs every few seconds, and the full CLI (click,
torch) takes seconds to import on a loaded machine, longer than a check may take.
"""

from __future__ import annotations

import socket
import sys
import threading
import urllib.error
import urllib.request
from urllib.parse import urlsplit


def probe(url: str, timeout_s: float) -> str | None:
    """None when the service at url answers in time, else why not (one line).

    timeout_s bounds the whole check: urllib's timeout is per socket read, so a server
    dripping its answer would hold it for as long as it drips. The attempt runs on a
    daemon thread, left behind past the deadline: the callers exit right after."""
    result: list[str | None] = []
    attempt = threading.Thread(target=lambda: result.append(_attempt(url, timeout_s)), daemon=True)
    attempt.start()
    attempt.join(timeout_s)
    return result[0] if result else f"{url}: no complete answer in {timeout_s:g}s"


def url_problem(url: str) -> str | None:
    """Why url is not one probe can ask (one line), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port  # parsed lazily: "host:abc" raises only here
    except ValueError as exc:
        return f"{url}: not a URL ({exc})"
    if parts.scheme == "tcp":
        if not parts.hostname or port is None:
            return f"{url}: expected tcp://host:port"
    elif parts.scheme in ("http", "https"):
        if not parts.hostname:
            return f"{url}: no host"
    else:
        return f"{url}: the scheme must be http, https or tcp"
    return None


def _attempt(url: str, timeout_s: float) -> str | None:
    # Checked here too, not only by the caller: a ValueError on the attempt's thread
    # would be a traceback and then a "no answer" after the whole timeout.
    if (why := url_problem(url)) is not None:
        return why
    parts = urlsplit(url)
    try:
        if parts.scheme == "tcp":
            address = (parts.hostname or "", parts.port or 0)  # both there: url_problem
            with socket.create_connection(address, timeout=timeout_s):
                return None
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            resp.read(1 << 16)
            return None
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m kvmesh.services.cli.probe URL [TIMEOUT_S]")
    why = probe(sys.argv[1], float(sys.argv[2]) if len(sys.argv) == 3 else 2.0)
    if why is not None:
        sys.exit(f"unhealthy: {why}")
