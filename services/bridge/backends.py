"""The servers behind the bridge: their load, their health, and which one gets the
next request.

A backend's state is `unknown` until its first health check, then `up` or `down`:
periodic checks (GET /health) set it, and so does every call the bridge makes (a
refused connection marks it down at once, any answer marks it up). Picking takes
the backend with the fewest requests in flight; ties go round-robin, so an idle
cluster still spreads its requests.

Passive ejection: a backend whose /health answers 200 may still fail every real
request (it drops the connection, answers 502/503, cuts its answers short). Failing fast,
it would have the fewest requests in flight and get more than its share: a black
hole. So EJECT_AFTER_FAILURES failures of real requests in a row take it out of
rotation for a cooldown, whatever its /health says: EJECT_BASE_S, doubled at each
ejection that follows without a success in between, up to EJECT_MAX_S. Then it is
back on probation: its next result decides, a success forgets its past, a failure
ejects it again at once (for twice as long); until that result is in, it gets one
request at a time (a trial, not a burst). The last backend of a role left in
rotation is never ejected: a request is better tried there than not at all.

What counts (`judge_status`, `local_failure`): a failure is a connection refused or
reset, an answer cut short, or a 502/503/504; a 2xx or 4xx is a success (the backend
works; the request was wrong). Neither counts: a 500 or other 5xx (vLLM answers 500 to
some bad requests: one client retrying a poison prompt must not eject healthy
backends), a deadline (a busy backend is slow, not broken, and its requests in flight
already keep new ones away), a client gone away, and a connection the bridge could not
open for want of its own resources (file descriptors, ports, buffers). Results of
requests sent before the backend's latest ejection are ignored, as is any result while
it is ejected: they describe the past, not the backend on probation.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp

from kvmesh.common.observability import get_logger
from kvmesh.services.bridge.stats import BridgeStats

log = get_logger(__name__)

Role = Literal["prefiller", "decoder"]
State = Literal["unknown", "up", "down"]

# Passive ejection (see above). Three in a row: one failure can be chance (a connection
# reset, a proxy's 502), three with no success between is the backend. Five seconds: a
# few health intervals, short enough for a backend that restarted to be back soon; two
# minutes at most, so a repaired one is not shunned long.
EJECT_AFTER_FAILURES = 3
EJECT_BASE_S = 5.0
EJECT_MAX_S = 120.0
# The doubling stops here: 5 s * 2**16 is far past EJECT_MAX_S already, and an
# unbounded exponent overflows float after 1024 ejections in a row.
_EJECT_MAX_DOUBLINGS = 16
# Answers that say the backend (or what fronts it) is broken or overloaded; any other
# 5xx may be the request's own fault.
FAILURE_STATUSES = frozenset({502, 503, 504})
# A connect that failed for want of the bridge's own resources: nothing about the
# backend (aiohttp wraps every OSError of a connect in ClientConnectorError).
LOCAL_CONNECT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS})


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
        # Passive ejection: failures of real requests in a row, ejections in a row
        # (the next cooldown doubles with each), when the current one ends (None: in
        # rotation), why it began, and whether the backend is on probation after one.
        self.failures = 0
        self.last_failure = ""
        self.ejections = 0
        self.ejected_until: float | None = None
        self.eject_reason = ""
        self.probation = False
        # Ejections ever (never reset): a request stamped with an older one was sent
        # before the latest ejection, and its result is ignored.
        self.generation = 0
        self._inflight_gauge = stats.inflight.labels(role, self.url) if stats else None
        self._up_gauge = stats.up.labels(role, self.url) if stats else None
        self._ejected_gauge = stats.ejected.labels(role, self.url) if stats else None
        self._ejections = stats.ejections.labels(role, self.url) if stats else None
        if self._ejections is not None:
            self._ejections.inc(0)
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

    def ejected(self, now: float | None = None) -> bool:
        """Out of rotation: ejected, its cooldown not over. A cooldown found over puts
        the backend back, on probation."""
        if self.ejected_until is None:
            return False
        if (time.monotonic() if now is None else now) < self.ejected_until:
            return True
        self.ejected_until = None
        self.probation = True
        log.info("backend back in rotation, on probation", role=self.role, url=self.url)
        self._set_gauges()
        return False

    def succeeded(self) -> None:
        """A real request went through: the failures in a row (and ejections) end."""
        if self.probation:
            log.info("backend passed its probation", role=self.role, url=self.url)
        self.failures = 0
        self.ejections = 0
        self.probation = False

    def failed(self, reason: str) -> bool:
        """A real request failed on this backend; True when that makes it one to eject
        (EJECT_AFTER_FAILURES in a row, or any failure on probation)."""
        self.failures += 1
        self.last_failure = reason
        return self.probation or self.failures >= EJECT_AFTER_FAILURES

    def eject(self, reason: str, now: float | None = None) -> float:
        """Out of rotation for the next cooldown; returns its length in seconds."""
        cooldown = min(EJECT_BASE_S * 2 ** min(self.ejections, _EJECT_MAX_DOUBLINGS), EJECT_MAX_S)
        self.ejections += 1
        self.generation += 1
        self.ejected_until = (time.monotonic() if now is None else now) + cooldown
        self.eject_reason = f"{self.failures} failed request(s) in a row, the last: {reason}"
        self.failures = 0
        self.probation = False
        if self._ejections is not None:
            self._ejections.inc()
        log.warning(
            "backend ejected", role=self.role, url=self.url, cooldown_s=cooldown,
            reason=self.eject_reason,
        )  # fmt: skip
        self._set_gauges()
        return cooldown

    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        age = None if self.checked_at is None else round(now - self.checked_at, 3)
        out: dict[str, Any] = {
            "url": self.url,
            "state": self.state,
            "instance_id": self.instance_id or None,
            "inflight": self.inflight,
            "checked_s_ago": age,
        }
        if self.error:
            out["error"] = self.error
        if self.ejected(now):
            assert self.ejected_until is not None
            out["ejected"] = {
                "s_left": round(self.ejected_until - now, 3),
                "reason": self.eject_reason,
                "times_in_a_row": self.ejections,
            }
        elif self.probation:
            out["probation"] = True
        if self.failures:
            out["failures_in_a_row"] = self.failures
            out["last_failure"] = self.last_failure
        if self.role == "decoder":
            out["kv_endpoints"] = self.kv_endpoints
        return out

    def trial_busy(self) -> bool:
        """On probation with its one trial request in flight: until that result is in,
        no other request goes there while another backend can take it."""
        return self.probation and self.inflight >= 1

    def _set_gauges(self) -> None:
        if self._inflight_gauge is not None:
            self._inflight_gauge.set(self.inflight)
        if self._up_gauge is not None:
            self._up_gauge.set(1 if self.state == "up" else 0)
        if self._ejected_gauge is not None:
            self._ejected_gauge.set(0 if self.ejected_until is None else 1)


class BackendPool:
    """The prefillers, or the decoders."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self._next = 0

    def pick(self, *, include_down: bool) -> Backend | None:
        """The least loaded backend in rotation (neither known to be down nor ejected);
        with none, an ejected one that is not down (never a role left without one);
        with include_down, one that is down when no other is left (it may have come
        back since its last check)."""
        n = len(self.backends)
        if n == 0:
            return None
        start, self._next = self._next, (self._next + 1) % n
        rotated = self.backends[start:] + self.backends[:start]
        now = time.monotonic()
        candidates = [b for b in rotated if b.state != "down" and not b.ejected(now)]
        if len(candidates) > 1:
            candidates = [b for b in candidates if not b.trial_busy()] or candidates
        if not candidates:
            candidates = [b for b in rotated if b.state != "down"]
        if not candidates and include_down:
            candidates = rotated
        # min keeps the first of equals: with the rotation, ties go round-robin.
        return min(candidates, key=lambda b: b.inflight, default=None)

    def by_preference(self) -> list[Backend]:
        """Up first, then unknown, then ejected, then down; the least loaded first
        within each."""
        now = time.monotonic()
        rank = {"up": 0, "unknown": 1, "down": 3}

        def key(b: Backend) -> tuple[int, int]:
            r = rank[b.state]
            return (2 if r < 3 and b.ejected(now) else r, b.inflight)

        return sorted(self.backends, key=key)

    def any_up(self) -> bool:
        return any(b.state == "up" for b in self.backends)

    def refresh(self) -> None:
        """Put back the backends whose cooldown is over (and their gauges), requests or
        not: an idle bridge must not show one ejected for good."""
        now = time.monotonic()
        for b in self.backends:
            b.ejected(now)

    def record(self, backend: Backend, error: str = "", *, generation: int | None = None) -> None:
        """The result of a real request on `backend` ("" = it went through): passive
        ejection's input. `generation`: the backend's when the request was sent (None:
        now); a result from before its latest ejection, or one arriving while it is
        ejected, is ignored. Its failures eject it unless it is the last of the pool in
        rotation."""
        if generation is not None and generation != backend.generation:
            return
        if backend.ejected():
            return
        if not error:
            backend.succeeded()
            return
        if not backend.failed(error):
            return
        now = time.monotonic()
        others = [
            b for b in self.backends
            if b is not backend and b.state != "down" and not b.ejected(now)
        ]  # fmt: skip
        if others:
            backend.eject(error, now)
        elif backend.failures == (1 if backend.probation else EJECT_AFTER_FAILURES):
            log.warning(
                "backend fails, not ejected: the last of its role in rotation",
                role=backend.role, url=backend.url, error=error,
            )  # fmt: skip


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
        if local_failure(exc):
            # The bridge is out of descriptors or ports: it learnt nothing of the backend.
            log.warning("health check not sent", url=backend.url, error=describe(exc))
            return
        backend.mark(False, f"/health: {describe(exc)}")


