"""The engine's KV events (a chunk stored in or removed from a tier) as vLLM KV events.

Workers report `BlockStored` / `BlockRemoved` with one kvmesh chunk per event: the
block hash is the 16-byte chunk hash (the same on every rank, so vLLM's aggregation
across workers keeps an event only when every rank reported it), the block size is
the chunk size, the medium is CPU for L1 and STORAGE below it, and `ownership` names
the tier ("kvmesh:l1", "kvmesh:disk", ...). Token ids and the parent hash are filled
in for chunks this worker saved recently; events of other chunks (promotions from a
lower tier, evictions) carry the hash only.

Chunks of a per-request tenant (a request's kvmesh `tenant`, or its vLLM `cache_salt`)
are not published: their chunk hash is the same as every other tenant's copy of the
prompt, so a router reading the feed would merge tenants, and could tell one tenant
that another had cached a prompt. Only the engine's own namespace is published.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)

from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.events import KVEvent, KVEventKind

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine
    from kvmesh.services.worker.vllm.metadata import SaveOp


class KvmeshKVEvents(KVConnectorKVEvents):
    """Events of one or more workers, as vLLM's executor merges them."""

    def __init__(self, num_workers: int) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KvmeshKVEvents:
        """Keep the events every worker reported (a chunk is usable only if every
        rank holds its share)."""
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


class EventTranslator:
    """Turns engine events into vLLM events, remembering the tokens of saved chunks."""

    def __init__(self, chunk_size: int, capacity: int = 8192) -> None:
        self.chunk_size = chunk_size
        self._capacity = capacity
        self._known: OrderedDict[str, tuple[list[int], bytes | None]] = OrderedDict()

    def remember(self, engine: KVEngine, op: SaveOp) -> None:
        tokens = op.tokens.tolist()
        prev: bytes | None = None
        if op.tenant:
            return  # never published (translate)
        for start, end, key in engine.chunks(op.tokens, tenant=op.tenant):
            if start >= op.skip:
                self._known[key.to_str()] = (tokens[start:end], prev)
                self._known.move_to_end(key.to_str())
            prev = key.chunk_hash
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)

    def translate(self, events: list[KVEvent], namespace_id: str) -> list[KVCacheEvent]:
        """vLLM's events for the engine's events of chunks in namespace_id (the
        engine's own); events of other namespaces (tenants') are dropped."""
        out: list[KVCacheEvent] = []
        for ev in events:
            try:
                key = ChunkKey.from_str(ev.key)
            except ValueError:
                continue
            if key.namespace_id != namespace_id:
                continue
            chunk_hash = key.chunk_hash
            medium = MEDIUM_CPU if ev.tier == "l1" else MEDIUM_STORAGE
            owner = f"kvmesh:{ev.tier}"
            if ev.kind == KVEventKind.STORED:
                tokens, parent = self._known.get(ev.key, ([], None))
                out.append(
                    BlockStored(
                        block_hashes=[chunk_hash],
                        parent_block_hash=parent,
                        token_ids=tokens,
                        block_size=self.chunk_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        ownership=owner,
                    )
                )
            elif ev.kind == KVEventKind.REMOVED:
                out.append(BlockRemoved(block_hashes=[chunk_hash], medium=medium, ownership=owner))
        return out
