"""The client side of the cache-server's data connections (framing:
kvmesh.common.protocol.cacheserver_data).

Up to `size` TCP connections to one server, each carrying one get at a time, opened
on first use and reused. A get asks `place(meta, nbytes)` for the buffer the value
should land in, once the reply's header has arrived, and receives the bytes straight
into it with non-blocking `recv_into` calls on the event loop: no thread between the
socket and the caller, no intermediate buffer. A connection whose get did not end
cleanly (an error, a cancellation, a deadline) is closed, never reused: bytes of an
unread reply must not be taken for the next one, and nothing is written into a
buffer after its get has returned or raised.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import socket
from collections.abc import Callable

from kvmesh.common.protocol import cacheserver_data as data
from kvmesh.common.transport.tcp_address import ipv4_first

# place(meta, nbytes): a writable buffer of exactly nbytes for the value, or None for
# one of the connection's own.
Place = Callable[[bytes, int], memoryview | None]

# Own buffers from this size are page-aligned: on the AMD EPYC measured 2026-11-26 a
# 2 MiB loopback receive into memory starting 16 bytes into a page (where a large
# bytearray's bytes start) took 1.5 ms against 0.45 ms page-aligned.
ALIGN_FROM = 64 * 1024
ALIGN = 4096
FIRST_RECV_BYTES = 16 * 1024
CONNECT_TIMEOUT_S = 0.5


class DataConnectError(ConnectionError):
    """The data port did not take a connection (unreachable, refused, wrong token)."""


class DataRefused(ConnectionError):
    """The server refused a request and closed the connection."""


class _Stale(Exception):
    """The connection was closed before any byte of the reply came."""


class DataConnections:
    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        *,
        size: int = 8,
        max_payload: int = 1 << 40,
    ) -> None:
        self.host, self.port, self.token = host, port, token
        self.max_payload = max_payload
        self._slots = asyncio.Semaphore(size)
        self._idle: list[socket.socket] = []
        self._addr: tuple[int, tuple] | None = None
        self._closed = False

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    async def get(self, key: str, place: Place) -> tuple[bytes, int, memoryview] | None:
        """(meta, checksum, the value's bytes) or None when the server has no such
        key. DataConnectError when no connection could be opened; DataRefused,
        ConnectionError or data.DataFrameError when one broke."""
        async with self._slots:
            while True:
                reused = bool(self._idle)
                sock = self._idle.pop() if reused else await self._connect()
                reusable = False
                try:
                    result = await self._get(sock, key, place)
                    reusable = not self._closed
                    return result
                except _Stale:
                    if not reused:
                        raise ConnectionError("data connection closed before a reply") from None
                    # The server closed it while it sat idle: once more on a new one.
                finally:
                    if reusable:
                        self._idle.append(sock)
                    else:
                        sock.close()

    async def _address(self) -> tuple[int, tuple]:
        """(family, address) of the data port, resolved once per hello. A name is
        looked up on the loop's executor threads, which a resolver that cannot reach
        its DNS server holds for seconds: while the cache-server restarts, one lookup
        per get would take every executor thread the engine's decodes need."""
        if self._addr is None:
            try:
                ip = ipaddress.ip_address(self.host)
            except ValueError:
                loop = asyncio.get_running_loop()
                try:
                    async with asyncio.timeout(CONNECT_TIMEOUT_S):
                        infos = await loop.getaddrinfo(
                            self.host, self.port, type=socket.SOCK_STREAM
                        )
                except OSError as exc:  # TimeoutError included
                    why = str(exc) or f"no answer within {CONNECT_TIMEOUT_S}s"
                    raise DataConnectError(f"resolving {self.host}: {why}") from None
                family, *_, addr = ipv4_first(infos)
                self._addr = (family, addr)
            else:
                family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
                self._addr = (family, (self.host, self.port))
        return self._addr

    async def _connect(self) -> socket.socket:
        if self._closed:
            raise DataConnectError("data connections closed")
        loop = asyncio.get_running_loop()
        family, addr = await self._address()
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # Its own short deadline: a port that drops packets (a firewall, a Service
            # that does not forward it) must not cost every get its whole deadline.
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.sock_connect(sock, addr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_sendall(sock, data.PREAMBLE.pack(data.MAGIC, self.token))
                ready = await _recv_bytes(sock, len(data.READY))
        except BaseException as exc:
            sock.close()
            if isinstance(exc, (OSError, TimeoutError)):
                why = str(exc) or f"no answer within {CONNECT_TIMEOUT_S}s"
                raise DataConnectError(f"data port {self.host}:{self.port}: {why}") from None
            raise
        if ready != data.READY:
            sock.close()
            raise DataConnectError(f"data port {self.host}:{self.port} refused the connection")
        return sock

    async def _get(
        self, sock: socket.socket, key: str, place: Place
    ) -> tuple[bytes, int, memoryview] | None:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, data.pack_get(key))
            # One receive usually brings the header, the meta and the payload's start.
            first = await loop.sock_recv(sock, FIRST_RECV_BYTES)
        except (BrokenPipeError, ConnectionResetError):
            raise _Stale from None
        if not first:
            raise _Stale
        if len(first) < data.REPLY.size:
            first += await _recv_bytes(sock, data.REPLY.size - len(first))
        status, meta_len, nbytes, checksum = data.parse_reply(
            first[: data.REPLY.size], self.max_payload
        )
        at = data.REPLY.size + meta_len
        if len(first) < at:
            first += await _recv_bytes(sock, at - len(first))
        meta = first[data.REPLY.size : at]
        if len(first) > at + nbytes:
            raise data.DataFrameError("bytes after the reply (one request at a time)")
        if status == data.REFUSED:
            raise DataRefused(meta.decode("utf-8", "replace"))
        if status == data.MISSING:
            return None
        buf = place(meta, nbytes)
        if buf is None:
            buf = _own_buffer(nbytes)
        elif buf.nbytes != nbytes or buf.readonly:
            raise ValueError(f"place gave a buffer of {buf.nbytes} bytes for {nbytes}")
        early = len(first) - at
        if early:
            buf[:early] = memoryview(first)[at:]
        await _recv_into(sock, buf[early:])
        return meta, checksum, buf


def _own_buffer(n: int) -> memoryview:
    """n bytes of heap memory, page-aligned from ALIGN_FROM (not a fresh mapping per
    value: that costs a page fault per 4 KiB, 4x the whole receive at 2 MiB)."""
    if n < ALIGN_FROM:
        return memoryview(bytearray(n))
    raw = bytearray(n + ALIGN)
    at = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN
    return memoryview(raw)[at : at + n]


async def _recv_into(sock: socket.socket, buf: memoryview) -> None:
    loop = asyncio.get_running_loop()
    got, n = 0, buf.nbytes
    while got < n:
        step = await loop.sock_recv_into(sock, buf[got:])
        if not step:
            raise ConnectionError("data connection closed mid-reply")
        got += step


async def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await _recv_into(sock, memoryview(buf))
    return bytes(buf)


def endpoint_host(endpoint: str) -> str:
    """The host of a ZMQ tcp:// endpoint (brackets of an IPv6 address removed)."""
    rest = endpoint.partition("://")[2]
    host = rest.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host
