"""The cache-server's optional second listener: LMCache's `lm://` TCP protocol.

An LMCache deployment sets `remote_url: lm://HOST:LM_PORT` and uses kvmesh's
cache-server unchanged (framing: kvmesh.common.protocol.lmcache_lm). Its values share
the store, memory bound, LRU, spill and checksums with kvmesh's own clients, under
keys no kvmesh client can name (`INTERNAL_PREFIX + "lm:" + key`), with the PUT
header's format, dtype, shape and location kept as the value's meta for GET replies.

Unlike LMCache's own server it sets TCP_NODELAY and sends a reply header and its
payload in one write (two writes stall ~44 ms per small GET on Nagle plus delayed ACK).

LMCache's client never reconnects: a connection closed on it ends its remote tier until
the engine restarts. So what its client can send is served on the same connection:

- a PUT over `max_value_size` (or one the store refuses) sends no reply, so its payload
  is read and dropped, a buffer at a time, and the connection goes on in step; a GET of
  it misses;
- its client checks a key's length in characters but sends only the first 150 bytes of
  its UTF-8, so a key of non-ASCII text can arrive cut (inside a character, or at a
  boundary, where two keys could become one and serve each other's values). A key that
  fills all 150 bytes and is not ASCII (the only kind that can have been cut: an ASCII
  key fills them only at exactly 150 characters), or one that is not ASCII and does not
  end as LMCache's keys do or carries tags (a cut that fell on a space looks padded),
  is never stored or found: its PUT is dropped, its GET and EXIST answer 400.

Bad input: a header that cannot be valid (negative length, a key that is empty or not
UTF-8 otherwise), an unknown command, a header or payload that stops arriving within
`request_timeout_s` once begun, or a reply the client does not take within it closes
that connection (an unknown command gets a 400 reply first). LIST, which LMCache's
client never sends and its server never answers, gets a 400 reply. An idle connection
stays open, as with LMCache's own server, whose client keeps one connection for its
life (TCP keepalive finds a peer whose host died, within about two minutes). Other
connections are not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import re
import socket

from kvmesh.common import offload
from kvmesh.common.config import CacheServerConfig
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import lmcache_lm as lm
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.common.transport.tcp_address import every_address_socket
from kvmesh.services.cacheserver.stats import ServerStats
from kvmesh.services.cacheserver.store import (
    INTERNAL_PREFIX,
    MemoryStore,
    StoreError,
    checksums_off_loop,
    make_entry,
)

log = get_logger(__name__)

LM_PREFIX = INTERNAL_PREFIX + "lm:"
_FAIL = lm.FAIL.pack()
_SUCCESS = lm.SUCCESS.pack()
# Parsed in place of a key that may have been cut (see module doc), to read the rest.
_CUT_STAND_IN = b"cut".ljust(lm.KEY_BYTES, b" ")
# Payloads are read this much at a time (the stream's buffer stays small).
_READ_CHUNK = 1 << 20
# Payloads from this size on go to a mapping of their own (_read_payload).
_MAP_FROM = 32 << 20
# Idle 60 s, then 6 probes 10 s apart (Linux names; left out where the system lacks them).
KEEPALIVE = [
    (getattr(socket, name), value)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6))
    if hasattr(socket, name)
]


class _Close(Exception):
    """End this connection (after whatever reply was written)."""


class _Dropped(Exception):
    """No memory for a PUT's payload: it was read and dropped, the connection is in step."""


# The end of every key LMCache builds: world size, worker id, chunk hash (hex, "-" for
# a negative int), dtype, then a layer id and `k%v` tags, if any (a model name or a
# tag's value may hold anything, "@" included).
_KEY_END = re.compile(r"@\d+@\d+@-?[0-9a-f]+@\w+(?:@\d+)?(?P<tags>@[^@%]*%.*)?\Z")


def maybe_cut(key_field: bytes) -> bool:
    """Whether a request's 150-byte key field may hold a key LMCache's client cut short
    (see module doc). Only a key that is not ASCII can be. With no space padding left it
    may be; with padding it still may, if the cut fell on a space (which LMCache keys
    hold only in the model name or a tag): it must then end as LMCache's keys do, and
    hold no tag (a cut at a space inside a tag still ends like a key, however short
    what is left; non-ASCII keys with tags are never cached). Left: a tag whose name is
    digits, a space and more, cut at that space, reads as a layer id."""
    if key_field.isascii():
        return False
    if key_field[-1:] != b" ":
        return True
    content = key_field.rstrip(b" ")
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return True
    end = _KEY_END.search(text)
    if end is None:
        return True  # a cut in the model name leaves no dtype field
    return end["tags"] is not None


