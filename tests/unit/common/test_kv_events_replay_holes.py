"""A replayed message that does not decode is a hole the subscriber reports (Lost),
not one it skips: against a stand-in replay socket on a real ROUTER."""

from __future__ import annotations

import threading

import zmq

from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.kv_events_client import Delivery, KvEventsSubscriber, Lost

TOPIC = "0123456789abcdef"


def payload(prev: int) -> bytes:
    event = kv.KVEvent("stored", TOPIC + "-" + "0" * 32, "l1")
    return kv.encode_payload(kv.EventBatch("E", prev, "i/0", "i", 0.0, [event]))


async def test_an_undecodable_replayed_message_is_lost_in_order() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            peer, raw = router.recv_multipart()
            req = kv.decode_request(raw)
            entries = [
                kv.ReplayEntry(1, TOPIC, payload(0)),
                kv.ReplayEntry(2, TOPIC, b"\xc1garbage"),  # a kind this side cannot read
                kv.ReplayEntry(3, TOPIC, payload(2)),
            ]
            router.send_multipart([peer, kv.encode(kv.ReplayBatch(req.rid, "E", entries))])
            router.send_multipart([peer, kv.encode(kv.ReplayEnd(req.rid, "E", 3, 3))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sub = KvEventsSubscriber(
        "tcp://127.0.0.1:9", f"tcp://127.0.0.1:{port}", since=0, replay_timeout_s=5
    )
    try:
        await sub.connect()
        items = list(sub._pending)
    finally:
        await sub.close()
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()
    assert [type(i) for i in items] == [Delivery, Lost, Delivery]
    assert [items[0].seq, items[2].seq] == [1, 3]
    lost = items[1]
    assert (lost.reason, lost.topics, lost.after_seq, lost.before_seq) == (
        "undecodable", (TOPIC,), 1, 3,
    )  # fmt: skip
    assert sub.malformed == 1
