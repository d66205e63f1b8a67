"""The KV-event feed's replay ring: bounded by events, answers in order, and says "too
old" exactly when a message the answer needs is gone."""

from __future__ import annotations

import pytest

from kvmesh.services.controller.event_ring import EventRing, TooOld

A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


def seqs(kept) -> list[int]:
    return [k.seq for k in kept]


def test_answers_what_came_after_since_in_order() -> None:
    ring = EventRing(100)
    for seq, topic in enumerate([A, B, A, A, B], start=1):
        ring.add(seq, topic, f"p{seq}".encode(), 3)
    assert seqs(ring.since(0)) == [1, 2, 3, 4, 5]
    assert seqs(ring.since(3)) == [4, 5]
    assert seqs(ring.since(5)) == []
    assert seqs(ring.since(1, [A])) == [3, 4]
    assert seqs(ring.since(0, [B])) == [2, 5]
    assert [k.payload for k in ring.since(4)] == [b"p5"]


def test_bounded_by_events_and_too_old_after_the_oldest_went() -> None:
    ring = EventRing(10)
    for seq in range(1, 6):
        ring.add(seq, A, b"x", 3)  # 15 events offered, 10 kept at most
    assert ring.total == 9 and seqs(ring.since(2)) == [3, 4, 5]
    for since in (0, 1):
        with pytest.raises(TooOld):
            ring.since(since)
    with pytest.raises(TooOld):
        ring.since(1, [A])


def test_a_quiet_topic_still_replays_after_the_ring_turned_over() -> None:
    ring = EventRing(4)
    ring.add(1, B, b"b", 1)
    for seq in range(2, 8):
        ring.add(seq, A, b"a", 1)  # B's message is pushed out at seq 5
    # Nothing of B after seq 1 was dropped: an empty answer, not "too old".
    assert seqs(ring.since(1, [B])) == []
    with pytest.raises(TooOld):
        ring.since(0, [B])  # B's seq 1 is gone
    with pytest.raises(TooOld):
        ring.since(1)  # every topic: A's 2 and 3 are gone
    assert seqs(ring.since(3, [A])) == [4, 5, 6, 7]


def test_a_message_larger_than_the_ring_is_not_kept() -> None:
    ring = EventRing(5)
    ring.add(1, A, b"small", 2)
    ring.add(2, A, b"huge", 6)
    assert len(ring) == 1  # seq 1 stays...
    for since in (0, 1):
        with pytest.raises(TooOld):
            ring.since(since)  # ...but an answer holding seq 2 cannot be given
    ring.add(3, B, b"next", 1)
    assert seqs(ring.since(2)) == [3]


def test_empty_messages_cost_one_and_clear_starts_over() -> None:
    ring = EventRing(3)
    for seq in range(1, 5):
        ring.add(seq, A, b"", 0)
    assert len(ring) == 3 and ring.total == 3
    with pytest.raises(ValueError):
        ring.add(4, A, b"", 1)  # seqs only grow
    ring.clear()
    assert len(ring) == 0 and ring.since(0) == []
    ring.add(1, A, b"again", 1)
    assert seqs(ring.since(0)) == [1]
    with pytest.raises(ValueError):
        EventRing(0)