class LmListener:
    def __init__(self, store: MemoryStore, stats: ServerStats, config: CacheServerConfig) -> None:
        self.store = store
        self.stats = stats
        self.config = config
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task] = set()
        # Connections already warned about cut keys (one warning each, not one a request).
        self._warned_cut: set[asyncio.Task] = set()
        self._warned_large: set[asyncio.Task] = set()

    async def start(self) -> None:
        sock = every_address_socket(self.config.host, self.config.lm_port)
        if sock is not None:
            self._server = await asyncio.start_server(self._serve_client, sock=sock)
        else:
            self._server = await asyncio.start_server(
                self._serve_client, self.config.host, self.config.lm_port, reuse_address=True
            )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._clients):
                task.cancel()
            await asyncio.gather(*self._clients, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            # A dead host's connection (and its max_connections slot) freed within about
            # two minutes, not the kernel's default of two hours.
            for opt, value in KEEPALIVE:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        self.connections += 1
        self.stats.connections["lm"].set(self.connections)
        try:
            if self.connections > self.config.max_connections:
                log.warning("lm:// connection refused: at the connection limit")
                self.stats.lm_closed.inc()
                return
            while True:
                header = await self._header(reader)
                if header is None:
                    return  # the client closed
                await self._serve_one(header, reader, writer)
        except _Close as exc:
            self.stats.lm_closed.inc()
            log.info("lm:// connection closed", reason=str(exc))
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            self.stats.lm_closed.inc()
            # A peer too slow to read its reply would hold a graceful close open
            # (the transport flushes first): drop what is unsent.
            writer.transport.abort()
        except asyncio.CancelledError:
            # stop(): end normally, since Python 3.11's stream callback calls
            # task.exception() on this task and logs a cancelled one as an error.
            writer.transport.abort()
        except Exception:
            # Anything else (memory running out mid-read): this connection can no longer
            # be kept in step, so it ends; the others and the server go on.
            self.stats.lm_closed.inc()
            log.exception("lm:// connection closed on an internal error")
            writer.transport.abort()
        finally:
            self.connections -= 1
            self.stats.connections["lm"].set(self.connections)
            self._clients.discard(task)
            self._warned_cut.discard(task)
            self._warned_large.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _header(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next request header; None when the client closed. Once its first byte is
        here the rest must arrive within request_timeout_s (TimeoutError): a stalled
        peer must not keep its slot."""
        first = await reader.read(1)
        if not first:
            return None
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return first + await reader.readexactly(lm.REQUEST_SIZE - 1)
        except asyncio.IncompleteReadError:
            return None  # the client closed mid-header

    async def _serve_one(
        self, header: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        cut = maybe_cut(header[-lm.KEY_BYTES :])
        try:
            req = lm.parse_request(header[: -lm.KEY_BYTES] + _CUT_STAND_IN if cut else header)
        except lm.LmFrameError as exc:
            self.stats.lm_requests["invalid"].inc()
            raise _Close(f"bad header: {exc}") from None
        command = req.command
        key = None if cut else LM_PREFIX + req.key
        if cut and command in (lm.Command.PUT, lm.Command.GET, lm.Command.EXIST):
            self._warn_cut(header[-lm.KEY_BYTES :])
        if command == lm.Command.PUT:
            self.stats.lm_requests["put"].inc()
            await self._put(req, key, reader)
            return  # PUT has no reply
        if command == lm.Command.GET:
            self.stats.lm_requests["get"].inc()
            entry = await self._get(key)
            if entry is None:
                writer.write(_FAIL)
            else:
                head = lm.reply_from_meta(entry.meta, entry.nbytes).pack()
                # One write for header and payload (see module doc).
                writer.writelines([head, entry.view])
                self.stats.bytes_out.inc(entry.nbytes)
        elif command == lm.Command.EXIST:
            self.stats.lm_requests["exist"].inc()
            found = key is not None and self.store.contains(key)
            writer.write(_SUCCESS if found else _FAIL)
        elif command == lm.Command.HEALTH:
            self.stats.lm_requests["health"].inc()
            writer.write(_SUCCESS)
        elif command == lm.Command.LIST:
            self.stats.lm_requests["list"].inc()
            writer.write(_FAIL)
        else:
            self.stats.lm_requests["invalid"].inc()
            writer.write(_FAIL)
            await self._drain(writer)
            raise _Close(f"unknown command {command}")
        await self._drain(writer)

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        # A client that sends gets and never reads the replies must not hold its
        # connection (and the buffered values) forever.
        async with asyncio.timeout(self.config.request_timeout_s):
            await writer.drain()

    def _warn_cut(self, key_field: bytes) -> None:
        self.stats.errors[ErrorCode.BAD_KEY].inc()
        self._warn_once(
            self._warned_cut,
            "lm:// key is not ASCII and may have been cut (LMCache sends a key's first "
            "150 bytes), so it is never stored or found",
            key=key_field.decode("utf-8", "replace"),
        )

    @staticmethod
    def _warn_once(warned: set[asyncio.Task], event: str, **fields: object) -> None:
        """Log event once per connection (a client repeats what it does, chunk after
        chunk); the counters count every one."""
        task = asyncio.current_task()
        if task is not None and task not in warned:
            warned.add(task)
            log.warning(event, **fields)

    async def _put(self, req: lm.LmRequest, key: str | None, reader: asyncio.StreamReader) -> None:
        limit = int(self.config.max_value_size)
        if key is None:
            await self._skip(reader, req.length)
            return
        if req.length > limit:
            # No reply to say so: drop the payload and stay in step with the client.
            self.stats.errors[ErrorCode.VALUE_TOO_LARGE].inc()
            self._warn_once(
                self._warned_large,
                "lm:// puts over max_value_size are dropped (this connection's first)",
                error=f"{req.length} bytes over max_value_size {limit}",
            )
            await self._skip(reader, req.length)
            # The client believes the new value stored: never serve it the old one.
            self.store.delete(key)
            return
        try:
            payload = await self._read_payload(reader, req.length)
        except _Dropped:
            # The server is short of memory, not the client wrong: drop this value
            # and stay in step (the rest of it is read and dropped).
            self.stats.errors[ErrorCode.INTERNAL].inc()
            log.warning("lm:// put dropped: out of memory", nbytes=req.length)
            self.store.delete(key)
            return
        try:
            big = len(payload) >= offload.OFFLOAD_FROM
            actual = (await checksums_off_loop([payload]))[0] if big else None
            entry = make_entry(payload, lm.meta_of(req), actual=actual)
            self.store.put(key, entry)
        except StoreError as exc:
            self.stats.errors[exc.code].inc()
            log.warning("lm:// put refused", error=str(exc))
            self.store.delete(key)  # as above: not the old value
            return
        self.stats.bytes_in.inc(entry.nbytes)

    async def _read_payload(self, reader: asyncio.StreamReader, n: int) -> bytearray | mmap.mmap:
        """An n-byte payload, read into its own buffer as it arrives: readexactly would
        hold it twice at the end (the stream's buffer and its copy), 2x a value's memory
        for each PUT in flight. The buffer commits memory only as bytes arrive: a
        bytearray sized at the header is zero-filled at once, on the event loop, so
        headers alone announcing large PUTs committed memory and stalled every client.
        Below _MAP_FROM it is a bytearray grown as bytes arrive (from the heap; it may
        keep ~12% slack); from there an exact private anonymous mapping, few enough
        that the process's 65530 mappings are never near (a mapping per value of any
        size ran them out at 1 MiB values). _Dropped (the rest read and dropped) when
        memory runs out."""
        got = 0
        try:
            if n < _MAP_FROM:
                payload: bytearray | mmap.mmap | None = bytearray()
            else:
                payload = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            async with asyncio.timeout(self.config.request_timeout_s):
                while got < n:
                    chunk = await reader.read(min(n - got, _READ_CHUNK))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", n - got)
                    if isinstance(payload, mmap.mmap):
                        payload[got : got + len(chunk)] = chunk
                    else:
                        payload += chunk
                    got += len(chunk)
        except MemoryError:
            pass  # below: the rest is read and dropped, so the connection stays in step
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
        else:
            return payload
        payload = None  # the part read goes before the rest is drained
        await self._skip(reader, n - got)
        raise _Dropped

    async def _skip(self, reader: asyncio.StreamReader, n: int) -> None:
        """Read and drop an n-byte payload, under the same deadline as one kept."""
        async with asyncio.timeout(self.config.request_timeout_s):
            while n > 0:
                chunk = await reader.read(min(n, _READ_CHUNK))
                if not chunk:
                    raise asyncio.IncompleteReadError(b"", n)
                n -= len(chunk)

    async def _get(self, key: str | None):
        store = self.store
        if key is None:  # a key that may have been cut is never found
            store.count(False, reason="not_stored")
            self.stats.misses.inc()
            self.stats.miss_reasons["not_stored"].inc()
            return None
        entry = store.get_memory(key)
        reason = ""
        if entry is None and store.needs_disk(key):
            try:
                async with asyncio.timeout(self.config.request_timeout_s):
                    entry = await store.read_spilled(key)
            except TimeoutError:
                entry, reason = None, "timeout"
        if entry is not None and len(entry.meta) != lm.META_SIZE:
            entry = None  # not an lm:// value (cannot happen through this listener)
        reason = store.count(entry is not None, key, reason)
        if entry is None:
            self.stats.misses.inc()
            self.stats.miss_reasons[reason].inc()
        else:
            self.stats.hits.inc()
        return entry
