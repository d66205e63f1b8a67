"""The lookup-server's index (services/lookup/index.py) and the follower's handling of
the controller's pushes: the index answers prefix counts exactly as the controller's
registry does, through admits, evicts, leaves, replaced states and sweeps; pushes
out of sequence, of another epoch or for an unknown worker ask for a resync."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvmesh.common.chunk_holders import WALK_STEP
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller.index_feed import IndexFeed
from kvmesh.services.controller.registry import Registry
from kvmesh.services.controller.stats import ControllerStats
from kvmesh.services.lookup.follower import IndexFollower
from kvmesh.services.lookup.index import ChunkIndex

NS = ["0123456789abcdef", "fedcba9876543210", "00000000000000ff"]
TIERS = ["l1", "disk", "remote", "weird"]


def h(i: int) -> bytes:
    return i.to_bytes(8, "big") * 2


def key(ns: str, i: int) -> str:
    return f"{ns}-{h(i).hex()}"


def subscribe(feed: IndexFeed, peer: bytes, rid: int, sent: list) -> object:
    """What the feed answers a subscribe: an error at once, or a snapshot it sends
    (taken off `sent`, which it leads) when its packing coroutine has run."""
    begun = feed.subscribe(peer, proto.IndexSubscribe(rid))
    if not asyncio.iscoroutine(begun):
        return begun
    assert asyncio.run(begun) is None
    reply = sent.pop(0)
    assert isinstance(reply, proto.IndexSnapshotReply)
    return reply


def following(snap: proto.IndexSnapshotReply, index: ChunkIndex) -> IndexFollower:
    """A follower (no socket) at the snapshot, with `index` as built from it."""
    f = IndexFollower(
        "tcp://127.0.0.1:1",
        Metrics(),
        ping_s=0.1,
        max_staleness_s=1.0,
        request_timeout_s=0.5,
        snapshot_timeout_s=1.0,
    )
    f.epoch, f.seq, f.index, f._following = snap.epoch, snap.seq, index, True
    return f


def replace_state(reg: Registry, entry, tiers: dict[str, list[str]]) -> None:
    for _ in reg.replace_steps(entry, tiers):
        pass


class Wired:
    """A registry with a feed and one subscriber, whose pushes a follower applies."""

    def __init__(self) -> None:
        self.reg = Registry()
        self.pushes: list = []
        self.feed = IndexFeed(
            self.reg,
            lambda peer, msg: self.pushes.append(msg) or True,
            ControllerStats(),
            max_subscribers=4,
            timeout_s=10.0,
        )
        snap = subscribe(self.feed, b"peer", 1, self.pushes)
        self.follower = following(snap, ChunkIndex())

    def deliver(self) -> None:
        for msg in self.pushes:
            self.follower._apply(msg)
        self.pushes.clear()

    def same(self, hashes: list[bytes], instance: str = "") -> None:
        self.deliver()
        assert not self.follower._resync.is_set(), self.follower._resync_reason
        assert self.follower.index is not None
        got = self.follower.index.prefix_counts(hashes, instance)
        assert got == self.reg.prefix_counts(hashes, instance)


def test_index_answers_like_the_registry_through_random_changes() -> None:
    rnd = random.Random(7)
    w = Wired()
    entries = {}
    hashes = [h(i) for i in range(12)]
    for step in range(400):
        op = rnd.random()
        inst = rnd.choice("abc")
        rank = rnd.randrange(2)
        wid = f"{inst}/{rank}"
        if op < 0.1 or wid not in entries:
            entries[wid] = w.reg.register(inst, rank, 2, [NS[rank]], "", 1.0, None, "tcp://x")
        elif op < 0.15:
            w.reg.drop(wid)
            del entries[wid]
        elif op < 0.2:
            tiers = {t: [key(NS[rank], i) for i in range(rnd.randrange(12))] for t in TIERS[:2]}
            replace_state(w.reg, entries[wid], tiers)
        else:
            kind = 1 if rnd.random() < 0.7 else 2
            events = [
                (kind, key(NS[rank], rnd.randrange(12)), rnd.choice(TIERS))
                for _ in range(rnd.randrange(1, 6))
            ]
            w.reg.apply(entries[wid], events)
        if step % 7 == 0:
            w.follower.index.sweep(budget=3)  # a sweep in progress changes no answer
        w.same(hashes)
        w.same(hashes[:5], inst)
    while not w.follower.index.sweep(budget=5):
        pass
    w.same(hashes)
    # Swept: no chunk is held by a slot nobody owns any more.
    index = w.follower.index
    live = 0
    for iw in index.workers.values():
        live |= iw.slot_bits
    assert all(m & ~live == 0 for m in index.holders.values())
    assert index.slots == len(index.workers)


def test_leave_hides_a_worker_at_once_and_the_sweep_frees_its_slot() -> None:
    index = ChunkIndex()
    a = index.join(proto.IndexWorker("a/0", "a", 0, 1, [NS[0]]))
    b = index.join(proto.IndexWorker("b/0", "b", 0, 1, [NS[0]]))
    chunks = [
        (int.from_bytes(h(i)[8:], "big") ^ int(NS[0], 16)) & proto.CHUNK_INT_MASK for i in range(4)
    ]
    index.apply(a, 1, "l1", chunks)
    index.apply(b, 1, "disk", chunks[:2])
    hashes = [h(i) for i in range(4)]
    assert index.prefix_counts(hashes) == [("a", 1, 1, 4, 4), ("b", 1, 1, 2, 0)]
    index.leave("a/0")
    assert index.prefix_counts(hashes) == [("b", 1, 1, 2, 0)]
    assert index.chunks == 4 and index.slots == 2  # a's bits linger until swept
    c = index.join(proto.IndexWorker("c/0", "c", 0, 1, [NS[0]]))
    assert c.slot == 2  # a's slot is not reused before the sweep
    assert index.prefix_counts(hashes, "c") == [("c", 1, 1, 0, 0)]
    assert index.sweep()
    assert index.chunks == 2 and index.slots == 2
    d = index.join(proto.IndexWorker("d/0", "d", 0, 1, [NS[0]]))
    assert d.slot == 0 and index.prefix_counts(hashes, "d") == [("d", 1, 1, 0, 0)]
    # An evict of a chunk the index does not hold is nothing.
    index.apply(d, 2, "l1", [12345])


def test_pushes_out_of_sequence_or_epoch_or_for_unknown_workers_ask_for_a_resync() -> None:
    for bad, reason in [
        (lambda w, m: m.__class__(m.rid, m.epoch, m.seq + 1, *_rest(m)), "gap"),
        (lambda w, m: m.__class__(m.rid, "other", m.seq, *_rest(m)), "restart"),
        (lambda w, m: proto.IndexEvents(0, m.epoch, m.seq, "nobody/0", []), "diverged"),
    ]:
        w = Wired()
        e = w.reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
        w.deliver()
        w.reg.apply(e, [(1, key(NS[0], 1), "l1")])
        (push,) = w.pushes
        w.follower._apply(bad(w, push))
        assert w.follower._resync.is_set() and w.follower._resync_reason.startswith(reason)
        assert not w.follower.in_sync()
    # A push already in the snapshot is skipped, not a gap.
    w = Wired()
    w.reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
    (push,) = w.pushes
    w.deliver()
    w.follower._apply(push)
    assert not w.follower._resync.is_set() and w.follower.seq == 1


def _rest(m: proto.IndexEvents) -> tuple:
    return (m.worker_id, m.runs)


def test_ticks_confirm_the_index_or_reveal_a_gap() -> None:
    w = Wired()
    f = w.follower
    assert not f.in_sync()  # never confirmed
    w.reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
    w.deliver()
    f._pinged[5] = 100.0
    f._on_tick(w.feed.ping(b"peer", proto.IndexPing(5, w.feed.epoch)))
    assert f._confirmed == 100.0 and f.in_sync(now=100.5) and not f.in_sync(now=101.5)
    w.reg.register("b", 0, 1, [NS[0]], "", 1.0, None)  # a push this subscriber never gets
    w.pushes.clear()
    f._pinged[6] = 102.0
    f._on_tick(w.feed.ping(b"peer", proto.IndexPing(6, w.feed.epoch)))
    assert f._resync_reason.startswith("gap") and not f.in_sync(now=102.0)
    # The controller refuses a ping of another epoch or peer.
    refused = w.feed.ping(b"other", proto.IndexPing(7, w.feed.epoch))
    assert refused.code == proto.ErrorCode.NOT_SUBSCRIBED and refused.retryable


def test_the_feed_builds_nothing_without_subscribers_and_expires_silent_ones() -> None:
    reg = Registry()
    sent: list = []
    stats = ControllerStats()
    feed = IndexFeed(
        reg, lambda p, m: sent.append(m) or True, stats, max_subscribers=1, timeout_s=1.0
    )
    e = reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
    reg.apply(e, [(1, key(NS[0], 1), "l1")])
    assert sent == [] and feed.seq == 0
    snap = subscribe(feed, b"p", 3, sent)
    assert [s.worker.worker_id for s in snap.workers] == ["a/0"] and snap.seq == 0
    full = subscribe(feed, b"q", 4, sent)
    assert full.code == proto.ErrorCode.SHUTTING_DOWN  # over max_subscribers
    reg.apply(e, [(2, key(NS[0], 1), "l1"), (1, key(NS[0], 2), "l1"), (1, key(NS[0], 3), "l1")])
    (msg,) = sent
    assert [(k, t, len(raw) // 8) for k, t, raw in msg.runs] == [(2, "l1", 1), (1, "l1", 2)]
    feed.expire(now=feed.subscribers[b"p"] + 2.0)
    assert not feed.subscribers and stats.metrics.value("controller_index_subscribers") == 0


@pytest.mark.parametrize("tiers", [{}, {"l1": []}])
def test_replace_with_nothing_empties_a_worker(tiers: dict) -> None:
    w = Wired()
    e = w.reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
    w.reg.apply(e, [(1, key(NS[0], i), "l1") for i in range(3)])
    w.same([h(i) for i in range(3)])
    replace_state(w.reg, e, tiers)
    w.same([h(i) for i in range(3)])
    assert w.follower.index.prefix_counts([h(0)]) == [("a", 1, 1, 0, 0)]


def test_a_snapshot_packed_while_the_registry_changes_then_its_held_pushes_is_the_registry() -> (
    None
):
    """The feed packs a snapshot in steps while workers come, go, come back, are
    replaced and send events; the pushes made meanwhile follow the snapshot. A follower
    that applies both ends up with every worker's chunks, tier by tier, as the registry
    has them, and asks for no resync."""
    rnd = random.Random(11)
    reg, sent = Registry(), []
    feed = IndexFeed(
        reg, lambda p, m: sent.append(m) or True, ControllerStats(), max_subscribers=4, timeout_s=10
    )
    for w in range(4):
        e = reg.register(f"w{w}", 0, 1, [NS[0]], "", 1.0, None)
        reg.apply(e, [(1, key(NS[0], i), "l1") for i in range(w * 5000, w * 5000 + 12_000)])
    ids = list(reg.workers)

    def change() -> None:
        wid = rnd.choice(ids)
        entry = reg.workers.get(wid)
        op = rnd.random()
        if entry is None:  # back after a drop, chunks and all to come
            reg.register(wid.split("/")[0], 0, 1, [NS[0]], "", 1.0, None)
        elif op < 0.1:
            reg.drop(wid)
        elif op < 0.2:
            tiers = {"l1": [key(NS[0], rnd.randrange(40_000)) for _ in range(50)]}
            replace_state(reg, entry, tiers)
        else:
            kind = 1 if op < 0.7 else 2
            events = [
                (kind, key(NS[0], rnd.randrange(40_000)), rnd.choice(TIERS)) for _ in range(20)
            ]
            reg.apply(entry, events)

    reg.register("w0", 0, 1, [NS[0]], "", 1.0, None)  # refresh: already known

    async def subscribe_while_changing() -> None:
        task = asyncio.ensure_future(feed.subscribe(b"late", proto.IndexSubscribe(9)))
        steps = 0
        while not task.done():
            if steps == 2:  # w3, not packed yet, goes (with events of its own before)
                reg.apply(reg.workers["w3/0"], [(1, key(NS[0], 99_999), "l1")])
                reg.drop("w3/0")
            elif steps == 4:  # and comes back
                reg.register("w3", 0, 1, [NS[0]], "", 1.0, None)
            else:
                change()
            steps += 1
            await asyncio.sleep(0)
        assert await task is None and steps > 10

    asyncio.run(subscribe_while_changing())
    snap, *pushes = sent
    assert isinstance(snap, proto.IndexSnapshotReply) and pushes
    for _ in range(50):  # and after it, as any subscriber
        change()
    pushes = sent[1:]
    f = following(snap, ChunkIndex())
    f.index = asyncio.run(f._build(snap))
    for push in pushes:
        f._apply(push)
    assert not f._resync.is_set(), f._resync_reason
    index = f.index
    assert set(index.workers) == set(reg.workers)
    for wid, entry in reg.workers.items():
        iw = index.workers[wid]
        for tier in TIERS:
            bit = iw.bit(tier)
            have = {k for k, m in index.holders.items() if m & bit}
            assert have == entry.tiers.get(tier, set()), (wid, tier)


def test_a_large_replaced_state_is_applied_in_steps_and_later_pushes_after_it() -> None:
    w = Wired()
    e = w.reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
    w.reg.apply(e, [(1, key(NS[0], i), "l1") for i in range(3)])
    w.deliver()
    big = [key(NS[0], i) for i in range(100, 100 + 5 * WALK_STEP)]
    replace_state(w.reg, e, {"l1": big, "disk": big[:10]})
    w.reg.apply(e, [(2, big[0], "l1"), (1, key(NS[0], 0), "disk")])
    replaced, later = w.pushes
    assert isinstance(replaced, proto.WorkerReplaced) and isinstance(later, proto.IndexEvents)
    w.pushes.clear()
    f = w.follower
    old_hashes, new_hashes = [h(i) for i in range(3)], [h(i) for i in range(101, 110)]

    async def run() -> list[tuple]:
        seen = []  # what a query answers at each turn while the state goes in
        f._take(replaced)
        f._take(later)
        # A tick behind every push received confirms nothing and loses nothing.
        f._pinged[1] = 1.0
        f._on_tick(proto.IndexTick(1, f.epoch, later.seq))
        assert not f._resync.is_set() and f._confirmed < 1.0
        while f._replacing is not None:
            seen.append((f.index.prefix_counts(old_hashes), f.index.prefix_counts(new_hashes)))
            await asyncio.sleep(0)
        return seen

    seen = asyncio.run(run())
    assert len(seen) >= 5  # a turn per step at least: other requests ran between
    f._pinged[2] = 2.0
    f._on_tick(proto.IndexTick(2, f.epoch, later.seq))
    assert f._confirmed == 2.0  # all in: confirmed
    # Until it was all in, queries saw the old state; then the new one, and the events
    # that followed it.
    assert all(old[0][3] == 3 and new[0][3] == 0 for old, new in seen)
    assert not f._resync.is_set(), f._resync_reason
    assert f.seq == later.seq
    w.same(old_hashes)
    w.same(new_hashes)
    w.same([h(0)])
    assert f.index.prefix_counts([h(100)]) == [("a", 1, 1, 1, 0)]  # out of l1 after it


def test_a_tick_past_the_pushes_received_during_a_replacement_is_a_gap() -> None:
    w = Wired()
    e = w.reg.register("a", 0, 1, [NS[0]], "", 1.0, None)
    w.deliver()
    replace_state(w.reg, e, {"l1": [key(NS[0], i) for i in range(2 * WALK_STEP)]})
    (replaced,) = w.pushes
    f = w.follower

    async def run() -> None:
        f._take(replaced)
        f._pinged[1] = 1.0
        f._on_tick(proto.IndexTick(1, f.epoch, replaced.seq + 1))  # one never received

    asyncio.run(run())
    assert f._resync.is_set() and f._resync_reason.startswith("gap")
