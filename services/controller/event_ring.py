"""The last published KV-event messages, kept for the replay socket.

Bounded by events, not messages: a message costs its event count (at least 1), and
the oldest go until the total fits `size`. A message larger than the whole ring is
not kept at all (it counts as dropped at once).

A replay of a topic is possible while no message of that topic newer than since_seq
has been dropped: `dropped[topic]` is the newest seq dropped per topic, so a topic that
was quiet while the ring turned over still replays (empty) instead of "too old".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass


class TooOld(Exception):
    """A message the replay needs is no longer kept."""


@dataclass(frozen=True, slots=True)
class Kept:
    seq: int
    topic: str
    payload: bytes
    cost: int


class EventRing:
    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("size must be > 0")
        self.size = size
        self.total = 0
        self.last_seq = 0
        self._kept: deque[Kept] = deque()
        self._dropped: dict[str, int] = {}  # topic → newest seq dropped
        self._dropped_any = 0  # newest seq dropped, any topic

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        """Forget everything (a new epoch: seqs start again)."""
        self._kept.clear()
        self._dropped.clear()
        self.total = self.last_seq = self._dropped_any = 0

    def add(self, seq: int, topic: str, payload: bytes, events: int) -> None:
        """Keep a message; seqs must grow."""
        if seq <= self.last_seq:
            raise ValueError(f"seq {seq} after {self.last_seq}")
        self.last_seq = seq
        cost = max(events, 1)
        if cost > self.size:
            self._drop(seq, topic)
            return
        self._kept.append(Kept(seq, topic, payload, cost))
        self.total += cost
        while self.total > self.size:
            old = self._kept.popleft()
            self.total -= old.cost
            self._drop(old.seq, old.topic)

    def _drop(self, seq: int, topic: str) -> None:
        self._dropped[topic] = seq
        self._dropped_any = seq

    def since(self, since_seq: int, topics: Collection[str] = ()) -> list[Kept]:
        """The kept messages after since_seq (of `topics`; empty: all), oldest first;
        TooOld when one of them is no longer kept."""
        if topics:
            newest_dropped = max((self._dropped.get(t, 0) for t in topics), default=0)
        else:
            newest_dropped = self._dropped_any
        if newest_dropped > since_seq:
            raise TooOld(f"messages after seq {since_seq} are gone (up to {newest_dropped})")
        if since_seq >= self.last_seq:
            return []
        kept = self._kept
        # Seqs grow along the deque: skip the older part without looking at it.
        start = _first_after(kept, since_seq)
        wanted = set(topics)
        out = []
        for i in range(start, len(kept)):
            k = kept[i]
            if not wanted or k.topic in wanted:
                out.append(k)
        return out


def _first_after(kept: deque[Kept], seq: int) -> int:
    lo, hi = 0, len(kept)
    while lo < hi:
        mid = (lo + hi) // 2
        if kept[mid].seq <= seq:
            lo = mid + 1
        else:
            hi = mid
    return lo
