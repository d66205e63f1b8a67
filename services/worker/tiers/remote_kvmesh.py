"""`kvmesh://host:port`: the cache-server, through its asyncio client.

The chunk header rides in the value's meta and the payload is the value itself, so
neither side copies the payload into a bigger buffer. Gets go over the server's data
connections when it offers them (`get_into`: the payload is received straight into the
L1 buffer), else over ZMQ, where a large value arrives in parts, which the reader
copies straight into its L1 buffer. Keys are `key_prefix +
ChunkKey.to_str()`. The client notices a lost connection at once (socket monitor),
which the tier's health monitor reads through `connected()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.common.chunk_codec import VALUE_LAYOUT, ChunkHeader
from kvmesh.common.keys import ChunkKey
from kvmesh.common.transport.cacheserver_client import CacheServerClient, ValueTooLargeError
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.common.transport.tcp_address import cacheserver_endpoint
from kvmesh.services.worker.tiers.remote_connector import Fetched, ValueRefused

CLEAR_PAGE = 1000
# Values above this come in parts (see the protocol): a 32 MiB chunk received as one
# frame costs a fresh mapping and 8192 page faults per get with glibc's defaults;
# 8 MiB parts are reused heap memory after the first (benchmarks.remote: 32 MiB gets
# ~1.5x faster).
VALUE_PART_BYTES = 8 << 20
# Data connections (common/protocol/cacheserver_data.py): one per get in flight; a
# retrieve issues one get per chunk of its prefix.
DATA_CONNECTIONS = 8


class KvmeshConnector:
    scheme = "kvmesh"
    compresses = True

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvmesh:",
        timeout_s: float = 1.0,
        curve: CurveKeys | None = None,
    ) -> None:
        self.curve = curve
        self.endpoint = cacheserver_endpoint(url)
        self._url = url
        self.prefix = key_prefix
        self.timeout_s = timeout_s
        self.client: CacheServerClient | None = None

    @property
    def display(self) -> str:
        return self._url

    def _name(self, key: ChunkKey) -> str:
        return self.prefix + key.to_str()

    def _client(self) -> CacheServerClient:
        if self.client is None:
            raise ConnectionError("not connected")
        return self.client

    def connected(self) -> bool | None:
        return self.client is not None and self.client.connected

    @property
    def disconnects(self) -> int:
        """Connections to the server lost: it may have restarted since the last one."""
        return self.client.disconnects if self.client is not None else 0

    async def reconnect(self) -> None:
        if self.client is None:
            self.client = CacheServerClient(
                self.endpoint,
                timeout_s=self.timeout_s,
                curve=self.curve,
                value_part_bytes=VALUE_PART_BYTES,
                data_connections=DATA_CONNECTIONS,
            )
            await self.client.connect()
        else:
            await self.client.reconnect()

    async def ping(self) -> None:
        await self._client().health()

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        try:
            # The client refuses a value over the server's limit without sending it.
            await self._client().put(self._name(key), payload, packed)
        except ValueTooLargeError as exc:
            raise ValueRefused(str(exc)) from None

    async def get(self, key: ChunkKey) -> Fetched | None:
        value = await self._client().get(self._name(key))
        if value is None:
            return None
        return Fetched(VALUE_LAYOUT.parse(value.meta), value.data, value)

    async def get_into(
        self, key: ChunkKey, place: Callable[[ChunkHeader, int], memoryview | None]
    ) -> Fetched | None:
        """A get whose payload lands in place(header, nbytes)'s buffer when the value
        comes over a data connection; over ZMQ, place is not called."""
        headers: list[ChunkHeader] = []

        def on_meta(meta: bytes, nbytes: int) -> memoryview | None:
            headers.append(VALUE_LAYOUT.parse(meta))
            return place(headers[0], nbytes)

        value = await self._client().get_into(self._name(key), on_meta)
        if value is None:
            return None
        header = headers[0] if headers else VALUE_LAYOUT.parse(value.meta)
        return Fetched(header, value.data, value)

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self._client().exists_many([self._name(k) for k in keys])

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return sum(await self._client().delete_many([self._name(k) for k in keys]))

    async def clear(self, namespace_ids: Sequence[str]) -> int:
        client = self._client()
        n = 0
        for ns in namespace_ids:
            batch: list[str] = []
            async for name in client.list_keys(self.prefix + ns, CLEAR_PAGE):
                batch.append(name)
                if len(batch) >= CLEAR_PAGE:
                    n += sum(await client.delete_many(batch))
                    batch = []
            if batch:
                n += sum(await client.delete_many(batch))
        return n

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
