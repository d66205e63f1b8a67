"""Whether the remote store answers, and getting it back when it does not.

One task on the engine's loop. While the remote is **up** it pings every `interval_s`;
a failed ping, or `failures_to_down` failed requests in a row, or a lost connection
reported by the connector marks it **down**. While it is down the tier answers every
lookup and get with a miss at once and drops puts (counting them), so no request waits
on a dead remote; the monitor tries to reconnect and ping every `interval_s`, and the
first success marks it up again.

`up` is a plain attribute, read without a lock from any thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kvmesh.common.observability import get_logger

log = get_logger(__name__)

# While the store stays down, its reconnect error is logged again at most this often
# (and whenever it changes).
RETRY_WARN_S = 60.0


def describe(exc: BaseException) -> str:
    """exc's type and message, for a reason a person reads. Not repr: redis-py's
    exceptions print as `auth:AuthenticationError` there, without their message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class HealthMonitor:
    def __init__(
        self,
        *,
        ping: Callable[[], Awaitable[object]],
        reconnect: Callable[[], Awaitable[object]],
        interval_s: float,
        timeout_s: float,
        failures_to_down: int,
        name: str = "remote",
        on_change: Callable[[bool, str], None] | None = None,
    ) -> None:
        self._ping = ping
        self._reconnect = reconnect
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures_to_down = failures_to_down
        self.name = name
        self._on_change = on_change
        self.up = False
        self.reason = "not connected yet"
        self.since = time.monotonic()
        self._failures = 0
        self._wake = asyncio.Event()
        self._warned: tuple[str, float] | None = None  # last reconnect error logged, when

    def success(self) -> None:
        self._failures = 0

    def failure(self, reason: str) -> None:
        """A request failed (timeout, connection error); enough in a row mark it down."""
        self._failures += 1
        if self.up and self._failures >= self.failures_to_down:
            self._set(False, f"{self._failures} failures in a row, last: {reason}")

    def lost(self, reason: str) -> None:
        """The connector knows the connection is gone: down now."""
        if self.up:
            self._set(False, reason)

    def _set(self, up: bool, reason: str) -> None:
        if self._on_change is not None:
            # Before `up` changes: other threads act on it at once, so what the change
            # resets (the tier's memory of the remote's keys) must be reset by then.
            self._on_change(up, reason)
        self.up = up
        self.reason = reason
        self.since = time.monotonic()
        self._failures = 0
        self._warned = None
        if up:
            log.info("remote store is up", remote=self.name)
        else:
            log.warning(
                "remote store is down: requests miss until it answers",
                remote=self.name,
                reason=reason,
            )
            self._wake.set()

    async def _try(self, fn: Callable[[], Awaitable[object]]) -> None:
        async with asyncio.timeout(self.timeout_s):
            await fn()

    async def run(self) -> None:
        """Forever: ping while up, reconnect while down (cancel to stop)."""
        while True:
            if self.up:
                self._wake.clear()
                try:
                    async with asyncio.timeout(self.interval_s):
                        await self._wake.wait()  # woken early when marked down
                except TimeoutError:
                    pass
                if not self.up:
                    continue
                try:
                    await self._try(self._ping)
                    self.success()
                except Exception as exc:
                    # Requests may have marked it down during the ping: once is enough.
                    if self.up:
                        self._set(False, f"ping failed: {describe(exc)}")
            else:
                try:
                    await self._try(self._reconnect)
                    await self._try(self._ping)
                except Exception as exc:
                    self.reason = f"reconnect failed: {describe(exc)}"
                    self._warn_retry(self.reason)
                    await asyncio.sleep(self.interval_s)
                else:
                    self._set(True, "ping answered")

    def _warn_retry(self, reason: str) -> None:
        """Log why the store cannot be reached: a wrong password or db number at start
        would otherwise leave the tier down without a word."""
        now = time.monotonic()
        last = self._warned
        if last is not None and last[0] == reason and now - last[1] < RETRY_WARN_S:
            return
        self._warned = (reason, now)
        log.warning("remote store cannot be reached", remote=self.name, reason=reason)
