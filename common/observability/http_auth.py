"""The bearer token of the HTTP admin endpoints (`security.http_token_file`).

Only `GET /metrics` and `GET /health` (`/healthz`) stay open: Prometheus scrapers and
orchestrator probes rarely carry credentials, and neither path changes or reveals
cached data. Everything else needs `Authorization: Bearer <token>` when a token is set.
"""

from __future__ import annotations

import hmac
import os

from kvmesh.common.config.errors import ConfigError, ConfigIssue, Source
from kvmesh.common.config.schema import SecurityConfig

OPEN_PATHS = frozenset(("/metrics", "/health", "/healthz"))


def read_http_token(security: SecurityConfig) -> str:
    """The token ("" when none is configured); a ConfigError naming the key and path when
    the file is missing, unreadable or empty. Reads a file: call it at start-up."""
    path = security.http_token_file
    if not path:
        return ""

    def problem(text: str) -> ConfigError:
        issue = ConfigIssue("security.http_token_file", Source("config"), f"{path}: {text}")
        return ConfigError([issue])

    if not os.path.isfile(path):
        raise problem("no such token file")
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise problem(f"unreadable ({exc})") from exc
    if not token:
        raise problem("is empty")
    return token


def needs_token(method: str, path: str) -> bool:
    """Whether a request must carry the token (when one is set)."""
    return not (method in ("GET", "HEAD") and path in OPEN_PATHS)


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header value carries the token; always True without one.
    Compared in constant time, so the answer's timing leaks nothing of the token."""
    if not token:
        return True
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
