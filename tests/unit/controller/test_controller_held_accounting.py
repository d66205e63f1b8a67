"""The bytes of event batches held during full states, on the controller's own handlers:
bounded across workers as well as per worker, given back on every way a full state
ends (applied, superseded, its worker gone, cancelled), and estimated from the size of
the frame a batch arrived in (not by encoding it again)."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kvmesh.common.config import ControllerConfig
from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller import handlers as handlers_mod
from kvmesh.services.controller.handlers import Handlers, held_cost
from kvmesh.services.controller.server import ControllerServer

NS = "00000000000000aa"
KEYS = [f"{NS}-{i:032x}" for i in range(50_000)]  # a state of some steps
EVENTS = [(1, f"{NS}-{i:032x}", "l1") for i in range(1_000_000, 1_001_000)]


def handlers() -> tuple[Handlers, list[object]]:
    h = ControllerServer(ControllerConfig(port=0)).handlers
    pushed: list[object] = []
    h.push = lambda peer, msg: pushed.append(msg) or True
    return h, pushed


def register(h: Handlers, name: str) -> bytes:
    peer = name.encode()
    assert isinstance(
        h.register(peer, proto.Register(1, name, 0, 1, [NS], "")), proto.RegisterReply
    )
    return peer


def batch(name: str, first_seq: int) -> proto.KVEventBatch:
    return proto.KVEventBatch(0, f"{name}/0", first_seq, EVENTS)


# The size of the frame each batch here arrives in, as the router loop hands it on
# (their seqs' encodings differ by a byte or two: one size keeps the sums exact).
FRAME_NBYTES = len(proto.encode(batch("a", 1)))


def send(h: Handlers, peer: bytes, msg: proto.KVEventBatch) -> object:
    return h.events(peer, msg, FRAME_NBYTES)


def overflows(h: Handlers, bound: str) -> float:
    return h.stats.held_overflows[bound]._value.get()


async def test_the_total_held_across_workers_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    h, pushed = handlers()
    cost = held_cost(batch("a", 1), FRAME_NBYTES)
    # Each worker may hold 2 batches; together, 3.
    monkeypatch.setattr(handlers_mod, "MAX_HELD_BYTES", 2 * cost)
    monkeypatch.setattr(handlers_mod, "MAX_HELD_BYTES_TOTAL", 3 * cost)
    a, b = register(h, "a"), register(h, "b")
    state_a = h.full_state(a, proto.FullState(2, "a/0", 0, {"l1": KEYS}))
    state_b = h.full_state(b, proto.FullState(2, "b/0", 0, {"l1": KEYS}))
    send(h, a, batch("a", 1))
    send(h, a, batch("a", 1001))
    assert h.held_bytes == 2 * cost and overflows(h, "bytes") == 0
    send(h, b, batch("b", 1))
    send(h, b, batch("b", 1001))  # b's second: under its own bound, over the total
    assert overflows(h, "total_bytes") == 1 and overflows(h, "bytes") == 0
    assert h.held_bytes == 2 * cost  # b's first freed at once
    assert (await state_a).chunks == len(KEYS) + len(EVENTS)  # a's applied
    assert (await state_b).chunks == len(KEYS)  # b's dropped...
    reasons = [(m.worker_id, m.reason) for m in pushed if isinstance(m, proto.Resync)]
    assert reasons == [("b/0", "events dropped while the full state was applied")]  # ...b resyncs
    assert h.held_bytes == 0 and h.stats.held_bytes._value.get() == 0


async def test_over_the_total_the_largest_holder_gives_up_its_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One worker holding the whole total: the next workers' batches are held and the
    large holder alone resyncs (dropping each sender's freed nothing, and every worker
    after the first large one resynced)."""
    h, pushed = handlers()
    cost = held_cost(batch("a", 1), FRAME_NBYTES)
    monkeypatch.setattr(handlers_mod, "MAX_HELD_BYTES", 3 * cost)
    monkeypatch.setattr(handlers_mod, "MAX_HELD_BYTES_TOTAL", 3 * cost)
    names = ["a", "b", "c", "d"]
    peers = {n: register(h, n) for n in names}
    states = {
        n: h.full_state(peers[n], proto.FullState(2, f"{n}/0", 0, {"l1": KEYS})) for n in names
    }
    for seq in (1, 1001, 2001):
        send(h, peers["a"], batch("a", seq))
    assert h.held_bytes == 3 * cost
    for n in names[1:]:
        send(h, peers[n], batch(n, 1))
    assert overflows(h, "total_bytes") == 1
    assert h.held_bytes == 3 * cost  # b's, c's and d's
    for n in names:
        await states[n]
    reasons = [m.worker_id for m in pushed if isinstance(m, proto.Resync)]
    assert reasons == ["a/0"]
    assert h.held_bytes == 0


