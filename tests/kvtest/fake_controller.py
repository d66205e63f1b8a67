"""A stand-in controller for the lookup-server's index tests: it speaks just the index
subscription (hello, subscribe, ping) on a real ROUTER, from a thread, and lets a test
push what a real controller never would: pushes out of sequence, a new epoch, frames
that do not decode, or silence.

    with FakeController(state) as fake:   # state: worker id → (IndexWorker, tiers)
        fake.push(lambda epoch, seq: proto.IndexEvents(0, epoch, seq, "a/0", runs))
        fake.push(..., skip=1)            # a push the subscriber never gets
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any, Self

import zmq

from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode


class FakeController:
    def __init__(self, workers: dict[str, proto.IndexWorkerState]) -> None:
        self.workers = workers  # the snapshot a subscribe gets (the test may change it)
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.subscribes = 0
        self.silent = False  # True: answer nothing (a hung controller)
        self.subscriber: bytes | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._todo: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()

    # -- what a test does (run on the fake's thread, which owns the socket) ------------------
    def push(self, build: Callable[[str, int], Any], *, skip: int = 0) -> None:
        """Send build(epoch, seq) as the next push, `skip` pushes after the last one."""

        def send() -> None:
            self.seq += 1 + skip
            self._send_to_subscriber(proto.encode(build(self.epoch, self.seq)))

        self._todo.put(send)

    def send_raw(self, frame: bytes) -> None:
        self._todo.put(lambda: self._send_to_subscriber(frame))

    def restart(self) -> None:
        """A new epoch and seq, as a restarted controller has (it forgets subscribers)."""

        def reset() -> None:
            self.epoch, self.seq, self.subscriber = uuid.uuid4().hex, 0, None

        self._todo.put(reset)

    # -- the thread ---------------------------------------------------------------------------
    def _send_to_subscriber(self, frame: bytes) -> None:
        assert self.subscriber is not None, "nobody subscribed yet"
        self._sock.send_multipart([self.subscriber, frame])

    def _serve(self) -> None:
        while not self._stop.is_set():
            while not self._todo.empty():
                self._todo.get()()
            if not self._sock.poll(10):
                continue
            peer, raw = self._sock.recv_multipart()
            msg = proto.decode_request(raw)
            if self.silent:
                continue
            reply = self._answer(peer, msg)
            if reply is not None:
                self._sock.send_multipart([peer, proto.encode(reply)])

    def _answer(self, peer: bytes, msg: Any) -> Any:
        if isinstance(msg, proto.Hello):
            return proto.HelloReply(msg.rid, proto.PROTOCOL_VERSION, "fake")
        if isinstance(msg, proto.IndexSubscribe):
            self.subscribes += 1
            self.subscriber = peer
            return proto.IndexSnapshotReply(
                msg.rid, self.epoch, self.seq, list(self.workers.values())
            )
        if isinstance(msg, proto.IndexPing):
            if peer != self.subscriber or msg.epoch != self.epoch:
                return proto.error_reply(msg.rid, ErrorCode.NOT_SUBSCRIBED, "subscribe")
            return proto.IndexTick(msg.rid, self.epoch, self.seq)
        return None  # anything else: never answered (the lookup-server's deadline)
