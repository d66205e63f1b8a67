"""The feed subscriber's bookkeeping without sockets (no replay socket: every gap is
reported as Lost): seq and prev_seq per topic, copies dropped, epochs."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.kv_events_client import Delivery, KvEventsSubscriber

A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


def frame(seq: int, topic: str, prev: int, epoch: str = "e1") -> list[bytes]:
    payload = kv.EventBatch(epoch, prev, "w/0", "w", 0.0, [])
    return [topic.encode(), kv.encode_seq(seq), kv.encode_payload(payload)]


def feed(frames: list[list[bytes]], since: int | None = None) -> list:
    async def main() -> list:
        sub = KvEventsSubscriber("tcp://127.0.0.1:1", since=None, namespaces=())
        sub.tracker.floor = since
        out: list = []
        try:
            for f in frames:
                out += await sub.accept(f)
        finally:
            await sub.close()
        return out

    return asyncio.run(main())


def summary(items: list) -> list:
    return [
        (i.seq, i.topic) if isinstance(i, Delivery) else ("lost", i.topics, i.after_seq)
        for i in items
    ]


def test_an_unbroken_stream_passes_and_copies_are_dropped() -> None:
    frames = [frame(1, A, 0), frame(2, B, 0), frame(3, A, 1), frame(3, A, 1), frame(4, B, 2)]
    assert summary(feed(frames)) == [(1, A), (2, B), (3, A), (4, B)]


def test_a_filtered_subscriber_sees_no_gap_in_other_topics_seqs() -> None:
    # Subscribed to A only: seqs 2 and 4 (B's) never arrive, and that is no gap.
    assert summary(feed([frame(1, A, 0), frame(3, A, 1), frame(5, A, 3)])) == [
        (1, A),
        (3, A),
        (5, A),
    ]


def test_a_missing_message_of_a_topic_is_a_gap() -> None:
    out = feed([frame(1, A, 0), frame(2, B, 0), frame(4, A, 3)])  # A's seq 3 missed
    assert summary(out) == [(1, A), (2, B), ("lost", (A,), 1), (4, A)]
    lost = out[2]
    assert lost.reason == "gap and no replay socket" and lost.before_seq == 4


def test_the_first_message_sets_the_start_unless_since_does() -> None:
    # Joining mid-stream: what came before the first message received is not ours.
    assert summary(feed([frame(7, A, 5), frame(8, B, 6)])) == [(7, A), (8, B)]
    # With since=4: B's prev_seq 6 is after 4 and was never seen: a gap.
    assert summary(feed([frame(7, A, 5), frame(8, B, 6)], since=4)) == [
        ("lost", (A,), 4),
        (7, A),
        ("lost", (B,), 4),
        (8, B),
    ]


def test_a_new_epoch_voids_everything_and_starts_over() -> None:
    out = feed([frame(1, A, 0), frame(2, A, 1), frame(1, A, 0, "e2"), frame(2, B, 0, "e2")])
    assert summary(out) == [(1, A), (2, A), ("lost", (), 0), (1, A), (2, B)]
    assert out[2].reason == "controller epoch changed" and out[2].epoch == "e2"


def test_malformed_messages_are_counted_and_skipped() -> None:
    async def main() -> None:
        sub = KvEventsSubscriber("tcp://127.0.0.1:1")
        try:
            for bad in ([b"x"], [b"t", b"\x00", b"p"], [A.encode(), kv.encode_seq(1), b"\xc1"]):
                assert await sub.accept(bad) == []
            assert sub.malformed == 3
            assert len(await sub.accept(frame(1, A, 0))) == 1
        finally:
            await sub.close()

    asyncio.run(main())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="16 lower-case hex"):
        KvEventsSubscriber("tcp://127.0.0.1:1", namespaces=["ABC"])
    with pytest.raises(ValueError, match="since"):
        KvEventsSubscriber("tcp://127.0.0.1:1", since=-1)
