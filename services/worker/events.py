"""A bounded buffer of KV events (a chunk stored in or removed from a tier).

Consumers (the vLLM scheduler's KV events, the controller client) drain it; when
nobody drains it, the oldest events are dropped and counted rather than growing
memory without bound.
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


class KVEventBuffer:
    """Thread-safe ring of events, each with a per-buffer sequence number."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0

    def record(self, kind: KVEventKind, key: str, tier: str) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._seq += 1
            self._events.append(KVEvent(kind, key, tier, self._seq, time.time()))

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
