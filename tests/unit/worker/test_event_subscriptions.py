"""KVEventBuffer subscriptions: every consumer sees every event, independently of the
others and of `drain()`, and one that falls behind loses only its own oldest events."""

from __future__ import annotations

from kvmesh.services.worker.events import KVEventBuffer, KVEventKind


def test_subscribers_and_drain_each_see_every_event() -> None:
    buf = KVEventBuffer(capacity=100)
    early = buf.record(KVEventKind.STORED, "k0", "l1")  # before anyone subscribed
    a, b = buf.subscribe("a"), buf.subscribe("b")
    buf.record(KVEventKind.STORED, "k1", "l1")
    buf.record(KVEventKind.REMOVED, "k1", "l1")
    assert early is None
    assert [e.key for e in buf.drain()] == ["k0", "k1", "k1"]
    assert [(e.kind, e.seq) for e in a.drain()] == [
        (KVEventKind.STORED, 2),
        (KVEventKind.REMOVED, 3),
    ]
    assert [e.seq for e in b.drain(1)] == [2]  # b is not affected by a or drain()
    assert [e.seq for e in b.drain()] == [3] and b.drain() == [] and a.drain() == []
    buf.unsubscribe(a)
    buf.record(KVEventKind.STORED, "k2", "l1")
    assert a.drain() == [] and [e.key for e in b.drain()] == ["k2"]


def test_a_slow_subscriber_loses_its_oldest_events_only() -> None:
    buf = KVEventBuffer(capacity=100)
    slow = buf.subscribe("slow", capacity=3)
    fast = buf.subscribe("fast")
    for i in range(5):
        buf.record(KVEventKind.STORED, f"k{i}", "l1")
    assert slow.dropped == 2 and [e.key for e in slow.drain()] == ["k2", "k3", "k4"]
    assert fast.dropped == 0 and len(fast.drain()) == 5
    assert buf.dropped == 0 and len(buf) == 5
