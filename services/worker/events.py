"""A bounded buffer of KV events (a chunk stored in or removed from a tier).

The vLLM connector drains the buffer itself (`drain()`, consume-once); any other
consumer (the controller client) takes a `subscribe()`d view that sees every event
recorded after it subscribed, independently of the others. When a consumer falls
behind, its oldest events are dropped and counted rather than growing memory without
bound.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque

import msgspec


class KVEventKind(enum.IntEnum):
    STORED = 1
    REMOVED = 2


class KVEvent(msgspec.Struct, frozen=True, array_like=True, gc=False):
    kind: KVEventKind
    key: str
    tier: str
    seq: int
    ts: float


class EventSubscription:
    """One consumer's own queue of the buffer's events; `drain()` takes from it alone."""

    def __init__(self, name: str, capacity: int, lock: threading.Lock) -> None:
        self.name = name
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._lock = lock
        self.dropped = 0  # events lost because this consumer fell behind

    def _append(self, event: KVEvent) -> None:  # under the buffer's lock
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)

    def drain(self, max_events: int | None = None) -> list[KVEvent]:
        with self._lock:
            n = len(self._events) if max_events is None else min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._events)


class KVEventBuffer:
    """Thread-safe ring of events, each with a per-buffer sequence number."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0
        self._subs: list[EventSubscription] = []

    def record(self, kind: KVEventKind, key: str, tier: str) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._seq += 1
            event = KVEvent(kind, key, tier, self._seq, time.time())
            self._events.append(event)
            for sub in self._subs:
                sub._append(event)

    def record_many(self, kind: KVEventKind, keys: list[str], tier: str) -> None:
        """`record` of each key in order, under one lock and with one timestamp."""
        if not keys:
            return
        ts = time.time()
        events = self._events
        subs = self._subs
        with self._lock:
            for key in keys:
                if len(events) == events.maxlen:
                    self.dropped += 1
                self._seq += 1
                event = KVEvent(kind, key, tier, self._seq, ts)
                events.append(event)
                for sub in subs:
                    sub._append(event)

    def subscribe(self, name: str, capacity: int | None = None) -> EventSubscription:
        """A new consumer that sees every event recorded from now on."""
        with self._lock:
            sub = EventSubscription(name, capacity or self._events.maxlen or 100_000, self._lock)
            self._subs.append(sub)
            return sub

    def unsubscribe(self, sub: EventSubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def drain(self, max_events: int | None = None) -> list[KVEvent]:
        """Take (and remove) up to max_events of the oldest events."""
        with self._lock:
            n = len(self._events) if max_events is None else min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(n)]

    @property
    def last_seq(self) -> int:
        return self._seq

    def __len__(self) -> int:
        return len(self._events)
