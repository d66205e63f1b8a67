"""`memkv://name`: a remote store kept in this process, shared by every connector of the
same name (two engines of one test process see one store)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.common.chunk_codec import ChunkHeader
from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.tiers.remote_connector import Fetched

STORES: dict[str, dict[str, tuple[ChunkHeader, bytes]]] = {}


class MemKvConnector:
    scheme = "memkv"
    compresses = True

    def __init__(self, url: str, *, key_prefix: str, timeout_s: float) -> None:
        _, sep, name = url.partition("://")
        if not sep or not name:
            raise ValueError(f"memkv needs memkv://<store name>, got {url!r}")
        self.url = url
        self.prefix = key_prefix
        self.store = STORES.setdefault(name, {})
        self.up = True

    @property
    def display(self) -> str:
        return self.url

    async def reconnect(self) -> None:
        pass

    async def ping(self) -> None:
        if not self.up:
            raise ConnectionError("memkv store marked down")

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        self.store[self.prefix + key.to_str()] = (header, bytes(payload))

    async def get(self, key: ChunkKey) -> Fetched | None:
        found = self.store.get(self.prefix + key.to_str())
        return None if found is None else Fetched(found[0], memoryview(found[1]))

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.prefix + k.to_str() in self.store for k in keys]

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.store.pop(self.prefix + k.to_str(), None) is not None for k in keys)

    async def clear(self, namespace_ids: Sequence[str]) -> int:
        names = [
            n for n in self.store if any(n.startswith(self.prefix + ns) for ns in namespace_ids)
        ]
        for n in names:
            del self.store[n]
        return len(names)

    def connected(self) -> bool | None:
        return self.up

    async def close(self) -> None:
        pass


def make_connector(url: str, *, key_prefix: str, timeout_s: float) -> MemKvConnector:
    return MemKvConnector(url, key_prefix=key_prefix, timeout_s=timeout_s)