async def probe_all(
    session: aiohttp.ClientSession, backends: list[Backend], timeout_s: float
) -> None:
    await asyncio.gather(*(probe(session, b, timeout_s) for b in backends))


class PoolWait:
    """Whether one outgoing call is waiting for a free connection of the session's
    pool right now (pass `ctx` as its trace_request_ctx; the session needs
    pool_trace()). A deadline that fires while it waits is the bridge's own
    saturation, not the backend's silence."""

    def __init__(self) -> None:
        self.ctx: dict[str, bool] = {"queued": False}

    @property
    def queued(self) -> bool:
        return self.ctx["queued"]


def pool_trace() -> aiohttp.TraceConfig:
    """Tracing that keeps PoolWait up to date (aiohttp sends no queued-end when the
    wait ends in a timeout: the flag stays set)."""

    async def queued(_: aiohttp.ClientSession, ctx: Any, __: object) -> None:
        if isinstance(ctx.trace_request_ctx, dict) and "queued" in ctx.trace_request_ctx:
            ctx.trace_request_ctx["queued"] = True

    async def dequeued(_: aiohttp.ClientSession, ctx: Any, __: object) -> None:
        if isinstance(ctx.trace_request_ctx, dict) and "queued" in ctx.trace_request_ctx:
            ctx.trace_request_ctx["queued"] = False

    trace = aiohttp.TraceConfig()
    trace.on_connection_queued_start.append(queued)
    trace.on_connection_queued_end.append(dequeued)
    return trace


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


def judge_status(status: int) -> str | None:
    """Passive ejection's reading of an answer's status: "" a success, a reason a
    failure, None neither (see the module's docstring)."""
    if status in FAILURE_STATUSES:
        return f"answered {status}"
    if status >= 500:
        return None
    return ""


def local_failure(exc: BaseException) -> bool:
    """A connect that failed on the bridge's side (out of file descriptors, ports or
    buffers): the bridge is saturated, the backend is not to blame."""
    if not isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return getattr(exc.os_error, "errno", None) in LOCAL_CONNECT_ERRNOS


def describe(exc: BaseException) -> str:
    """An exception as one short line for logs, /health and error messages."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
