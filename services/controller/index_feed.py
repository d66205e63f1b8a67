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
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from kvmesh.common.chunk_holders import pack_ints
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.services.controller.registry import Registry, Run, WorkerEntry
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
        self.subscribers[peer] = time.monotonic()
        self._stats.index_subscribers.set(len(self.subscribers))
        self._stats.index_snapshots.inc()
        workers = [
            proto.IndexWorkerState(_worker(e), {t: pack_ints(keys) for t, keys in e.tiers.items()})
            for e in self._registry.workers.values()
        ]
        return proto.IndexSnapshotReply(msg.rid, self.epoch, self.seq, workers)

    def ping(self, peer: bytes, msg: proto.IndexPing) -> Any:
        if msg.epoch != self.epoch or peer not in self.subscribers:
            return proto.error_reply(
                msg.rid, ErrorCode.NOT_SUBSCRIBED, "not subscribed to this controller: subscribe"
            )
        self.subscribers[peer] = time.monotonic()
        return proto.IndexTick(msg.rid, self.epoch, self.seq)

    def expire(self, now: float) -> None:
        gone = [p for p, t in self.subscribers.items() if now - t > self._timeout_s]
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

    def replaced(self, entry: WorkerEntry) -> None:
        if self.subscribers:
            tiers = {t: pack_ints(keys) for t, keys in entry.tiers.items()}
            self._push(proto.WorkerReplaced(0, self.epoch, self.seq + 1, entry.worker_id, tiers))

    def events(self, entry: WorkerEntry, runs: list[Run]) -> None:
        if self.subscribers:
            packed = [(kind, tier, pack_ints(ints)) for kind, tier, ints in runs]
            self._push(proto.IndexEvents(0, self.epoch, self.seq + 1, entry.worker_id, packed))

    def _push(self, msg: Any) -> None:
        self.seq += 1
        self._stats.index_pushes.inc()
        for peer in self.subscribers:
            self._send(peer, msg)


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
