"""The lookup-server's side of the per-engine lookup protocol (common/protocol/lookup.py).

One DEALER per worker endpoint, kept open and reused; one reader task per socket
resolves the waiting request by its rid (a late reply to a request that gave up is
dropped). Every ask has a deadline, and the workers are told it too, so a worker that
gets the request late pins nothing. Sockets use ZMQ_IMMEDIATE: a request is never
queued for an engine that is not connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import lookup as wire
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

log = get_logger(__name__)

# Below a ZMQ context's MAX_SOCKETS (set to this and a margin): past it a new socket
# would fail. The least recently asked endpoint is closed to make room.
MAX_ENDPOINTS = 1000
# A closed socket keeps its place in the context until ZMQ's reaper thread frees it,
# so a burst of endpoints new to the pool briefly holds more than MAX_ENDPOINTS.
SOCKET_MARGIN = 256
IDLE_CLOSE_S = 600.0  # an endpoint not asked this long is closed (its worker is likely gone)
SND_HWM = 16  # requests queued per worker here; a full queue waits within the deadline
RELEASE_TIMEOUT_S = 1.0  # a release waits this long for room in a busy worker's queue


class _Conn:
    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, curve: CurveKeys | None = None
    ) -> None:
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.linger = 0
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, SND_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            apply_client(sock, curve, endpoint)
            connect(sock, endpoint)
        except BaseException:  # a bad endpoint: not a socket left open for good
            sock.close(0)
            raise
        self.sock = sock
        self.used = time.monotonic()
        self.closed = False
        self.pending: dict[int, asyncio.Future[wire.Reply | None]] = {}
        self.reader = asyncio.create_task(self._read(), name=f"lookup-worker {endpoint}")

    async def _read(self) -> None:
        while True:
            raw = await self.sock.recv()
            try:
                reply = wire.decode_reply(raw)
            except wire.MalformedMessage:
                continue
            fut = self.pending.get(reply.rid)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def shut(self) -> None:
        """Close the socket now (its reader ends at its next turn): the room it took in
        the context is free at once. A request waiting on it is a miss now (no reply
        can come), not one left to its deadline."""
        self.closed = True
        self.reader.cancel()
        self.sock.close(0)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(None)

    def closed_under(self) -> bool:
        """Whether a CancelledError out of this socket's send came from its close (pyzmq
        cancels the sends waiting on a socket it closes), not from the caller's own task
        being cancelled: only the latter may end the caller."""
        task = asyncio.current_task()
        return self.closed and task is not None and not task.cancelling()

    async def close(self) -> None:
        self.shut()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


class WorkerPool:
    """Asks workers at their lookup endpoints; owns one DEALER per endpoint."""

    def __init__(self, curve: CurveKeys | None = None) -> None:
        self.curve = curve
        self._ctx = zmq.asyncio.Context()
        self._ctx.set(zmq.MAX_SOCKETS, MAX_ENDPOINTS + SOCKET_MARGIN)
        self._conns: dict[str, _Conn] = {}
        self._rids = itertools.count(1)
        self._closing: set[asyncio.Task] = set()

    def _conn(self, endpoint: str) -> _Conn:
        now = time.monotonic()
        conn = self._conns.pop(endpoint, None)
        if conn is None:
            self._forget(now)
            conn = _Conn(self._ctx, endpoint, self.curve)
        conn.used = now
        self._conns[endpoint] = conn  # the most recently asked last
        return conn

    def _forget(self, now: float) -> None:
        """Workers come and go: close the least recently asked endpoints while there
        is no room for one more, and those not asked for IDLE_CLOSE_S."""
        while self._conns:
            endpoint, oldest = next(iter(self._conns.items()))
            if len(self._conns) < MAX_ENDPOINTS and now - oldest.used < IDLE_CLOSE_S:
                return
            del self._conns[endpoint]
            oldest.shut()
            self._closing.add(oldest.reader)
            oldest.reader.add_done_callback(self._closing.discard)

    def discard(self, endpoint: str) -> None:
        """Close endpoint's socket unless a request waits on it: a worker that does not
        answer is not reconnected to every second until the pool would close it idle."""
        conn = self._conns.get(endpoint)
        if conn is None or conn.pending:
            return
        del self._conns[endpoint]
        conn.shut()
        self._closing.add(conn.reader)
        conn.reader.add_done_callback(self._closing.discard)

    async def ask(
        self,
        endpoints: list[str],
        make: Callable[[int, float, int], wire.Request],
        timeout_s: float,
    ) -> list[wire.Reply | None]:
        """Send make(rid, deadline, i) to every endpoints[i]; each reply, or None
        without one before the deadline (or for an empty endpoint)."""
        deadline = time.time() + timeout_s
        return await asyncio.gather(
            *(
                self._ask_one(e, lambda rid, dl, i=i: make(rid, dl, i), deadline, timeout_s)
                for i, e in enumerate(endpoints)
            )
        )

    async def _ask_one(
        self,
        endpoint: str,
        make: Callable[[int, float], wire.Request],
        deadline: float,
        timeout_s: float,
    ) -> wire.Reply | None:
        if not endpoint:
            return None
        try:
            conn = self._conn(endpoint)
        except zmq.ZMQError as exc:  # no socket to be had (a bad endpoint): a miss
            log.warning("worker lookup not sent", endpoint=endpoint, error=str(exc))
            return None
        rid = next(self._rids)
        fut: asyncio.Future[wire.Reply | None] = asyncio.get_running_loop().create_future()
        conn.pending[rid] = fut
        try:
            async with asyncio.timeout(timeout_s):
                # Not connected yet (IMMEDIATE): the send waits for the connection,
                # within the same deadline.
                await conn.sock.send(wire.encode(make(rid, deadline)))
                return await fut
        except TimeoutError:
            return None
        except zmq.ZMQError as exc:
            log.debug("worker lookup not sent", endpoint=endpoint, error=str(exc))
            return None
        except asyncio.CancelledError:
            if conn.closed_under():  # the pool made room for another endpoint: a miss
                log.debug("worker lookup not sent: socket closed for another", endpoint=endpoint)
                return None
            raise
        finally:
            conn.pending.pop(rid, None)

    async def send_all(
        self, endpoints: list[str], make: Callable[[int], wire.ReleaseLookup]
    ) -> int:
        """Releases, to every endpoint at once, each waiting up to RELEASE_TIMEOUT_S for
        room in its worker's queue (a busy worker's queue holds only SND_HWM lookups);
        how many were queued. One not queued (the worker is down or far behind)
        leaves its pins to the worker's pin timeout."""

        async def send(endpoint: str) -> bool:
            payload = wire.encode(make(next(self._rids)))
            conn: _Conn | None = None
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    conn = self._conn(endpoint)
                    await conn.sock.send(payload)
            except (zmq.ZMQError, TimeoutError) as exc:
                log.debug("worker release not sent", endpoint=endpoint, error=repr(exc))
                return False
            except asyncio.CancelledError:
                if conn is not None and conn.closed_under():  # as in _ask_one
                    return False
                raise
            return True

        sent = await asyncio.gather(*(send(e) for e in endpoints if e))
        return sum(sent)

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            await conn.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
        self._ctx.term()
