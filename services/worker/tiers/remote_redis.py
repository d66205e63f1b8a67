"""`redis://`, `rediss://` and `redis-cluster://`: Redis through redis-py's asyncio clients.

A value is one Redis string: the 144-byte chunk header (`VALUE_LAYOUT`), then the
payload. Keys are `key_prefix + ChunkKey.to_str()`; in a cluster they spread over slots
by their hash (no hash tags), and a batch of EXISTS goes out as one pipeline per node
(single-key commands only, so no command ever spans two slots).

redis-py's own retries are turned off (the tier's deadline and health monitor decide
what a failure means), and any error in the middle of a reply drops that connection
rather than reusing it (redis-py's behaviour). One case is sent again here: a pooled
connection the server closed while idle (`_once_more`). Redis has no memory bound of
its own unless configured: run it with `maxmemory` and `maxmemory-policy allkeys-lru`.
A chunk is one key, so eviction never leaves part of one. A value over the server's
`proto-max-bulk-len` is refused before it is sent; a key of another type (a list, a
hash) under a chunk's name reads as a corrupt value.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import unquote

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError

from kvmesh.common import offload
from kvmesh.common.chunk_codec import VALUE_LAYOUT, ChunkHeader, CorruptChunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.redact import redact_url
from kvmesh.common.transport.tcp_address import host_ports
from kvmesh.services.worker.tiers.remote_connector import (
    Fetched,
    StoreFull,
    ValueRefused,
)

DEFAULT_PORT = 6379
# Redis's own default of `proto-max-bulk-len`, the largest string it takes: what a
# server that will not say (CONFIG renamed away) is taken to have.
DEFAULT_MAX_VALUE = 512 << 20
CLEAR_BATCH = 500
_GLOB = re.compile(r"([*?\[\]\\])")
# How a pooled connection the server closed while it sat idle (Redis's `timeout`, a
# proxy's idle limit) shows at its next command: a ConnectionError, or under uvloop,
# whose transport is gone after a reset, a RuntimeError.
_CLOSED_BY_SERVER = (
    "closed by server",
    "reset by peer",
    "broken pipe",
    "handler is closed",
    "connection lost",  # a connection put back after an error reply, closed meanwhile
)
# Values up to this size are sent again at once when cut off (never over a server's
# limits); larger ones only once a ping shows the server up (_set_large).
_RESEND_MAX = 1 << 20


def _closed_by_server(exc: BaseException) -> bool:
    return any(s in str(exc).lower() for s in _CLOSED_BY_SERVER)


class RedisConnector:
    compresses = True

    def __init__(self, url: str, *, key_prefix: str = "kvmesh:", timeout_s: float = 1.0) -> None:
        self.scheme = url.partition("://")[0].lower()
        self._url = url
        self.prefix = key_prefix
        self.timeout_s = timeout_s
        self.client: Any = None
        # The largest value the server takes (_max_value at the first ping after each
        # connect; lowered by a value it cut off twice, _learned_limit).
        self.max_value: int | None = None
        # Pooled connections found closed by the server (read by the tier: see _once_more).
        self.disconnects = 0
        if self.scheme == "redis-cluster":
            netloc = url.partition("://")[2].split("/", 1)[0]
            creds, _, hosts = netloc.rpartition("@")
            user, _, password = creds.partition(":")
            self._nodes = host_ports(hosts, DEFAULT_PORT)
            self._auth = {"username": unquote(user) or None, "password": unquote(password) or None}

    @property
    def display(self) -> str:
        return redact_url(self._url)

    def _name(self, key: ChunkKey) -> str:
        return self.prefix + key.to_str()

    def _client(self) -> Any:
        if self.client is None:
            raise ConnectionError("not connected")
        return self.client

    def connected(self) -> bool | None:
        return None

    def _options(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }

    async def reconnect(self) -> None:
        old, self.client = self.client, None
        self.max_value = None
        if old is not None:
            await old.aclose()
        if self.scheme == "redis-cluster":
            client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self._nodes],
                **self._auth,
                **self._options(),
            )
            try:
                await client.initialize()
            except BaseException:
                await client.aclose()
                raise
        else:
            client = Redis.from_url(self._url, **self._options())
        self.client = client

    async def _once_more(self, request: Callable[[], Awaitable[Any]]) -> Any:
        """request(), sent again once on a fresh connection when its pooled one was
        closed by the server. redis-py does not notice that before sending, so after
        each idle spell every pooled connection failed one request (a burst of gets
        after 2 s idle on `timeout 1`: 7 of 8 missed and the store was marked down).
        Every command sent through here is idempotent. A restart looks the same, so
        each such close counts in `disconnects`: the tier then forgets the keys it
        remembers as present, as it did at the failed request."""
        try:
            return await request()
        except (RedisConnectionError, RuntimeError) as exc:
            if not _closed_by_server(exc):
                raise
            self.disconnects += 1
        return await request()

    async def ping(self) -> None:
        client = self._client()
        await self._once_more(client.ping)
        if self.max_value is None:
            self.max_value = await self._max_value(client)

    @staticmethod
    async def _max_value(client: Any) -> int:
        """The largest value the server takes: the smaller of its largest string and
        its largest command; DEFAULT_MAX_VALUE where it will not say (CONFIG renamed, a
        managed Redis, an ACL, a proxy that drops the connection): the probe never
        decides the store's health, and puts that the server cuts off teach the limit
        (put)."""
        limit = DEFAULT_MAX_VALUE
        # The query buffer holds the whole SET: the key and framing besides the value.
        for name, framing in (("proto-max-bulk-len", 0), ("client-query-buffer-limit", 4096)):
            try:
                reply = await client.config_get(name)
                limit = min(limit, int(reply[name]) - framing)
            except Exception:  # whatever the probe meets, the default stands
                continue
        return limit

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        n = len(packed) + header.stored_nbytes
        limit = self.max_value or DEFAULT_MAX_VALUE
        if n > limit:
            # Sent, Redis answers a protocol error and drops the connection: a failed
            # request, so every chunk this large counted towards marking the store down.
            raise ValueRefused(f"redis: value of {n} bytes, proto-max-bulk-len is {limit}")
        parts = (packed, payload)
        if header.stored_nbytes < offload.OFFLOAD_FROM:
            value = b"".join(parts)
        else:  # a copy of megabytes (bytes.join lets go of the GIL for it)
            value = await offload.offload(b"".join, parts)
        client, name = self._client(), self._name(key)
        try:
            if len(value) <= _RESEND_MAX:
                await self._once_more(lambda: client.set(name, value))
            else:
                await self._set_large(client, name, value)
        except OutOfMemoryError as exc:
            # At maxmemory with noeviction: writes are refused, reads still served, so
            # not a store down (three such puts in a row marked it so, and back up at
            # the next ping, over and over, every get a miss meanwhile).
            raise StoreFull(f"redis: {exc}") from None
        except ResponseError as exc:
            if "invalid bulk length" not in str(exc).lower():
                raise
            raise self._learned_limit(len(value), exc) from None

    async def _set_large(self, client: Any, name: str, value: bytes) -> None:
        """SET of a value over _RESEND_MAX. Cut off, it is one of: a pooled connection
        that sat idle and was closed, a limit the server did not tell (CONFIG not
        allowed; the query buffer), or a server going away. A ping (a fresh connection
        if need be) rules out the last; the value then goes once more, on a live
        connection, and only a second cut teaches a limit (one idle close must not:
        every chunk is this size, and all would stay local)."""
        try:
            await client.set(name, value)
            return
        except (RedisConnectionError, RuntimeError) as exc:
            if not _closed_by_server(exc):
                raise
            first = exc
        self.disconnects += 1  # as _once_more: a restart looks the same
        try:
            await self._once_more(client.ping)
        except Exception:  # the store's trouble, not the value's
            raise first from None
        try:
            await client.set(name, value)
        except (RedisConnectionError, RuntimeError) as exc:
            if not _closed_by_server(exc):
                raise
            raise self._learned_limit(len(value), exc) from None

    def _learned_limit(self, n: int, exc: BaseException) -> ValueRefused:
        """Values of n bytes and more are not sent again on this connection."""
        self.max_value = min(self.max_value or DEFAULT_MAX_VALUE, n - 1)
        return ValueRefused(f"redis refused a value of {n} bytes ({exc}); larger ones stay local")

    async def get(self, key: ChunkKey) -> Fetched | None:
        name = self._name(key)
        try:
            client = self._client()
            data = await self._once_more(lambda: client.get(name))
        except ResponseError as exc:
            # Another writer's list, hash... under this key's name: one bad value, not
            # a bad store (as a failed request, three such gets marked it down).
            if str(exc).startswith("WRONGTYPE"):
                raise CorruptChunk(f"redis key {name!r} holds no string value") from None
            raise
        if data is None:
            return None
        view = memoryview(data)
        size = VALUE_LAYOUT.size
        return Fetched(VALUE_LAYOUT.parse(view[:size]), view[size:], data)

    async def _each(self, command: str, names: Sequence[str | bytes]) -> list[Any]:
        """command on every name, in one pipeline (a new one if it is sent again)."""
        client = self._client()

        async def send() -> list[Any]:
            pipe = client.pipeline()
            for name in names:
                pipe.execute_command(command, name)
            return await pipe.execute()

        return await self._once_more(send)

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [bool(n) for n in await self._each("EXISTS", [self._name(k) for k in keys])]

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return sum(await self._each("UNLINK", [self._name(k) for k in keys]))

    async def clear(self, namespace_ids: Sequence[str]) -> int:
        client = self._client()
        n = 0
        for ns in namespace_ids:
            pattern = _GLOB.sub(r"\\\1", self.prefix + ns) + "*"
            batch: list[bytes] = []
            async for name in client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= CLEAR_BATCH:
                    n += await self._unlink(batch)
                    batch = []
            if batch:
                n += await self._unlink(batch)
        return n

    async def _unlink(self, names: list[bytes]) -> int:
        return sum(await self._each("UNLINK", names))

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()
