"""What one client can make the controller do is bounded: one index snapshot at a time
per peer, bounded Register, Pin and Compress requests, replay answers a peer does not
read; a snapshot that does not load leaves nothing half-loaded; a cancelled snapshot
write is not raced by the one at stop."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvmesh.common.config import ControllerConfig
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol import kv_events as kv
from kvmesh.services.controller import server as server_mod
from kvmesh.services.controller.event_pub import EventPublisher
from kvmesh.services.controller.event_replay import EventReplay
from kvmesh.services.controller.move import MAX_MOVE_KEYS
from kvmesh.services.controller.registry import Registry, Snapshot, _SnapWorker
from kvmesh.services.controller.server import ControllerServer

NS = "00000000000000aa"


async def test_a_peer_gets_one_index_snapshot_at_a_time() -> None:
    srv = ControllerServer(ControllerConfig(port=0))
    srv.registry.register("i", 0, 1, [NS], "", 1.0, b"w")
    sent: list[object] = []
    srv.feed._send = lambda peer, msg: sent.append(msg) or True
    first = srv.feed.subscribe(b"p", proto.IndexSubscribe(1))
    again = srv.feed.subscribe(b"p", proto.IndexSubscribe(2))
    assert asyncio.iscoroutine(first)
    assert isinstance(again, proto.ErrorReply) and again.code == proto.ErrorCode.SHUTTING_DOWN
    await first
    assert [type(m) for m in sent] == [proto.IndexSnapshotReply]
    third = srv.feed.subscribe(b"p", proto.IndexSubscribe(3))  # answered: may ask again
    assert asyncio.iscoroutine(third)
    await third


def test_register_bounds_world_size_and_endpoints() -> None:
    h = ControllerServer(ControllerConfig(port=0)).handlers

    def register(world_size: int, endpoint: str = "") -> object:
        return h.register(b"p", proto.Register(1, "i", 0, world_size, [NS], endpoint))

    assert isinstance(register(8), proto.RegisterReply)
    refused = register(1 << 40)
    assert isinstance(refused, proto.ErrorReply) and "world_size <= 4096" in refused.message
    assert isinstance(register(1, "tcp://h:1/" + "x" * 5000), proto.ErrorReply)


async def test_pin_and_compress_of_too_many_keys_are_refused() -> None:
    h = ControllerServer(ControllerConfig(port=0)).handlers
    keys = [f"{NS}-{0:032x}"] * (MAX_MOVE_KEYS + 1)
    pin = await h.admin(b"", proto.Pin(1, "e", keys))
    assert isinstance(pin, proto.ErrorReply) and f"at most {MAX_MOVE_KEYS}" in pin.message
    compress = await h.compress(b"", proto.Compress(1, "e", keys=keys))
    assert isinstance(compress, proto.ErrorReply) and f"at most {MAX_MOVE_KEYS}" in compress.message


@pytest.mark.parametrize(
    "bad",
    [
        _SnapWorker("b/0", "b", 0, 1, ["00000000000000bb"], "", 1.0, 5, {"l1": b"\x01\x02\x03"}),
        _SnapWorker("b/0", "b", 0, 1, ["not-hex"], "", 1.0, 5, {}),
        _SnapWorker("b/0", "b", 3, 1, ["00000000000000bb"], "", 1.0, 5, {}),
    ],
)
def test_a_snapshot_that_fails_half_way_leaves_the_registry_empty(bad: _SnapWorker) -> None:
    good = _SnapWorker("a/0", "a", 0, 1, [NS], "", 1.0, 5, {"l1": (7).to_bytes(8, "little")})
    reg = Registry()
    reg.register("old", 0, 1, [NS], "", 1.0, b"o")
    with pytest.raises(ValueError):
        reg.load(msgspec.msgpack.encode(Snapshot(1, 0.0, [good, bad])))
    assert (reg.workers, reg.chunks_total(), reg.holders) == ({}, 0, {})


async def test_stop_waits_for_a_cancelled_snapshot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "snap"
    srv = ControllerServer(ControllerConfig(port=0, snapshot_path=str(path)))
    await srv.start()
    writing, overlaps, first_in = [0], [0], threading.Event()
    lock = threading.Lock()

    def slow_write(p: str, data: bytes) -> None:
        with lock:
            writing[0] += 1
            overlaps[0] = max(overlaps[0], writing[0])
        first_in.set()
        time.sleep(0.3)
        with open(p, "wb") as f:
            f.write(data)
        with lock:
            writing[0] -= 1

    monkeypatch.setattr(server_mod, "_write_atomic", slow_write)
    srv.registry.register("i", 0, 1, [NS], "", 1000.0, b"w")
    task = asyncio.create_task(srv.save_snapshot())
    await asyncio.to_thread(first_in.wait, 5)
    task.cancel()  # as stop() cancels housekeeping in the middle of its write
    await srv.stop()
    assert overlaps[0] == 1
    assert Registry().load(path.read_bytes()) == 1
    assert os.listdir(tmp_path) == ["snap"]


async def test_replay_answers_a_peer_does_not_read_are_bounded() -> None:
    ctx = zmq.Context()
    pub = EventPublisher(Metrics(), replay_size=20_000)
    pub.start(ctx, "127.0.0.1", 0, lambda s: None)
    pub.topics.add(b"")
    rep = EventReplay(ctx, pub, Metrics())
    port = rep.start("127.0.0.1", 0, lambda s: None)
    reg = Registry()
    e = reg.register("i", 0, 1, [NS], "", 1.0, b"p")
    for b in range(20):  # 20 messages of 1000 events (~60 KB each): the ring is full
        pub.events(e, [(1, f"{NS}-{b * 1000 + i:032x}", "l1") for i in range(1000)])
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVHWM, 1)
    client.setsockopt(zmq.RCVBUF, 4096)
    client.connect(f"tcp://127.0.0.1:{port}")
    try:
        asks = 200
        for i in range(asks):
            client.send(kv.codec.encode(kv.Replay(i + 1, kv.PROTOCOL_VERSION, 0)))
        await asyncio.sleep(1.5)  # answered, none read
        got, biggest = 0, 0
        while client.poll(300):
            reply = kv.codec.decode_reply(client.recv())
            got += 1
            if isinstance(reply, kv.ReplayBatch):
                biggest = max(biggest, sum(len(x.payload) for x in reply.entries))
        per_answer = len(pub.ring) // 4 + 1  # batches of ~256 KB, then the end
        assert got < asks * per_answer / 4, "every answer was held for the peer"
        assert biggest <= 256 << 10
    finally:
        client.close(0)
        rep.close()
        pub.close()
        ctx.term()
