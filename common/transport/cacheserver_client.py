"""An asyncio client of the cache-server (protocol: kvmesh.common.protocol.cacheserver).

One DEALER socket, owned by the event loop that called `connect()`. Requests are
correlated with replies by request id, so any number can be in flight; each has a
deadline. Two reader callbacks on the loop's selector run beside the callers: one
drains replies and resolves their futures, one watches the socket's monitor so that a
lost connection fails every request in flight at once (`CacheServerUnavailable`)
instead of letting each wait for its deadline. ZMQ reconnects by itself; the next
request says hello again first.

Values are sent without a copy. A value of 64 KiB or more is tracked, and `put`
returns only once ZMQ no longer reads its buffer, so the caller may reuse the memory
as soon as `put` returns or raises.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol.cacheserver_data import DataFrameError
from kvmesh.common.transport.cacheserver_data_client import (
    DataConnectError,
    DataConnections,
    Place,
    endpoint_host,
)
from kvmesh.common.transport.cacheserver_errors import (
    BadRequestError,
    CacheServerError,
    CacheServerUnavailable,
    ProtocolVersionError,
    ServerBusyError,
    ValueTooLargeError,
    error_from,
)
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

log = get_logger(__name__)

__all__ = [
    "BadRequestError",
    "CacheServerClient",
    "CacheServerError",
    "CacheServerUnavailable",
    "ProtocolVersionError",
    "ServerBusyError",
    "Value",
    "ValueTooLargeError",
]

TRACK_FROM = 64 * 1024  # below this pyzmq copies the frame anyway
# A send that found no peer while the monitor still says connected waits this long
# before it tries again (the pipe is being attached or torn down).
AGAIN_PAUSE_S = 0.002
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


@dataclass(slots=True)
class Value:
    """A fetched value: `data` is a view of the received frame, or with
    `value_part_bytes` and a value longer than that, a list of views of its parts in
    order (the frames are kept alive here)."""

    data: memoryview | list[memoryview]
    meta: bytes
    checksum: int
    _frame: Any = None

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, list):
            return sum(part.nbytes for part in self.data)
        return self.data.nbytes

    def tobytes(self) -> bytes:
        if isinstance(self.data, list):
            return b"".join(self.data)
        return self.data.tobytes()


def _value(frames: Sequence[Any], meta: bytes, checksum: int) -> Value:
    if len(frames) == 1:
        return Value(frames[0].buffer, meta, checksum, frames[0])
    return Value([f.buffer for f in frames], meta, checksum, list(frames))


class CacheServerClient:
    """See module doc. Create, `await connect()`, use, `await close()`."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 5.0,
        name: str = "",
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        value_part_bytes: int = 0,
        data_connections: int = 0,
    ) -> None:
        """value_part_bytes: ask for values longer than this in parts (see the
        protocol); gets then return such a value's `data` as a list of views.
        data_connections: at most this many data connections for `get_into` when the
        server offers them (0: never)."""
        self.endpoint = endpoint
        self.value_part_bytes = value_part_bytes
        self.data_connections = data_connections
        self._data: DataConnections | None = None
        self.curve = curve
        self.timeout_s = timeout_s
        self.name = name or f"kvmesh-{os.getpid()}"
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._rids = itertools.count(1)
        self._hello_lock = asyncio.Lock()
        self._session = False  # hello answered on the current connection
        self._up = asyncio.Event()  # a connection is established
        self.max_value_size = 0
        self.max_batch = proto.MAX_BATCH
        self.server_name = ""
        self.late_replies = 0
        # Connections lost: the server on the next one may be another (a restart that
        # lost every value), so what a caller remembers of its keys is stale after one.
        self.disconnects = 0

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    # -- lifecycle ----------------------------------------------------------------------
    async def connect(self, timeout_s: float | None = None) -> None:
        """Open the socket and say hello (CacheServerUnavailable if nobody answers)."""
        self._open()
        await self.hello(timeout_s)

    def _open(self) -> None:
        """The DEALER and its monitor, read by callbacks on this loop's selector (plain
        sockets, not zmq.asyncio: one callback drains every reply, with no task or
        future per receive, which halves the latency of a small request)."""
        loop = asyncio.get_running_loop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer not yet connected
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        apply_client(sock, self.curve, self.endpoint)
        connect(sock, self.endpoint)
        self._sock, self._monitor, self._loop = sock, monitor, loop
        loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        loop.add_reader(monitor.getsockopt(zmq.FD), self._drain_monitor)
        loop.call_soon(self._drain_monitor)

    async def close(self) -> None:
        """Fail what is in flight, stop reading, close the sockets (in that order)."""
        self._fail_pending(CacheServerUnavailable("client closed"))
        sock, monitor, loop = self._sock, self._monitor, self._loop
        self._sock = self._monitor = None
        if loop is not None and not loop.is_closed():
            for s in (sock, monitor):
                if s is not None:
                    loop.remove_reader(s.getsockopt(zmq.FD))
        if sock is not None:
            sock.disable_monitor()
            sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)
        self._up.clear()
        self._session = False
        self._set_data(None)

    async def reconnect(self) -> None:
        """A fresh socket (what was in flight fails), then hello."""
        await self.close()
        await self.connect()

    @property
    def closed(self) -> bool:
        return self._sock is None

    # -- the plumbing -------------------------------------------------------------------
    def _drain(self) -> None:
        """Receive every reply waiting (ZMQ's FD is edge-triggered: drain it fully)."""
        sock = self._sock
        if sock is None:
            return
        pending = self._pending
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                reply = proto.decode_reply(frames[0].buffer)
            except proto.MalformedMessage:  # not a reply of ours: ignore it
                continue
            fut = pending.pop(reply.rid, None)
            if fut is None:
                self.late_replies += 1
            elif not fut.done():
                fut.set_result((reply, frames[1:]))

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up.set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                self._up.clear()
                self._session = False
                self._fail_pending(CacheServerUnavailable("connection to cache-server lost"))

    def _fail_pending(self, exc: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def _send_now(self, parts: list[Any], track: bool) -> Any:
        sock = self._sock
        if sock is None:
            raise CacheServerUnavailable("client is closed")
        try:
            return sock.send_multipart(parts, zmq.NOBLOCK, copy=False, track=track)
        finally:
            self._drain()  # a send can swallow the FD's edge for replies already waiting

    async def _wait_for_connection(self) -> None:
        """After a send found no connected peer. The monitor's events are read by a
        callback on this loop, so `_up` can still say connected after the peer went:
        waiting on a set event returns without yielding, and the retry would spin
        this loop without end, starving every deadline on it (seconds, until the
        server came back). Read the monitor first; if it still says connected, the
        pipe is between states: give it a moment."""
        self._drain_monitor()
        if self._up.is_set():
            await asyncio.sleep(AGAIN_PAUSE_S)
        else:
            await self._up.wait()

    async def _send(self, header: proto.Request, frames: Sequence[Any], timeout_s: float) -> Any:
        """Send one request and wait for its reply or an error; returns (reply, frames)."""
        rid = header.rid  # type: ignore[attr-defined]
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        parts = [proto.encode(header), *frames]
        track = any(_nbytes(f) >= TRACK_FROM for f in frames)
        tracker = None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    self._pending[rid] = fut
                    try:
                        tracker = self._send_now(parts, track)
                        break
                    except zmq.Again:  # no connection yet (IMMEDIATE): wait for one
                        self._pending.pop(rid, None)
                        await self._wait_for_connection()
                        if self._sock is None:
                            raise CacheServerUnavailable("client is closed") from None
                reply, rest = await fut
        except TimeoutError:
            raise CacheServerUnavailable(
                f"no reply from {self.endpoint} within {timeout_s:.3g}s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            if isinstance(tracker, zmq.MessageTracker):
                await _released(tracker, self)
        if isinstance(reply, proto.ErrorReply):
            raise error_from(reply)
        return reply, rest

    async def _call(
        self, make: Any, frames: Sequence[Any] = (), timeout_s: float | None = None
    ) -> Any:
        """Send the request make(rid) after a hello if needed; a NO_HELLO answer (the
        server restarted or the connection was replaced) is met by one hello and
        one retry."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for attempt in range(2):
            if not self._session:
                await self._ensure_session(max(deadline - loop.time(), 0.001))
            try:
                return await self._send(
                    make(next(self._rids)), frames, max(deadline - loop.time(), 0.001)
                )
            except CacheServerError as exc:
                if exc.code != proto.ErrorCode.NO_HELLO or attempt:
                    raise
                self._session = False
        raise AssertionError("unreachable")

    # -- requests -----------------------------------------------------------------------
    async def _ensure_session(self, timeout_s: float) -> None:
        """A hello unless one made while this call waited for the lock already opened
        the session: after a restart, the gets in flight each find no session, and
        one hello does for all (each hello also replaces the data connections)."""
        async with self._hello_lock:
            if not self._session:
                await self._hello_locked(timeout_s)

    async def hello(self, timeout_s: float | None = None) -> proto.HelloReply:
        async with self._hello_lock:
            return await self._hello_locked(timeout_s)

    async def _hello_locked(self, timeout_s: float | None) -> proto.HelloReply:
        msg = proto.Hello(
            next(self._rids), proto.PROTOCOL_VERSION, self.name, self.value_part_bytes
        )
        reply, _ = await self._send(msg, (), self.timeout_s if timeout_s is None else timeout_s)
        self.max_value_size = reply.max_value_size
        self.max_batch = reply.max_batch
        self.server_name = reply.server
        self._session = True
        offered = self.data_connections > 0 and reply.data_port > 0 and reply.data_token
        self._set_data(
            DataConnections(
                endpoint_host(self.endpoint),
                reply.data_port,
                reply.data_token,
                size=self.data_connections,
                max_payload=reply.max_value_size,
            )
            if offered
            else None
        )
        return reply

    def _set_data(self, conns: DataConnections | None) -> None:
        if self._data is not None:
            self._data.close()
        self._data = conns

    @property
    def data_path(self) -> bool:
        """Whether `get_into` currently uses data connections."""
        return self._data is not None

    async def put(
        self,
        key: str,
        value: Any,
        meta: bytes = b"",
        checksum: int | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Store value (bytes-like); returns the server's checksum of it.
        ValueTooLargeError, without sending it, for a value over the server's
        max_value_size (one past its frame limit would cost the connection, and every
        request on it)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        limit = await self._value_limit(timeout_s)
        nbytes = _nbytes(value)
        if limit and nbytes > limit:
            raise ValueTooLargeError(
                f"value of {nbytes} bytes over the cache-server's max_value_size {limit}"
            )
        reply, _ = await self._call(
            lambda rid: proto.PutValue(rid, key, meta, checksum),
            (value,),
            max(deadline - loop.time(), 0.001),
        )
        return reply.checksum

    async def _value_limit(self, timeout_s: float) -> int:
        """The server's max_value_size (a hello first if none was made yet)."""
        if not self._session:
            await self._ensure_session(timeout_s)
        return self.max_value_size

    async def get(self, key: str, timeout_s: float | None = None) -> Value | None:
        reply, frames = await self._call(lambda rid: proto.GetValue(rid, key), (), timeout_s)
        if not reply.found:
            return None
        if len(frames) != reply.parts or not frames:
            raise BadRequestError(
                f"get reply carried {len(frames)} value frames, not {reply.parts}"
            )
        return _value(frames, reply.meta, reply.checksum)

    async def get_into(
        self, key: str, place: Place, timeout_s: float | None = None
    ) -> Value | None:
        """A get whose value lands in the buffer place(meta, nbytes) returns (or, when
        it returns None, in one of the connection's own), over a data connection
        (cacheserver_data_client.py) when the server offers them; otherwise, or when
        the data port cannot be reached (then until the next hello), the ZMQ get, which
        does not call place."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if not self._session:
            await self._ensure_session(timeout_s)
        conns = self._data
        if conns is not None:
            try:
                async with asyncio.timeout_at(deadline):
                    got = await conns.get(key, place)
            except TimeoutError:
                raise CacheServerUnavailable(
                    f"no data reply from {self.endpoint} within {timeout_s:.3g}s"
                ) from None
            except DataConnectError as exc:
                log.warning("cache-server data port unusable; gets go over ZMQ", error=str(exc))
                if self._data is conns:
                    self._set_data(None)
            except (ConnectionError, DataFrameError) as exc:
                raise CacheServerUnavailable(f"data connection: {exc}") from None
            else:
                if got is None:
                    return None
                meta, checksum, buf = got
                return Value(buf, meta, checksum)
        return await self.get(key, max(deadline - loop.time(), 0.001))

    async def exists(self, key: str, timeout_s: float | None = None) -> bool:
        reply, _ = await self._call(lambda rid: proto.CheckValue(rid, key), (), timeout_s)
        return reply.found

    async def delete(self, key: str, timeout_s: float | None = None) -> bool:
        reply, _ = await self._call(lambda rid: proto.DeleteValue(rid, key), (), timeout_s)
        return reply.deleted

    def _batches(self, n: int) -> list[range]:
        size = max(1, self.max_batch)
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    async def put_many(
        self,
        items: Sequence[tuple[str, Any, bytes]],
        timeout_s: float | None = None,
    ) -> list[int]:
        """Store (key, value, meta) items; one error code per item (0 = stored).
        Sent in messages of at most max_batch items and max_value_size bytes (or one
        value): ZMQ hands the server a message only whole, so one batch of large
        values could hold many times the server's memory at once. A value over
        max_value_size is not sent: its code is VALUE_TOO_LARGE."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        limit = await self._value_limit(timeout_s)
        too_large = int(proto.ErrorCode.VALUE_TOO_LARGE)
        out = [too_large] * len(items)
        for part in self._put_batches(items, limit):
            chunk = [items[i] for i in part]
            keys = [k for k, _, _ in chunk]
            metas = [m for _, _, m in chunk]
            reply, _ = await self._call(
                lambda rid, k=keys, m=metas: proto.PutValues(rid, k, m),
                [v for _, v, _ in chunk],
                max(deadline - loop.time(), 0.001),
            )
            for i, code in zip(part, _one_each(reply.errors, keys, "mput"), strict=True):
                out[i] = code
        return out

    def _put_batches(self, items: Sequence[tuple[str, Any, bytes]], limit: int) -> list[list[int]]:
        """Indices of items, grouped into messages; those over limit left out."""
        size = max(1, self.max_batch)
        batches: list[list[int]] = []
        batch: list[int] = []
        held = 0
        for i, (_, value, _) in enumerate(items):
            nbytes = _nbytes(value)
            if limit and nbytes > limit:
                continue
            if batch and (len(batch) == size or (limit and held + nbytes > limit)):
                batches.append(batch)
                batch, held = [], 0
            batch.append(i)
            held += nbytes
        if batch:
            batches.append(batch)
        return batches

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[Value | None]:
        out: list[Value | None] = []
        for part in self._batches(len(keys)):
            chunk = [keys[i] for i in part]
            reply, frames = await self._call(
                lambda rid, k=chunk: proto.GetValues(rid, k), (), timeout_s
            )
            n_found = sum(reply.found)
            parts = reply.parts or [1] * n_found
            if (
                len(reply.found) != len(chunk)
                or len(reply.metas) != len(chunk)
                or len(reply.checksums) != len(chunk)
                or len(parts) != n_found
                or min(parts, default=1) < 1
                or len(frames) != sum(parts)
            ):
                raise BadRequestError("mget reply does not match its request")
            at = 0
            counts = iter(parts)
            for found, meta, checksum in zip(
                reply.found, reply.metas, reply.checksums, strict=True
            ):
                if found:
                    n = next(counts)
                    out.append(_value(frames[at : at + n], meta, checksum))
                    at += n
                else:
                    out.append(None)
        return out

    async def exists_many(self, keys: Sequence[str], timeout_s: float | None = None) -> list[bool]:
        out: list[bool] = []
        for part in self._batches(len(keys)):
            chunk = [keys[i] for i in part]
            reply, _ = await self._call(
                lambda rid, k=chunk: proto.CheckValues(rid, k), (), timeout_s
            )
            out.extend(_one_each(reply.found, chunk, "exists"))
        return out

    async def delete_many(self, keys: Sequence[str], timeout_s: float | None = None) -> list[bool]:
        out: list[bool] = []
        for part in self._batches(len(keys)):
            chunk = [keys[i] for i in part]
            reply, _ = await self._call(
                lambda rid, k=chunk: proto.DeleteValues(rid, k), (), timeout_s
            )
            out.extend(_one_each(reply.deleted, chunk, "delete"))
        return out

    async def list_page(
        self, prefix: str = "", cursor: str = "", limit: int = 1000, timeout_s: float | None = None
    ) -> tuple[list[str], str]:
        reply, _ = await self._call(
            lambda rid: proto.ListKeys(rid, prefix, cursor, limit), (), timeout_s
        )
        return reply.keys, reply.cursor

    async def list_keys(self, prefix: str = "", page: int = 1000) -> AsyncIterator[str]:
        cursor = ""
        while True:
            keys, cursor = await self.list_page(prefix, cursor, page)
            for key in keys:
                yield key
            if not cursor:
                return

    async def stats(self, timeout_s: float | None = None) -> proto.GetStatsReply:
        reply, _ = await self._call(lambda rid: proto.GetStats(rid), (), timeout_s)
        return reply

    async def health(self, timeout_s: float | None = None) -> proto.CheckHealthReply:
        reply, _ = await self._call(lambda rid: proto.CheckHealth(rid), (), timeout_s)
        return reply


def _one_each(results: list[Any], keys: Sequence[Any], op: str) -> list[Any]:
    """results, checked to be one per key (else they could be taken for other keys')."""
    if len(results) != len(keys):
        raise BadRequestError(f"{op} reply has {len(results)} results for {len(keys)} keys")
    return results


def _nbytes(frame: Any) -> int:
    if isinstance(frame, memoryview):
        return frame.nbytes
    try:
        return len(frame)
    except TypeError:
        return memoryview(frame).nbytes


async def _released(tracker: zmq.MessageTracker, client: CacheServerClient) -> None:
    """Wait until ZMQ is done with a zero-copy buffer: it has been written to the
    socket, or dropped with its connection, or the socket was closed."""
    delay, closed_wait = 0.0002, 1.0
    while not tracker.done:
        if client.closed:
            # Closing with linger 0 discards the message; ZMQ frees it shortly after.
            closed_wait -= delay
            if closed_wait <= 0:
                return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
