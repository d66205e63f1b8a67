"""The cache-server's data connections: gets over a plain TCP stream
(framing: kvmesh.common.protocol.cacheserver_data).

A client learns the port and the token from its ZMQ hello; values come from the same
store, with the same hit/miss counting, as ZMQ gets. Bad input (a wrong preamble or
token, an unknown op, a key that is not a valid key, a request that stops arriving
within `request_timeout_s`) ends that connection, after a REFUSED reply where one can
be framed; other connections are not affected. Not offered under CURVE: the stream is
not encrypted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import socket
from collections.abc import Callable

from kvmesh.common.config import CacheServerConfig
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import cacheserver_data as data
from kvmesh.common.protocol.cacheserver import MAX_KEY_BYTES
from kvmesh.common.transport.tcp_address import every_address_socket, ipv4_first
from kvmesh.services.cacheserver.handlers import Handlers, RequestError, check_key
from kvmesh.services.cacheserver.stats import ServerStats

log = get_logger(__name__)


RECV_BYTES = 64 * 1024


class _Close(Exception):
    """End this connection (after whatever reply was written)."""


class DataListener:
    def __init__(
        self,
        handlers: Handlers,
        stats: ServerStats,
        config: CacheServerConfig,
        open_connections: Callable[[], int],
    ) -> None:
        self.handlers = handlers
        self.stats = stats
        self.config = config
        self.token = secrets.token_bytes(data.TOKEN_BYTES)
        self.connections = 0
        self.port = 0
        self._open_connections = open_connections
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._clients: set[asyncio.Task] = set()

    async def start(self) -> None:
        # Plain sockets and the loop's sock_* calls, not streams: a value is sent from
        # the store's own memory (Python 3.11's StreamWriter.writelines joins its
        # buffers into one new bytes, a copy of every value).
        sock = every_address_socket(self.config.host, self.config.data_port)
        if sock is None:
            infos = await asyncio.get_running_loop().getaddrinfo(
                self.config.host, self.config.data_port, type=socket.SOCK_STREAM
            )
            family, kind, proto, _, addr = ipv4_first(infos)
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(128)
            except BaseException:
                sock.close()
                raise
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(), name="cacheserver-data-accept")

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors and the like: try again shortly
                log.warning("data connection not accepted", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve_client(conn))
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    async def _serve_client(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        self.stats.connections["data"].set(self.connections)
        reader = _Reader(conn)
        try:
            if self._open_connections() > self.config.max_connections:
                raise _Close("at the connection limit")
            await self._greet(conn, reader)
            while True:
                # Idle between requests up to session_idle_s (a client reconnects), but
                # a request once begun must arrive within request_timeout_s.
                if not await reader.wait(self.config.session_idle_s):
                    return  # the client closed, or stayed idle too long
                await self._serve_one(conn, reader)
        except _Close as exc:
            self.stats.data_closed.inc()
            log.info("data connection closed", reason=str(exc))
            message = str(exc).encode()[: data.MAX_REFUSAL_BYTES]
            with contextlib.suppress(OSError, TimeoutError):
                await self._send(conn, data.REPLY.pack(data.REFUSED, len(message), 0, 0) + message)
        except (OSError, TimeoutError):  # reset, or too slow to read a reply
            self.stats.data_closed.inc()
        finally:
            self.connections -= 1
            self.stats.connections["data"].set(self.connections)
            conn.close()

    async def _send(self, conn: socket.socket, *parts: bytes | memoryview) -> None:
        """parts in one sendmsg when the socket takes them all (the common case: one
        syscall, no wait), else the rest as the socket drains, within the deadline."""
        try:
            sent = conn.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        rest = []
        for part in parts:
            n = len(part) if isinstance(part, bytes) else part.nbytes
            if sent >= n:
                sent -= n
                continue
            rest.append(memoryview(part)[sent:])
            sent = 0
        if rest:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.config.request_timeout_s):
                for part in rest:
                    await loop.sock_sendall(conn, part)

    async def _greet(self, conn: socket.socket, reader: _Reader) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        raw = await reader.take(data.PREAMBLE.size, deadline)
        if raw is None:
            raise _Close("no preamble")
        magic, token = data.PREAMBLE.unpack(raw)
        if magic != data.MAGIC:
            raise _Close(f"not a kvmesh data connection (magic {magic!r})")
        if not hmac.compare_digest(token, self.token):
            raise _Close("wrong token: say hello over ZMQ first")
        await self._send(conn, data.READY)

    async def _serve_one(self, conn: socket.socket, reader: _Reader) -> None:
        # One deadline for the whole request, not one per receive: a peer trickling
        # a byte at a time must not hold it (and its connection slot) open.
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        head = await reader.take(data.REQUEST.size, deadline)
        if head is None:
            raise _Close("request truncated")
        op, key_len = data.REQUEST.unpack(head)
        if op != data.OP_GET:
            self.stats.data_requests["invalid"].inc()
            raise _Close(f"unknown op {op}")
        if not 0 < key_len <= MAX_KEY_BYTES:  # refused before reading what could not be a key
            self.stats.data_requests["invalid"].inc()
            raise _Close(f"not a valid key: {key_len} bytes (1-{MAX_KEY_BYTES})")
        raw = await reader.take(key_len, deadline)
        if raw is None:
            raise _Close("request truncated")
        try:
            key = raw.decode("utf-8")
            check_key(key)
        except (UnicodeDecodeError, RequestError):
            self.stats.data_requests["invalid"].inc()
            raise _Close(f"not a valid key: {raw[:40]!r}") from None
        self.stats.data_requests["get"].inc()
        entry = await self.handlers.fetch(key)
        if entry is None:
            await self._send(conn, data.REPLY.pack(data.MISSING, 0, 0, 0))
        else:
            head = data.REPLY.pack(data.FOUND, len(entry.meta), entry.nbytes, entry.checksum)
            await self._send(conn, head + entry.meta, entry.view)


class _Reader:
    """Buffered reads of one connection: requests are a few hundred bytes, so one
    receive usually brings a whole request (one wake-up per request, not three)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = bytearray()

    async def _fill(self, deadline: float) -> bool:
        """More bytes by deadline (loop time); False when the peer closed or was silent."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                more = await loop.sock_recv(self.conn, RECV_BYTES)
        except TimeoutError:
            return False
        self.buf += more
        return bool(more)

    async def wait(self, timeout_s: float) -> bool:
        """Whether a request has begun (a byte is here) within timeout_s."""
        if self.buf:
            return True
        return await self._fill(asyncio.get_running_loop().time() + timeout_s)

    async def take(self, n: int, deadline: float) -> bytes | None:
        """The next n bytes, or None when the peer closed or they are not all here by
        deadline (loop time)."""
        while len(self.buf) < n:
            if not await self._fill(deadline):
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out
