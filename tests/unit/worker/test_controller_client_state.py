"""The worker's controller client sends its full state while the engine goes on storing:
an event recorded after the state's snapshot must reach the controller after the state
and numbered past it, or the controller (which replaces its view with the state) would
lose it with no sequence gap to notice. A ROUTER on loopback records what arrives."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import zmq
import zmq.asyncio

from kvmesh.common.config import EngineControllerConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.services.worker.controller_client import ControllerClient
from kvmesh.services.worker.events import KVEventBuffer, KVEventKind

NS = "0123456789abcdef"
HELD = [ChunkKey(NS, i.to_bytes(16, "big")) for i in range(200_000)]  # converted on a thread
NEW = ChunkKey(NS, b"\xff" * 16).to_str()
LATER = ChunkKey(NS, b"\xfe" * 16).to_str()


async def _controller(sock: zmq.asyncio.Socket, log: list[tuple]) -> None:
    while True:
        ident, raw = await sock.recv_multipart()
        msg = proto.decode_request(raw)
        if isinstance(msg, proto.KVEventBatch):
            log.append(("events", msg.first_seq, [k for _, k, _ in msg.events]))
        elif isinstance(msg, proto.FullState):
            log.append(("state", msg.seq, set(msg.tiers["l1"])))
            await sock.send_multipart([ident, proto.encode(proto.FullStateReply(msg.rid, 0))])


async def test_events_recorded_while_a_full_state_is_built_go_out_after_it() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    log: list[tuple] = []
    ctl = asyncio.create_task(_controller(router, log))
    events = KVEventBuffer()
    cfg = EngineControllerConfig(enabled=True, url=f"tcp://127.0.0.1:{port}", event_flush_s=0.005)
    engine = SimpleNamespace(
        instance_id="w",
        rank=0,
        events=events,
        curve=None,
        storage=SimpleNamespace(l1=SimpleNamespace(keys=lambda: list(HELD))),
        config=SimpleNamespace(controller=cfg),
    )
    client = ControllerClient(engine, cfg)
    client._conn = ControllerConnection(cfg.url, timeout_s=5.0)
    await client._conn.connect(hello=False)
    client.registered = True
    flusher = asyncio.create_task(client._event_loop())
    try:
        events.record(KVEventKind.STORED, ChunkKey(NS, b"\x01" * 16).to_str(), "l1")
        await asyncio.sleep(0.05)  # flushed: seq 1
        resync = asyncio.create_task(client._resync())  # the controller asked for one
        await asyncio.sleep(0)  # the snapshot is taken; its keys are being converted
        events.record(KVEventKind.STORED, NEW, "l1")  # a store lands meanwhile
        await asyncio.sleep(0.05)  # several flush periods while the state is built
        await resync
        events.record(KVEventKind.STORED, LATER, "l1")
        for _ in range(100):
            if any(e[0] == "events" and LATER in e[2] for e in log):
                break
            await asyncio.sleep(0.01)
    finally:
        flusher.cancel()
        ctl.cancel()
        await client._conn.close()
        router.close(0)
        ctx.term()
    at = next(i for i, e in enumerate(log) if e[0] == "state")
    _, seq, state = log[at]
    after = [e for e in log[at + 1 :] if e[0] == "events"]
    # Nothing recorded after the snapshot went out before the state...
    assert all(NEW not in e[2] for e in log[:at] if e[0] == "events"), log[:at]
    assert NEW not in state and seq == 1
    # ...it follows the state, numbered right after it: the controller applies it on top.
    assert after and after[0][1] == seq + 1, after
    assert [k for e in after for k in e[2]] == [NEW, LATER]
