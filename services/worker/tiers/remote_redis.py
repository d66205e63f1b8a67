"""`redis://`, `rediss://` and `redis-cluster://`: Redis through redis-py's asyncio clients.

A value is one Redis string: the 144-byte chunk header (`VALUE_LAYOUT`), then the
payload. Keys are `key_prefix + ChunkKey.to_str()`; in a cluster they spread over slots
by their hash (no hash tags), and a batch of EXISTS goes out as one pipeline per node
(single-key commands only, so no command ever spans two slots).

redis-py's own retries are turned off (the tier's deadline and health monitor decide
what a failure means), and any error in the middle of a reply drops that connection
rather than reusing it (redis-py's behaviour). Redis has no memory bound of its own
unless configured: run it with `maxmemory` and `maxmemory-policy allkeys-lru`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError

from kvmesh.common import offload
from kvmesh.common.chunk_codec import VALUE_LAYOUT, ChunkHeader
from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.tiers.remote_connector import Fetched, StoreFull, host_ports, redact

DEFAULT_PORT = 6379
CLEAR_BATCH = 500
_GLOB = re.compile(r"([*?\[\]\\])")


class RedisConnector:
    compresses = True

    def __init__(self, url: str, *, key_prefix: str = "kvmesh:", timeout_s: float = 1.0) -> None:
        self.scheme = url.partition("://")[0].lower()
        self._url = url
        self.prefix = key_prefix
        self.timeout_s = timeout_s
        self.client: Any = None
        if self.scheme == "redis-cluster":
            netloc = url.partition("://")[2].split("/", 1)[0]
            creds, _, hosts = netloc.rpartition("@")
            user, _, password = creds.partition(":")
            self._nodes = host_ports(hosts, DEFAULT_PORT)
            self._auth = {"username": unquote(user) or None, "password": unquote(password) or None}

    @property
    def display(self) -> str:
        return redact(self._url)

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

    async def ping(self) -> None:
        await self._client().ping()

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        parts = (packed, payload)
        if header.stored_nbytes < offload.OFFLOAD_FROM:
            value = b"".join(parts)
        else:  # a copy of megabytes (bytes.join lets go of the GIL for it)
            value = await offload.offload(b"".join, parts)
        try:
            await self._client().set(self._name(key), value)
        except OutOfMemoryError as exc:
            # At maxmemory with noeviction: writes are refused, reads still served, so
            # not a store down (three such puts in a row marked it so, and back up at
            # the next ping, over and over, every get a miss meanwhile).
            raise StoreFull(f"redis: {exc}") from None

    async def get(self, key: ChunkKey) -> Fetched | None:
        data = await self._client().get(self._name(key))
        if data is None:
            return None
        view = memoryview(data)
        size = VALUE_LAYOUT.size
        return Fetched(VALUE_LAYOUT.parse(view[:size]), view[size:], data)

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        pipe = self._client().pipeline()
        for key in keys:
            pipe.execute_command("EXISTS", self._name(key))
        return [bool(n) for n in await pipe.execute()]

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        pipe = self._client().pipeline()
        for key in keys:
            pipe.execute_command("UNLINK", self._name(key))
        return sum(await pipe.execute())

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
        pipe = self._client().pipeline()
        for name in names:
            pipe.execute_command("UNLINK", name)
        return sum(await pipe.execute())

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()
