"""The registry's changes, pushed to index subscribers (the lookup-servers' copies).

Subscribers are ROUTER peers: a subscription travels on the connection the
lookup-server already has (no second port to bind, expose and secure), and the
snapshot reply and the pushes after it share that one ordered connection, so a
subscriber never misses what happened between its snapshot and its first push.

Each push carries the feed's `epoch` (new at every controller start) and the next
`seq`. The ROUTER drops what a subscriber too far behind cannot take (its HWM); the
subscriber finds out from the next `IndexTick`, which answers its ping behind every
push it counts, and subscribes again. A subscriber that stops pinging is forgotten
after `timeout_s`. With no subscriber the registry builds no runs and nothing is
encoded: an unfollowed controller pays nothing for the feed.

A snapshot is packed a step at a time (a million chunks take 0.1-0.4 s) while the
controller goes on serving and changing the registry. It carries the seq of its
first step; the pushes made meanwhile wait for the new subscriber in its own queue and
go out right behind the snapshot. A worker packed late already shows some of them:
applying them again is harmless, since each is an admit, evict, join, leave or full
replacement that the state after it no longer depends on how many times it ran.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvmesh.common.chunk_holders import pack_ints
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.services.controller.registry import PackedWorker, Registry, Run, WorkerEntry
from kvmesh.services.controller.stats import ControllerStats

log = get_logger(__name__)


class IndexFeed:
    """The registry's sink: turns changes into pushes, and answers subscribe and ping."""

    def __init__(
        self,
        registry: Registry,
        send: Callable[[bytes, Any], bool],
        stats: ControllerStats,
        *,
        max_subscribers: int,
        timeout_s: float,
    ) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.subscribers: dict[bytes, float] = {}  # peer → last ping (monotonic)
        # peer → pushes held back while its snapshot is packed
        self._waiting: dict[bytes, list[Any]] = {}
        self._registry = registry
        self._send = send
        self._stats = stats
        self._max = max_subscribers
        self._timeout_s = timeout_s
        registry.sink = self

    @property
    def active(self) -> bool:
        return bool(self.subscribers)

    # -- requests -------------------------------------------------------------------------
    def subscribe(self, peer: bytes, msg: proto.IndexSubscribe) -> Any:
        if peer not in self.subscribers and len(self.subscribers) >= self._max:
            return proto.error_reply(
                msg.rid, ErrorCode.SHUTTING_DOWN, f"{self._max} index subscribers already"
            )
        if peer in self._waiting:
            # Each snapshot copies the whole registry: one at a time per peer.
            return proto.error_reply(
                msg.rid, ErrorCode.SHUTTING_DOWN, "a snapshot is being packed for you: retry"
            )
        self.subscribers[peer] = time.monotonic()
        self._stats.index_subscribers.set(len(self.subscribers))
        self._stats.index_snapshots.inc()
        self._waiting[peer] = queue = []
        return self._snapshot(peer, msg.rid, self.seq, queue)

    async def _snapshot(self, peer: bytes, rid: int, seq: int, queue: list[Any]) -> Any:
        parts: list[PackedWorker] = []
        try:
            for _ in self._registry.pack_workers(parts):
                await asyncio.sleep(0)
        except BaseException:
            if self._waiting.get(peer) is queue:
                del self._waiting[peer]
                self.subscribers.pop(peer, None)
                self._stats.index_subscribers.set(len(self.subscribers))
            raise
        del self._waiting[peer]
        workers = [proto.IndexWorkerState(_worker(e), tiers) for e, _, tiers in parts]
        self._send(peer, proto.IndexSnapshotReply(rid, self.epoch, seq, workers))
        for msg in queue:
            self._send(peer, msg)
        return None  # answered above, the held pushes right behind

    def ping(self, peer: bytes, msg: proto.IndexPing) -> Any:
        if msg.epoch != self.epoch or peer not in self.subscribers:
            return proto.error_reply(
                msg.rid, ErrorCode.NOT_SUBSCRIBED, "not subscribed to this controller: subscribe"
            )
        self.subscribers[peer] = time.monotonic()
        return proto.IndexTick(msg.rid, self.epoch, self.seq)

    def expire(self, now: float) -> None:
        gone = [
            p
            for p, t in self.subscribers.items()
            if now - t > self._timeout_s and p not in self._waiting
        ]
        for peer in gone:
            del self.subscribers[peer]
            log.info("index subscriber dropped: no ping", peer=peer.hex())
        if gone:
            self._stats.index_subscribers.set(len(self.subscribers))

    # -- the registry's sink --------------------------------------------------------------
    def joined(self, entry: WorkerEntry) -> None:
        if self.subscribers:
            self._push(proto.WorkerJoined(0, self.epoch, self.seq + 1, _worker(entry)))

    def left(self, worker_id: str) -> None:
        if self.subscribers:
            self._push(proto.WorkerLeft(0, self.epoch, self.seq + 1, worker_id))

    def replaced(self, entry: WorkerEntry, tiers: dict[str, bytes]) -> None:
        if self.subscribers:
            self._push(proto.WorkerReplaced(0, self.epoch, self.seq + 1, entry.worker_id, tiers))

    def events(self, entry: WorkerEntry, runs: list[Run]) -> None:
        if self.subscribers:
            packed = [(kind, tier, pack_ints(ints)) for kind, tier, ints in runs]
            self._push(proto.IndexEvents(0, self.epoch, self.seq + 1, entry.worker_id, packed))

    def _push(self, msg: Any) -> None:
        self.seq += 1
        self._stats.index_pushes.inc()
        for peer in self.subscribers:
            queue = self._waiting.get(peer)
            if queue is None:
                self._send(peer, msg)
            else:
                queue.append(msg)


def _worker(e: WorkerEntry) -> proto.IndexWorker:
    return proto.IndexWorker(
        e.worker_id,
        e.instance_id,
        e.rank,
        e.world_size,
        list(e.namespaces),
        e.p2p_endpoint,
        e.lookup_endpoint,
    )
