"""The KV-event feed's replay socket: a ROUTER answering `Replay(since_seq)` from the
publisher's ring (common/protocol/kv_events.py has the exchange).

Served from the loop's selector like the controller's own ROUTER (router_loop.py):
a request that does not decode gets an ErrorReply and serving goes on. An answer is
built and sent in one go on the loop: the ring is bounded, so is the work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.protocol.kv_events import ErrorCode
from kvmesh.common.transport.router_loop import RouterLoop
from kvmesh.services.controller.event_pub import EventPublisher
from kvmesh.services.controller.event_ring import TooOld

MAX_REQUEST_BYTES = 1 << 20
# What a peer that asks and never reads can make us hold: ZMQ's HWM counts messages,
# so batches are bounded in bytes too, and the HWM is what two answers of a full ring
# take (an event's payload assumed under EVENT_BYTES): a few hundred MB at most.
MAX_BATCH_BYTES = 256 << 10
EVENT_BYTES = 256


class _Stats:
    """What RouterLoop counts: requests by op, error replies by code."""

    def __init__(self, metrics: Metrics) -> None:
        requests = metrics.counter(
            "controller_event_replay_requests_total", "Event replay requests, by type", ["op"]
        )
        self.requests = {
            op: requests.labels(op=op) for op in (*sorted(kv.codec.request_tags), "invalid")
        }
        errors = metrics.counter(
            "controller_event_replay_errors_total", "Event replay error replies, by code", ["code"]
        )
        self.errors = {c: errors.labels(code=c.name.lower()) for c in ErrorCode}


class EventReplay:
    def __init__(self, ctx: zmq.Context, publisher: EventPublisher, metrics: Metrics) -> None:
        if publisher.ring is None:
            raise ValueError("the publisher keeps no ring (replay_size 0)")
        self.publisher = publisher
        self.stats = _Stats(metrics)
        self.router = RouterLoop(ctx, kv.codec, self._dispatch, self.stats)

    def start(self, host: str, port: int, secure: Callable[[zmq.Socket], None]) -> int:
        size = self.publisher.ring.size  # type: ignore[union-attr]
        hwm = 2 * (size // kv.MAX_REPLAY_ENTRIES + size * EVENT_BYTES // MAX_BATCH_BYTES + 2)
        return self.router.start(
            host, port, max_message_bytes=MAX_REQUEST_BYTES, secure=secure, send_hwm=hwm
        )

    def close(self) -> None:
        self.router.close()

    def _error(self, peer: bytes, rid: int, code: ErrorCode, message: str) -> None:
        self.stats.errors[code].inc()
        self.router.send(peer, kv.error_reply(rid, code, message))

    def _dispatch(self, peer: bytes, msg: Any, values: list) -> None:
        self.stats.requests[msg.__struct_config__.tag].inc()
        pub = self.publisher
        ring = pub.ring
        assert ring is not None
        if values:
            self._error(peer, msg.rid, ErrorCode.BAD_MESSAGE, "one frame expected")
            return
        if isinstance(msg, kv.Hello):
            self.router.send(peer, kv.HelloReply(msg.rid, kv.PROTOCOL_VERSION, pub.epoch, pub.seq))
            return
        if msg.epoch and msg.epoch != pub.epoch:
            self._error(
                peer,
                msg.rid,
                ErrorCode.EPOCH_CHANGED,
                f"epoch {msg.epoch[:40]} is over (now {pub.epoch}); "
                "resync from the controller's workers list",
            )
            return
        if msg.since_seq > pub.seq:
            self._error(
                peer,
                msg.rid,
                ErrorCode.BAD_MESSAGE,
                f"since_seq {msg.since_seq} is ahead of the newest seq {pub.seq}",
            )
            return
        try:
            kept = ring.since(msg.since_seq, msg.namespaces)
        except TooOld:
            self._error(peer, msg.rid, ErrorCode.TOO_OLD, kv.TOO_OLD_MESSAGE)
            return
        entries: list[kv.ReplayEntry] = []
        size = 0
        for k in kept:
            if entries and (
                len(entries) == kv.MAX_REPLAY_ENTRIES or size + len(k.payload) > MAX_BATCH_BYTES
            ):
                self.router.send(peer, kv.ReplayBatch(msg.rid, pub.epoch, entries))
                entries, size = [], 0
            entries.append(kv.ReplayEntry(k.seq, k.topic, k.payload))
            size += len(k.payload)
        if entries:
            self.router.send(peer, kv.ReplayBatch(msg.rid, pub.epoch, entries))
        self.router.send(peer, kv.ReplayEnd(msg.rid, pub.epoch, pub.seq, len(kept)))
