"""The bearer token of the HTTP admin endpoints (`security.http_token_file`).

Only `GET /metrics` and `GET /health` (`/healthz`) stay open: Prometheus scrapers and
orchestrator probes rarely carry credentials, and neither path changes or reveals
cached data. Everything else needs `Authorization: Bearer <token>` when a token is set.

A service checks requests through `BearerAuth`, which counts each refusal (answered
401) in `kvmesh_<service>_http_auth_failures_total{reason}`, beside CURVE's
`kvmesh_<service>_auth_failures_total` for its ZMQ sockets: `missing` (no bearer
token at all) or `wrong` (a token that is not the one configured).
"""

from __future__ import annotations

import hmac
import os

from kvmesh.common.config.errors import ConfigError, ConfigIssue, Source
from kvmesh.common.config.schema import SecurityConfig
from kvmesh.common.observability.metrics import Metrics

OPEN_PATHS = frozenset(("/metrics", "/health", "/healthz"))
REFUSALS = ("missing", "wrong")


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
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 to lone
    # surrogates, which a plain encode() refuses; such a token is just a wrong one.
    return hmac.compare_digest(given.strip().encode(errors="surrogateescape"), token.encode())


def refusal(header: str | None, token: str) -> str | None:
    """Why an Authorization header value is refused (a REFUSALS entry), None when it
    carries the token or no token is set."""
    if authorized(header, token):
        return None
    scheme, _, given = (header or "").partition(" ")
    return "missing" if scheme.lower() != "bearer" or not given.strip() else "wrong"


class BearerAuth:
    """The token check of one service's HTTP endpoints, refusals counted by reason in
    `kvmesh_<service>_http_auth_failures_total` (every reason at 0 from the start, so
    a rate is defined before the first refusal)."""

    def __init__(self, token: str, metrics: Metrics, service: str) -> None:
        self.token = token
        failures = metrics.counter(
            f"{service}_http_auth_failures_total",
            "HTTP requests refused (401) for a missing or wrong bearer token, by why",
            ["reason"],
        )
        self.failures = {reason: failures.labels(reason=reason) for reason in REFUSALS}
        for counter in self.failures.values():
            counter.inc(0)

    def allows(self, header: str | None) -> bool:
        """Whether a request with this Authorization header may go on; a refusal is
        counted (the caller answers it 401)."""
        reason = refusal(header, self.token)
        if reason is None:
            return True
        self.failures[reason].inc()
        return False