async def test_held_bytes_are_given_back_however_the_state_ends() -> None:
    h, _ = handlers()
    a = register(h, "a")
    cost = held_cost(batch("a", 1), FRAME_NBYTES)
    # Superseded by a later state (begun before the first's task ran, as two states
    # read in one loop turn are): the first's batches go, the later one holds anew.
    first = h.full_state(a, proto.FullState(2, "a/0", 0, {"l1": KEYS}))
    send(h, a, batch("a", 1))
    second = h.full_state(a, proto.FullState(3, "a/0", 0, {"l1": KEYS}))
    assert h.held_bytes == 0
    send(h, a, batch("a", 1))
    assert h.held_bytes == cost
    assert isinstance(await first, proto.ErrorReply)
    assert h.held_bytes == cost  # the second's, still held
    assert (await second).chunks == len(KEYS) + len(EVENTS)
    assert h.held_bytes == 0
    # Its worker gone while the state is applied.
    gone = h.full_state(a, proto.FullState(4, "a/0", 0, {"l1": KEYS}))
    send(h, a, batch("a", 1))
    h.deregister(a, proto.Deregister(5, "a/0"))
    assert isinstance(await gone, proto.ErrorReply)
    assert h.held_bytes == 0
    # Cancelled (the controller stopping) half way.
    a = register(h, "a")
    task = asyncio.ensure_future(h.full_state(a, proto.FullState(6, "a/0", 0, {"l1": KEYS})))
    await asyncio.sleep(0)
    send(h, a, batch("a", 1))
    assert h.held_bytes == cost
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.held_bytes == 0 and h.stats.held_bytes._value.get() == 0


async def test_a_held_batch_costs_its_received_frame_size() -> None:
    """Over a real socket: the cost of a held batch is its frame's size as received
    plus its objects' (a frame of a larger header than the events alone counts whole)."""
    srv = ControllerServer(ControllerConfig(port=0, host="127.0.0.1"))
    await srv.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.port}")
    seen: list[int] = []
    events = srv.handlers.sized_table[proto.KVEventBatch]

    def recording(peer: bytes, msg: proto.KVEventBatch, size: int) -> object:
        reply = events(peer, msg, size)
        seen.append(srv.handlers.held_bytes)
        return reply

    srv.handlers.sized_table[proto.KVEventBatch] = recording

    async def ask(msg: object) -> object:
        await sock.send(proto.encode(msg))
        return proto.codec.decode_reply(await asyncio.wait_for(sock.recv(), 5.0))

    try:
        assert isinstance(await ask(proto.Hello(1, proto.PROTOCOL_VERSION)), proto.HelloReply)
        reply = await ask(proto.Register(2, "a", 0, 1, [NS], ""))
        assert isinstance(reply, proto.RegisterReply)
        # The frame holds its rid, worker id and seq as well: it is counted whole.
        held = proto.KVEventBatch(0, reply.worker_id, 1, EVENTS)
        frame = proto.encode(held)
        # Sent back to back, read in one loop turn: the batch is held behind the state.
        await sock.send(proto.encode(proto.FullState(3, reply.worker_id, 0, {"l1": KEYS})))
        await sock.send(frame)
        state = proto.codec.decode_reply(await asyncio.wait_for(sock.recv(), 10.0))
        assert isinstance(state, proto.FullStateReply)
        assert state.chunks == len(KEYS) + len(EVENTS)  # the held batch, applied after
        want = handlers_mod.HELD_BATCH_BYTES + len(frame)
        assert seen == [want + handlers_mod.HELD_EVENT_BYTES * len(EVENTS)]
    finally:
        sock.close(linger=0)
        ctx.term()
        await srv.stop()
