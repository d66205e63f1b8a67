"""The controller walks large states a step at a time (services/controller/registry.py):
snapshots are packed, full states parsed and gone workers' chunks cleared in steps
of WALK_STEP chunks, other work runs between steps, and what a step leaves half done is
never seen: a snapshot does not tear a worker, a lookup sees a worker's old state until
its new one is complete, and a state abandoned midway leaves no bit behind."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path

from kvmesh.common.chunk_holders import WALK_STEP as STEP
from kvmesh.common.config import ControllerConfig
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol import kv_events as kv
from kvmesh.services.controller.event_pub import EventPublisher
from kvmesh.services.controller.registry import Registry, WorkerEntry, chunk_int
from kvmesh.services.controller.server import ControllerServer

NS = "0123456789abcdef"


def keys(w: int, n: int, first: int = 0) -> list[str]:
    return [f"{NS}-{0:016x}{w:08x}{i:08x}" for i in range(first, first + n)]


def fill(reg: Registry, workers: int, chunks: int) -> None:
    for w in range(workers):
        entry = reg.register(f"inst{w}", 0, 1, [NS], f"tcp://h:{w + 1}", 1.0, None)
        ks = keys(w, chunks + chunks // 2)
        reg.apply(entry, [(1, k, "l1") for k in ks[:chunks]])
        reg.apply(entry, [(1, k, "disk") for k in ks[chunks:]])


def test_save_snapshot_packs_in_steps_serving_between_them(tmp_path: Path) -> None:
    path = tmp_path / "registry.snap"
    server = ControllerServer(ControllerConfig(snapshot_path=str(path)))
    reg = server.registry
    fill(reg, workers=3, chunks=2 * STEP)
    first = reg.workers["inst0/0"]
    taken = {t: set(ks) for t, ks in first.tiers.items()}
    ticks = 0
    seen: list[int] = []  # the ticks counted at each step
    real = reg.pack_workers

    def watched(out):
        for _ in real(out):
            seen.append(ticks)
            if len(seen) == 1:  # midway through inst0: a change packing must not tear
                reg.apply(first, [(1, k, "l1") for k in keys(0, 10, first=10 * STEP)])
                first.last_seq += 10
            yield

    reg.pack_workers = watched  # type: ignore[method-assign]

    async def run() -> None:
        nonlocal ticks
        save = asyncio.ensure_future(server.save_snapshot())
        while not save.done():
            ticks += 1
            await asyncio.sleep(0)
        await save

    asyncio.run(run())
    # l1 in 2 steps, disk in 1, then one per worker: 4 a worker, with other work between.
    assert len(seen) == 12 and all(b > a for a, b in itertools.pairwise(seen))
    restored = Registry()
    assert restored.load(path.read_bytes()) == 3
    twin = restored.workers["inst0/0"]
    assert twin.tiers == taken and twin.last_seq == 0  # as when its turn came
    for wid in ("inst1/0", "inst2/0"):
        assert restored.workers[wid].tiers == reg.workers[wid].tiers
    again = Registry()
    assert again.load(reg.snapshot()) == 3 and again.workers["inst0/0"].tiers == first.tiers


def holders_of(reg: Registry, entry: WorkerEntry) -> set[int]:
    bits = entry.slot_bits
    return {k for k, m in reg.holders.items() if m & bits}


def test_a_full_state_takes_effect_only_when_complete() -> None:
    reg = Registry()
    e = reg.register("a", 0, 1, [NS], "tcp://h:1", 1.0, None)
    old = keys(0, 5)
    reg.apply(e, [(1, k, "l1") for k in old])
    new = keys(0, 3 * STEP, first=100)
    steps = reg.replace_steps(e, {"l1": new, "disk": ["not a key", *keys(0, 2)]})
    next(steps)
    # Midway: lookups still see the old state.
    assert reg.locate(old, "asker") == (e, 5) and reg.locate(new[:2], "asker") is None
    for _ in steps:
        pass
    assert reg.locate(old, "asker") is None and reg.locate(new[:9], "asker") == (e, 9)
    assert e.tiers["l1"] == {chunk_int(k) for k in new} and reg.bad_keys == 1
    while not reg.sweep():
        pass
    assert reg.chunks_total() == 3 * STEP + 2 and holders_of(reg, e) == set(reg.holders)


def test_a_full_state_abandoned_midway_leaves_nothing_behind() -> None:
    reg = Registry()
    e = reg.register("a", 0, 1, [NS], "tcp://h:1", 1.0, None)
    reg.apply(e, [(1, k, "l1") for k in keys(0, 5)])
    # Superseded by a later state: the first stops at its next step.
    first = reg.replace_steps(e, {"l1": keys(0, 3 * STEP, first=100)})
    next(first)
    second = reg.replace_steps(e, {"l1": keys(0, 7, first=10**6)})
    assert list(first) == []
    for _ in second:
        pass
    while not reg.sweep():
        pass
    assert set(reg.holders) == e.tiers["l1"] == {chunk_int(k) for k in keys(0, 7, first=10**6)}
    # Its worker dropped midway: the partial state is cleared and every slot is free.
    third = reg.replace_steps(e, {"l1": keys(0, 3 * STEP, first=200)})
    next(third)
    assert reg.drop("a/0") == 7
    assert list(third) == []
    while not reg.sweep():
        pass
    assert reg.holders == {}
    b = reg.register("b", 0, 1, [NS], "tcp://h:2", 1.0, None)
    assert b.slot == 0  # the swept slots are given out again
    # Closed before it ends (its task cancelled): the same.
    steps = reg.replace_steps(b, {"l1": keys(1, 2 * STEP)})
    next(steps)
    steps.close()
    while not reg.sweep():
        pass
    assert reg.holders == {} and b.tiers == {}


def full_state_server() -> tuple[ControllerServer, EventPublisher, WorkerEntry]:
    server = ControllerServer(ControllerConfig())
    pub = EventPublisher(Metrics(), replay_size=10 * STEP)
    pub.topics.add(b"")  # a subscriber to the external KV-event feed
    server.handlers.events_pub = pub
    entry = server.registry.register("I", 0, 1, [NS], "tcp://h:1", 1.0, b"w")
    return server, pub, entry


def published(pub: EventPublisher) -> list[tuple[str, int]]:
    assert pub.ring is not None
    out = []
    for k in pub.ring.since(0):
        p = kv.decode_payload(k.payload)
        out.append((type(p).__name__, len(getattr(p, "events", []))))
    return out


def test_a_full_state_is_published_in_steps_before_the_batches_held_behind_it() -> None:
    server, pub, entry = full_state_server()
    h, ks = server.handlers, keys(0, 3 * STEP)
    begun = h.full_state(b"w", proto.FullState(1, "I/0", 0, {"l1": ks}))
    assert h.events(b"w", proto.KVEventBatch(0, "I/0", 1, [(2, ks[0], "l1")]), 0) is None

    async def run() -> tuple[object, int]:
        task, turns = asyncio.ensure_future(begun), 0
        while not task.done():
            turns += 1
            await asyncio.sleep(0)
        return await task, turns

    reply, turns = asyncio.run(run())
    assert isinstance(reply, proto.FullStateReply) and reply.chunks == 3 * STEP - 1
    assert turns >= 6  # 3 steps to parse, 3 to build the feed's message
    assert published(pub) == [("WorkerState", 3 * STEP), ("EventBatch", 1)]
    assert entry.last_seq == 1 and entry.held is None


def test_a_worker_gone_while_its_state_is_published_gets_no_state_after_it_left() -> None:
    server, pub, entry = full_state_server()
    h, ks = server.handlers, keys(0, 3 * STEP)
    begun = h.full_state(b"w", proto.FullState(1, "I/0", 0, {"l1": ks}))

    async def run() -> object:
        task = asyncio.ensure_future(begun)
        while True:  # until the state is in
            if len(entry.tiers.get("l1", ())) == 3 * STEP:
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # and a step of the feed's message is built
        assert not task.done()
        h.deregister(b"w", proto.Deregister(2, "I/0"))
        return await task

    reply = asyncio.run(run())
    assert isinstance(reply, proto.ErrorReply) and "gone" in reply.message
    assert published(pub) == [("WorkerLeft", 0)]


def test_a_full_state_stopped_midway_holds_no_batch_and_asks_for_another() -> None:
    server, _, entry = full_state_server()
    h, ks = server.handlers, keys(0, 3 * STEP)
    pushed: list = []
    h.push = lambda peer, msg: pushed.append(msg) or True  # type: ignore[method-assign]
    begun = h.full_state(b"w", proto.FullState(1, "I/0", 0, {"l1": ks}))
    h.events(b"w", proto.KVEventBatch(0, "I/0", 1, [(2, ks[0], "l1")]), 0)

    async def run() -> None:
        task = asyncio.ensure_future(begun)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()  # the controller stopping, say
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert entry.held is None  # later batches are applied (or resynced) again
    assert [type(m).__name__ for m in pushed] == ["Resync"]
    assert entry.tiers == {}  # the old state, empty, stays
    while not server.registry.sweep():
        pass
    assert server.registry.holders == {}  # the partial state is gone
