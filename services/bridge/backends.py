"""The servers behind the bridge: their load, their health, and which one gets the
next request.

A backend's state is `unknown` until its first health check, then `up` or `down`:
periodic checks (GET /health) set it, and so does every call the bridge makes (a
refused connection marks it down at once, any answer marks it up). Picking takes
the backend with the fewest requests in flight; ties go round-robin, so an idle
cluster still spreads its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp

from kvmesh.common.observability import get_logger
from kvmesh.services.bridge.stats import BridgeStats

log = get_logger(__name__)

Role = Literal["prefiller", "decoder"]
State = Literal["unknown", "up", "down"]


class Backend:
    def __init__(
        self,
        role: Role,
        url: str,
        kv_endpoints: list[str] | None = None,
        stats: BridgeStats | None = None,
        instance_id: str = "",
    ) -> None:
        self.role = role
        self.url = url.rstrip("/")
        # Its kvmesh instance id: how the lookup-server names it ("" = unknown).
        self.instance_id = instance_id
        self.kv_endpoints = list(kv_endpoints or [])
        self.inflight = 0
        self.state: State = "unknown"
        self.error = ""
        self.checked_at: float | None = None
        self._inflight_gauge = stats.inflight.labels(role, self.url) if stats else None
        self._up_gauge = stats.up.labels(role, self.url) if stats else None
        self._set_gauges()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count one request in flight on this backend for the duration."""
        self.inflight += 1
        self._set_gauges()
        try:
            yield
        finally:
            self.inflight -= 1
            self._set_gauges()

    def mark(self, up: bool, error: str = "") -> None:
        state: State = "up" if up else "down"
        if state != self.state:
            log_at = log.info if up else log.warning
            log_at("backend " + state, role=self.role, url=self.url, error=error or None)
        self.state = state
        self.error = error
        self.checked_at = time.monotonic()
        self._set_gauges()

    def report(self) -> dict[str, Any]:
        age = None if self.checked_at is None else round(time.monotonic() - self.checked_at, 3)
        out: dict[str, Any] = {
            "url": self.url,
            "state": self.state,
            "instance_id": self.instance_id or None,
            "inflight": self.inflight,
            "checked_s_ago": age,
        }
        if self.error:
            out["error"] = self.error
        if self.role == "decoder":
            out["kv_endpoints"] = self.kv_endpoints
        return out

    def _set_gauges(self) -> None:
        if self._inflight_gauge is not None:
            self._inflight_gauge.set(self.inflight)
        if self._up_gauge is not None:
            self._up_gauge.set(1 if self.state == "up" else 0)


class BackendPool:
    """The prefillers, or the decoders."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self._next = 0

    def pick(self, *, include_down: bool) -> Backend | None:
        """The least loaded backend not known to be down; with include_down, one that
        is down when no other is left (it may have come back since its last check)."""
        n = len(self.backends)
        if n == 0:
            return None
        start, self._next = self._next, (self._next + 1) % n
        rotated = self.backends[start:] + self.backends[:start]
        candidates = [b for b in rotated if b.state != "down"]
        if not candidates and include_down:
            candidates = rotated
        # min keeps the first of equals: with the rotation, ties go round-robin.
        return min(candidates, key=lambda b: b.inflight, default=None)

    def by_preference(self) -> list[Backend]:
        """Up first, then unknown, then down; the least loaded first within each."""
        rank = {"up": 0, "unknown": 1, "down": 2}
        return sorted(self.backends, key=lambda b: (rank[b.state], b.inflight))

    def any_up(self) -> bool:
        return any(b.state == "up" for b in self.backends)


async def probe(session: aiohttp.ClientSession, backend: Backend, timeout_s: float) -> None:
    """GET /health once, within timeout_s, and mark the backend by the answer."""
    try:
        async with session.get(
            backend.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await read_head(resp, 0)
            if resp.status == 200:
                backend.mark(True)
            else:
                backend.mark(False, f"/health answered {resp.status}")
    except TimeoutError:
        backend.mark(False, f"/health: no answer in {timeout_s}s")
    except aiohttp.ClientError as exc:
        backend.mark(False, f"/health: {describe(exc)}")


async def probe_all(
    session: aiohttp.ClientSession, backends: list[Backend], timeout_s: float
) -> None:
    await asyncio.gather(*(probe(session, b, timeout_s) for b in backends))


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A backend's answer longer than the bridge reads of that kind of answer."""


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole answer, or AnswerTooLarge once it is over `limit` bytes: a backend gone
    wrong can send without end, and the caller's deadline alone would let it fill the
    bridge's memory at loopback speed first."""
    answer = bytearray()
    async for chunk in resp.content.iter_any():
        answer += chunk
        if len(answer) > limit:
            raise AnswerTooLarge(f"{resp.url.path}: the answer is over {limit} bytes")
    return bytes(answer)


async def read_head(resp: aiohttp.ClientResponse, keep: int) -> bytes:
    """Read the answer to its end (so that its connection can be reused) but keep only
    its first `keep` bytes: for answers the bridge only logs or throws away."""
    head = bytearray()
    async for chunk in resp.content.iter_any():
        if len(head) < keep:
            head += chunk[: keep - len(head)]
    return bytes(head)


def describe(exc: BaseException) -> str:
    """An exception as one short line for logs, /health and error messages."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
