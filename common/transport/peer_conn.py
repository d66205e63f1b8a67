"""One DEALER connection to a peer's P2P endpoint, with replies paired to requests.

Owned by one event loop (sockets are not thread-safe). A reply that does not decode,
a timeout or a send failure breaks the connection: pending requests fail with
PeerError and the owner drops it, so the next request reconnects afresh rather than
reading a stale reply (redis-py's rule: an error mid-read disconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

# Peers' connections unused this long are closed: a peer gone for good (a pod replaced
# under a new address) is otherwise redialled ten times a second (ZMQ's reconnect
# interval, kept short so that a peer restarted behind its address is back at once) for
# as long as its socket lives.
DEFAULT_IDLE_S = 300.0


class PeerError(RuntimeError):
    """The peer did not answer in time, answered garbage, or said no: a miss. `code` is
    the peer's ErrorReply code when it said no (None otherwise)."""

    def __init__(
        self,
        message: str,
        code: int | None = None,
        conn: PeerConnection | None = None,
        *,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        # The connection that failed, so that dropping it after the failure does not
        # drop a fresh one another request has opened to the same peer since.
        self.conn = conn
        # The peer did not answer on conn within a request's own deadline (not: the
        # connection was closed under it, a local fault, a refusal).
        self.timed_out = timed_out


class StuckTransfer(PeerError):
    """A transfer the transport would not release: its buffers (ours, and the peer's it
    writes into) may still be written, so they stay referenced (a leak, not wrong KV)."""


_serials = itertools.count(1)


class PeerConnection:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        curve: CurveKeys | None = None,
        max_frame: int = -1,
    ) -> None:
        self.endpoint = endpoint
        self.serial = next(_serials)  # tells connections to one endpoint apart (not id())
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        # A peer's frame larger than any valid one drops the connection instead of
        # being buffered whole in this (vLLM's) process.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        # Without a live peer, sends fail at once instead of queueing for a dead one.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        apply_client(self._sock, curve, endpoint)
        connect(self._sock, endpoint)
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[proto.Reply, list[zmq.Frame]]]] = {}
        self._rx: asyncio.Task[None] | None = None
        self.broken = False
        # What Hello told us (filled by the channel that asked).
        self.hello: proto.HelloReply | None = None
        self.last_used = time.monotonic()
        # When a reply last came (monotonic; 0: never): a request that failed while
        # others were answered met a slow peer, not a dead one.
        self.last_reply = 0.0

    def idle_since(self, before: float) -> bool:
        """Unused since `before` (monotonic), with no request waiting on a reply."""
        return self.last_used < before and not self._pending

    def next_rid(self) -> int:
        return next(self._rids)

    async def request(
        self, msg: proto.Request, timeout_s: float, payloads: Sequence[Any] = ()
    ) -> tuple[proto.Reply, list[zmq.Frame]]:
        """Send msg (its rid from `next_rid`) and any payload frames, and wait for the
        reply with that rid.

        Raises PeerError on timeout, an error reply, or a broken connection.
        """
        if self.broken:
            raise PeerError(f"connection to {self.endpoint} is broken", conn=self)
        if self._rx is None:
            self._rx = asyncio.create_task(self._receive())
        self.last_used = time.monotonic()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            async with asyncio.timeout(timeout_s):
                if payloads:
                    await self._sock.send_multipart([proto.encode(msg), *payloads], copy=False)
                else:
                    await self._sock.send(proto.encode(msg))
                reply, payloads = await fut
        except TimeoutError:
            late = PeerError(
                f"{self.endpoint} did not answer within {timeout_s:.3f}s", conn=self, timed_out=True
            )
            self._break(late)
            raise late from None
        except zmq.ZMQError as exc:
            failed = PeerError(f"send to {self.endpoint} failed: {exc}", conn=self)
            self._break(failed)
            raise failed from None
        except asyncio.CancelledError:
            # zmq cancels a send still blocked (no pipe to a dead peer) when the socket
            # is closed under it: a failure of this connection, not our caller's cancel.
            task = asyncio.current_task()
            if self.broken and task is not None and task.cancelling() == 0:
                raise PeerError(f"connection to {self.endpoint} closed", conn=self) from None
            raise
        finally:
            self._pending.pop(msg.rid, None)
            if fut.done() and not fut.cancelled():
                # Failed by _break (this request's own timeout, or another's while this
                # one still sent): read, or asyncio logs it as never retrieved.
                fut.exception()
        if isinstance(reply, proto.ErrorReply):
            raise PeerError(
                f"{self.endpoint} refused: code {reply.code}: {reply.message}", reply.code
            )
        return reply, payloads

    def send_nowait(self, msg: proto.Request) -> None:
        """Fire and forget (a lease release: the peer expires it anyway)."""
        self.last_used = time.monotonic()
        if not self.broken:
            with contextlib.suppress(zmq.ZMQError):
                fut = self._sock.send(proto.encode(msg), flags=zmq.NOBLOCK)
                # Read the outcome so a failed send is not reported as unretrieved.
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _receive(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                try:
                    reply = proto.decode_reply([f.buffer for f in frames])
                except proto.MalformedMessage as exc:
                    self._break(PeerError(f"bad reply from {self.endpoint}: {exc}", conn=self))
                    return
                self.last_reply = time.monotonic()
                fut = self._pending.get(reply.rid)
                if fut is not None and not fut.done():
                    fut.set_result((reply, list(frames[1:])))
                # else: a reply to a request we gave up on, or to a release.
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def _break(self, exc: PeerError) -> None:
        self.broken = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def close(self) -> None:
        if self._rx is not None:
            self._rx.cancel()
        # Failed, not cancelled: the requests' tasks were not cancelled, and their
        # callers handle a PeerError (a miss) but not a CancelledError.
        self._break(PeerError(f"connection to {self.endpoint} closed", conn=self))
        self._sock.close(0)


class PeerConnections:
    """One live connection per endpoint; broken ones are replaced on next use, idle ones
    closed (checked at most every idle_s / 4, when a connection is asked for)."""

    def __init__(
        self,
        curve: CurveKeys | None = None,
        max_frame: int = -1,
        idle_s: float = DEFAULT_IDLE_S,
        on_idle: Callable[[str], None] | None = None,
    ) -> None:
        """max_frame: the largest frame a peer may send (-1: any). on_idle(endpoint):
        called after an idle connection was closed (the owner forgets that peer)."""
        self.curve = curve
        self.max_frame = max_frame
        self.idle_s = idle_s
        self.on_idle = on_idle
        self._ctx: zmq.asyncio.Context | None = None
        self._conns: dict[str, PeerConnection] = {}
        # Endpoints whose connection a failure dropped, and when: not asked for again
        # (a peer gone for good), they are forgotten as idle ones are, or what the
        # owner holds for them (a loaded NIXL agent) would stay for the process's life.
        self._dropped: dict[str, float] = {}
        self._next_sweep = time.monotonic() + idle_s / 4

    def get(self, endpoint: str) -> PeerConnection:
        self._dropped.pop(endpoint, None)  # asked for again: not gone (before the sweep)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.idle_s / 4
            self._close_idle(now - self.idle_s, endpoint)
        conn = self._conns.get(endpoint)
        if conn is None or conn.broken:
            if conn is not None:
                conn.close()
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            conn = self._conns[endpoint] = PeerConnection(
                self._ctx, endpoint, self.curve, self.max_frame
            )
        return conn

    def _close_idle(self, before: float, keep: str) -> None:
        idle = [ep for ep, c in self._conns.items() if ep != keep and c.idle_since(before)]
        for endpoint in idle:
            self._conns.pop(endpoint).close()
        gone = [ep for ep, t in self._dropped.items() if t < before]
        for endpoint in gone:
            del self._dropped[endpoint]
        if self.on_idle is not None:
            for endpoint in idle + gone:
                self.on_idle(endpoint)

    def drop(self, endpoint: str, failed: PeerConnection | None = None) -> bool:
        """Close endpoint's connection (only if it is `failed`, when given: a newer one
        stays); whether the current one went."""
        conn = self._conns.get(endpoint)
        if failed is not None and conn is not failed:
            failed.close()
            return False
        if conn is not None:
            del self._conns[endpoint]
            conn.close()
            self._dropped[endpoint] = time.monotonic()
        return conn is not None

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._dropped.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
