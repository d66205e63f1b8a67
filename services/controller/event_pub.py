"""The external KV-event feed: the workers' admits and evicts, re-published on an XPUB
socket per chunk namespace, with sequence numbers (common/protocol/kv_events.py has
the frames and the rules a subscriber follows).

Cheap when nobody listens: the XPUB tells us which topics are subscribed (one message
when the first subscriber of a topic arrives, one when the last leaves), and while
none is, a change costs a flag and nothing is split, encoded or kept. What went
unpublished then cannot be replayed, so the next message opens a new epoch: a
subscriber from before sees the epoch change and resyncs rather than trusting a seq
stream with a hole nobody can fill.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

import zmq

from kvmesh.common.chunk_holders import WALK_STEP
from kvmesh.common.keys import KEY_STRING
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.router_loop import bind_tcp
from kvmesh.services.controller.event_ring import EventRing
from kvmesh.services.controller.registry import WorkerEntry

log = get_logger(__name__)

# Messages a subscriber may fall behind by before the XPUB drops its (it then sees the
# gap by seq and replays).
SNDHWM = 100_000
# Subscriptions are read when the socket signals them, and after each publish (a send
# may swallow the FD's edge); this timer catches one that arrives while nothing is
# published.
POLL_S = 0.25
_OPS: dict[int, kv.Op] = {1: "stored", 2: "removed"}

Events = Iterable[tuple[int, str, str]]


class EventPublisher:
    """Publish with `events`, `state` and `left` (handlers and housekeeping call them
    after the registry changed); `ring` holds what the replay socket answers from."""

    def __init__(self, metrics: Metrics, *, replay_size: int = 0) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.ring = EventRing(replay_size) if replay_size else None
        self.topics: set[bytes] = set()  # subscribed prefixes (b"" = everything)
        self.port = 0
        self._prev: dict[str, int] = {}  # topic → its newest seq in this epoch
        self._worker_topics: dict[str, set[str]] = {}  # where a worker's events went
        self._missed = False
        self._sock: zmq.Socket | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._published = metrics.counter(
            "controller_events_published_total", "KV-event feed messages published"
        )
        self._epochs = metrics.counter(
            "controller_events_epochs_total", "KV-event feed epochs opened after a silence"
        )
        self._subscribed = metrics.gauge(
            "controller_events_topics", "KV-event feed topics with a subscriber"
        )

    # -- socket -------------------------------------------------------------------------
    def start(
        self, ctx: zmq.Context, host: str, port: int, secure: Callable[[zmq.Socket], None]
    ) -> int:
        """Bind the XPUB (port 0: any free one); `secure` adds CURVE before the bind."""
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # subscriptions are short
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        secure(sock)
        self.port = bind_tcp(sock, host, port)
        self._sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        self._tick()
        return self.port

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.getsockopt(zmq.FD))
            sock.close(linger=0)

    @property
    def listening(self) -> bool:
        return bool(self.topics)

    def _tick(self) -> None:
        self._drain()
        self._timer = asyncio.get_running_loop().call_later(POLL_S, self._tick)

    def _drain(self) -> None:
        """Read (un)subscriptions: b"\\x01" + prefix, b"\\x00" + prefix."""
        sock = self._sock
        if sock is None:
            return
        changed = False
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not msg or msg[0] not in (0, 1):
                continue  # not a subscription: XPUB passes other messages up too
            if msg[0] == 1:
                self.topics.add(msg[1:])
            else:
                self.topics.discard(msg[1:])
            changed = True
        if changed:
            self._subscribed.set(len(self.topics))
            log.info("event feed subscriptions", topics=len(self.topics))

    # -- what the controller calls ------------------------------------------------------
    def events(self, entry: WorkerEntry, events: Events) -> None:
        """A worker's KV event batch, as the registry applied it."""
        if not self.topics:
            self._missed = True
            return
        groups: dict[str, list[kv.KVEvent]] = {}
        match, ops = KEY_STRING.fullmatch, _OPS
        for kind, key, tier in events:
            if not match(key):
                continue  # the registry skipped it too
            ns = key[:16]
            group = groups.get(ns)
            if group is None:
                group = groups[ns] = []
            group.append(kv.KVEvent(ops.get(kind, "removed"), key, tier))
        self._begin()
        now = time.time()
        for ns, evs in groups.items():
            self._publish(
                ns,
                lambda prev, evs=evs: kv.EventBatch(
                    self.epoch, prev, entry.worker_id, entry.instance_id, now, evs
                ),
                len(evs),
            )
            self._worker_topics.setdefault(entry.worker_id, set()).add(ns)
        self._drain()

    def state(self, entry: WorkerEntry, tiers: dict[str, list[str]]) -> Iterator[None]:
        """A worker's full state replaced its chunks: per namespace it has (or had
        events in), its chunks there now. Built WALK_STEP keys a step (a million take
        ~1 s), published after the last: the caller runs the steps to the end, and
        publishes nothing else of this worker's meanwhile."""
        if not self.topics:
            self._missed = True
            return
        groups: dict[str, list[kv.KVEvent]] = {}
        match = KEY_STRING.fullmatch
        for tier, keys in tiers.items():
            for start in range(0, len(keys), WALK_STEP):
                for key in keys[start : start + WALK_STEP]:
                    if match(key):
                        groups.setdefault(key[:16], []).append(kv.KVEvent("stored", key, tier))
                yield
        topics = self._topics_of(entry) | groups.keys()
        self._worker_topics[entry.worker_id] = set(topics)
        self._begin()
        now = time.time()
        for ns in sorted(topics):
            evs = groups.get(ns, [])
            self._publish(
                ns,
                lambda prev, evs=evs: kv.WorkerState(
                    self.epoch, prev, entry.worker_id, entry.instance_id, now, evs
                ),
                len(evs),
            )
        self._drain()

    def left(self, entry: WorkerEntry, reason: str) -> None:
        """A worker deregistered or was dropped, its chunks with it."""
        topics = self._topics_of(entry)
        self._worker_topics.pop(entry.worker_id, None)
        if not self.topics:
            self._missed = True
            return
        self._begin()
        now = time.time()
        why = "dropped" if reason == "dropped" else "deregistered"
        for ns in sorted(topics):
            self._publish(
                ns,
                lambda prev: kv.WorkerLeft(
                    self.epoch, prev, entry.worker_id, entry.instance_id, now, why
                ),
                1,
            )
        self._drain()

    # -- publishing ---------------------------------------------------------------------
    def _topics_of(self, entry: WorkerEntry) -> set[str]:
        return {ns for ns in entry.namespaces if kv.is_topic(ns)} | self._worker_topics.get(
            entry.worker_id, set()
        )

    def _begin(self) -> None:
        """Before publishing: a new epoch if changes went unpublished after this one
        published something (before that, nobody can hold a seq of it)."""
        if self._missed and self.seq:
            self.epoch = uuid.uuid4().hex
            self.seq = 0
            self._prev.clear()
            if self.ring is not None:
                self.ring.clear()
            self._epochs.inc()
            log.info("event feed: new epoch after unpublished changes", epoch=self.epoch)
        self._missed = False

    def _publish(self, topic: str, build: Callable[[int], kv.Payload], events: int) -> None:
        seq = self.seq + 1
        payload = kv.encode_payload(build(self._prev.get(topic, 0)))
        self.seq = self._prev[topic] = seq
        if self.ring is not None:
            self.ring.add(seq, topic, payload, events)
        sock = self._sock
        if sock is None:
            return
        try:
            # XPUB never blocks: a subscriber past its HWM loses this one and replays.
            sock.send_multipart([topic.encode(), kv.encode_seq(seq), payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("event not published", error=str(exc))
            return
        self._published.inc()
