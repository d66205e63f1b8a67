"""Audit of the lookup-server's index (services/lookup/index.py) against a reference
model written from the spec alone: per worker, a set of chunk ints per tier; a
prefix is the leading run of hashes a worker holds in any tier (L1: the run held in
L1 inside it), best over its namespaces, min over an instance's ranks, 0 for an
instance missing a rank.

Random admits, evicts (duplicates, unknown keys), leaves, rejoins of a worker id with
another namespace (a restart under a new identity), whole-state replacements (at once
and in steps, some given up midway) and sweeps in progress, interleaved across several
instances and ranks; every answer is compared, for prompts with gaps in the middle
and holders that differ per chunk. The registry-vs-index test (unit/lookup/test_index)
shares prefix_counts with the index, so it cannot catch a fault there: this one can.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import pytest

from kvmesh.common.chunk_holders import WALK_STEP, pack_ints
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import controller as proto
from kvmesh.services.lookup.follower import IndexFollower
from kvmesh.services.lookup.index import ChunkIndex

NS = ["0123456789abcdef", "fedcba9876543210", "00000000000000ff", "0f0f0f0f0f0f0f0f"]
TIERS = ["l1", "disk", "remote", "weird"]
N_CHUNKS = 10


def h(i: int) -> bytes:
    return (i * 0x9E3779B97F4A7C15 & (1 << 64) - 1).to_bytes(8, "big") * 2


def folded(ns: str, i: int) -> int:
    return (int.from_bytes(h(i)[8:], "big") ^ int(ns, 16)) & proto.CHUNK_INT_MASK


@dataclass
class RefWorker:
    instance: str
    rank: int
    world: int
    namespaces: list[str]
    tiers: dict[str, set[int]] = field(default_factory=dict)


class Reference:
    def __init__(self) -> None:
        self.workers: dict[str, RefWorker] = {}

    def run(self, w: RefWorker, hashes: list[bytes]) -> tuple[int, int]:
        best = (0, 0)
        held_any = set().union(*w.tiers.values()) if w.tiers else set()
        held_l1 = w.tiers.get("l1", set())
        for ns in w.namespaces:
            n = n_l1 = 0
            for hh in hashes:
                k = (int.from_bytes(hh[8:], "big") ^ int(ns, 16)) & proto.CHUNK_INT_MASK
                if k not in held_any:
                    break
                if n == n_l1 and k in held_l1:
                    n_l1 += 1
                n += 1
            best = max(best, (n, n_l1))
        return best

    def prefix_counts(self, hashes: list[bytes], instance: str = "") -> list[tuple]:
        by_inst: dict[str, list[RefWorker]] = {}
        for w in self.workers.values():
            if not instance or w.instance == instance:
                by_inst.setdefault(w.instance, []).append(w)
        out = []
        for inst, ws in by_inst.items():
            world = max(w.world for w in ws)
            ranks = {w.rank for w in ws}
            runs = [self.run(w, hashes) for w in ws]
            full = ranks >= set(range(world))
            chunks = min(r[0] for r in runs) if full else 0
            l1 = min(r[1] for r in runs) if full else 0
            out.append((inst, world, len(ws), chunks, l1))
        out.sort(key=lambda t: (-t[3], -t[4], t[0]))
        return out


def prompts(rnd: random.Random) -> list[list[bytes]]:
    full = [h(i) for i in range(N_CHUNKS)]
    gap = [h(i) for i in range(N_CHUNKS) if i != 3]  # a prompt whose chunk 3 is another
    shuffled = full[:]
    rnd.shuffle(shuffled)
    return [full, gap, shuffled, full[:1], []]


@pytest.mark.parametrize("seed", range(6))
def test_index_answers_like_a_reference_model(seed: int) -> None:
    rnd = random.Random(seed)
    index, ref = ChunkIndex(), Reference()
    for step in range(1500):
        inst = rnd.choice("abc")
        world = 2 if inst != "c" else 1
        rank = rnd.randrange(world)
        wid = f"{inst}/{rank}"
        op = rnd.random()
        if wid not in ref.workers or op < 0.04:
            # A (re)join; a known id may come back with other namespaces (a restart
            # under a new identity that keeps its id): its chunks stay, as they are.
            namespaces = rnd.sample(NS, rnd.randrange(1, 3))
            index.join(proto.IndexWorker(wid, inst, rank, world, namespaces))
            old = ref.workers.get(wid)
            ref.workers[wid] = RefWorker(inst, rank, world, namespaces, old.tiers if old else {})
        elif op < 0.08:
            index.leave(wid)
            del ref.workers[wid]
        elif op < 0.14:
            w = ref.workers[wid]
            tiers = {
                t: {folded(rnd.choice(w.namespaces), rnd.randrange(N_CHUNKS)) for _ in range(8)}
                for t in rnd.sample(TIERS, rnd.randrange(0, 3))
            }
            raw = {t: pack_ints(sorted(s)) for t, s in tiers.items()}
            steps = index.replace_steps(wid, raw)
            give_up = rnd.random() < 0.3
            for i, _ in enumerate(steps):
                # Mid-replacement, queries still see the old state; so does a sweep.
                index.sweep(budget=rnd.randrange(1, 5))
                for p in prompts(rnd)[:2]:
                    assert index.prefix_counts(p) == ref.prefix_counts(p), f"step {step}"
                if give_up and i == 0:
                    break
            steps.close()
            if not give_up or not any(tiers.values()):
                w.tiers = {t: set(s) for t, s in tiers.items() if s}
        else:
            w = ref.workers[wid]
            kind = proto.EventKind.ADMIT if rnd.random() < 0.65 else proto.EventKind.EVICT
            tier = rnd.choice(TIERS)
            ns = rnd.choice(NS)  # sometimes a namespace not the worker's: never found
            ints = [folded(ns, rnd.randrange(N_CHUNKS)) for _ in range(rnd.randrange(1, 6))]
            ints += ints[:1]  # a duplicate in the batch
            if kind == proto.EventKind.EVICT and rnd.random() < 0.3:
                ints.append(rnd.randrange(1 << 59))  # never admitted
            index.apply(index.worker(wid), kind, tier, ints)
            held = w.tiers.setdefault(tier, set())
            if kind == proto.EventKind.ADMIT:
                held.update(ints)
            else:
                held.difference_update(ints)
            if not held:
                del w.tiers[tier]
        if rnd.random() < 0.3:
            index.sweep(budget=rnd.randrange(1, 20))
        for p in prompts(rnd):
            assert index.prefix_counts(p) == ref.prefix_counts(p), f"step {step}"
            one = rnd.choice("abcz")
            assert index.prefix_counts(p, one) == ref.prefix_counts(p, one), f"step {step}"
    while not index.sweep(budget=7):
        pass
    for p in prompts(rnd):
        assert index.prefix_counts(p) == ref.prefix_counts(p)
    # Swept: every bit left belongs to a live worker, and it is one the model holds.
    assert index.slots == len(index.workers) == len(ref.workers)
    for wid, iw in index.workers.items():
        expect = {t: s for t, s in ref.workers[wid].tiers.items()}
        for tier in TIERS:
            bit = iw.bit(tier)
            got = {k for k, m in index.holders.items() if m & bit}
            assert got == expect.get(tier, set()), (wid, tier)
    live = 0
    for iw in index.workers.values():
        live |= iw.slot_bits
    assert all(m and m & ~live == 0 for m in index.holders.values())


# -- the follower: large pushes do not hold the loop -------------------------------------------


def _follower(index: ChunkIndex, epoch: str = "e", seq: int = 0) -> IndexFollower:
    f = IndexFollower(
        "tcp://127.0.0.1:1", Metrics(), ping_s=0.1, max_staleness_s=1.0,
        request_timeout_s=0.5, snapshot_timeout_s=1.0,
    )  # fmt: skip
    f.epoch, f.seq, f.index, f._following = epoch, seq, index, True
    return f


def test_a_large_event_batch_is_applied_in_steps_and_later_pushes_after_it() -> None:
    # 65,536 admits into an index of millions held every request for 0.1-0.3 s when
    # applied at once.
    index = ChunkIndex()
    index.join(proto.IndexWorker("a/0", "a", 0, 1, [NS[0]]))
    f = _follower(index)
    n = 5 * WALK_STEP
    admitted = [folded(NS[0], i) for i in range(n)]
    runs = [
        (proto.EventKind.ADMIT, "l1", pack_ints(admitted)),
        (proto.EventKind.EVICT, "l1", pack_ints(admitted[1:3])),
    ]
    big = proto.IndexEvents(0, "e", 1, "a/0", runs)
    later = proto.IndexEvents(
        0, "e", 2, "a/0", [(proto.EventKind.ADMIT, "disk", pack_ints(admitted[1:2]))]
    )
    hashes = [h(i) for i in range(4)]

    async def run() -> list[int]:
        seen = []  # chunks the index holds at each turn of the loop while the batch goes in
        f._take(big)
        f._take(later)
        f._pinged[1] = 1.0  # a tick behind every push received confirms nothing yet
        f._on_tick(proto.IndexTick(1, "e", later.seq))
        assert not f._resync.is_set() and f._confirmed < 1.0
        while f._replacing is not None:
            seen.append(index.chunks)
            await asyncio.sleep(0)
        return seen

    seen = asyncio.run(run())
    assert len(seen) >= 5, seen  # a turn per step at least: other requests ran between
    assert seen[0] < n and max(seen) <= n  # in steps, not all at once
    assert not f._resync.is_set(), f._resync_reason
    assert f.seq == later.seq and f._held is None
    # The tick answered during the steps confirms the index once they are in, not
    # only the next ping's (a stream of large batches would otherwise leave it stale).
    assert f._confirmed == 1.0
    f._pinged[2] = 2.0
    f._on_tick(proto.IndexTick(2, "e", later.seq))
    assert f._confirmed == 2.0
    assert index.chunks == n - 1  # 2 evicted, 1 of them back on disk
    # 1 and 2 out of l1, 1 back on disk, 2 gone: the run stops at 2, its l1 part at 1.
    assert index.prefix_counts(hashes) == [("a", 1, 1, 2, 1)]
    assert index.prefix_counts([h(n - 1)]) == [("a", 1, 1, 1, 1)]  # the batch's last
    assert f.stats.events._value.get() == n + 3


def test_a_batch_of_many_small_runs_yields_per_walk_step_chunks_not_per_run() -> None:
    index = ChunkIndex()
    index.join(proto.IndexWorker("a/0", "a", 0, 1, [NS[0]]))
    f = _follower(index)
    n = 3 * WALK_STEP
    runs = [(proto.EventKind.ADMIT, "l1", pack_ints([folded(NS[0], i)])) for i in range(n)]
    turns = 0

    async def run() -> None:
        nonlocal turns
        f._take(proto.IndexEvents(0, "e", 1, "a/0", runs))
        while f._replacing is not None:
            turns += 1
            await asyncio.sleep(0)

    asyncio.run(run())
    assert index.chunks == n and f.seq == 1
    assert 3 <= turns <= 5, turns  # one a step of WALK_STEP chunks, not 24,576


def test_a_tick_behind_the_pushes_held_is_a_resync_not_a_confirmation() -> None:
    index = ChunkIndex()
    index.join(proto.IndexWorker("a/0", "a", 0, 1, [NS[0]]))
    f = _follower(index)
    raw = pack_ints([folded(NS[0], i) for i in range(2 * WALK_STEP)])
    big = proto.IndexEvents(0, "e", 1, "a/0", [(proto.EventKind.ADMIT, "l1", raw)])
    later = proto.IndexEvents(0, "e", 2, "a/0", [(proto.EventKind.EVICT, "l1", raw[:8])])

    async def run() -> None:
        f._take(big)
        f._take(later)
        f._pinged[1] = 1.0
        # Sent after push 2 on the same ordered socket, yet at seq 1: the controller
        # went back.
        f._on_tick(proto.IndexTick(1, "e", 1))
        if f._replacing is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await f._replacing

    asyncio.run(run())
    assert f._resync.is_set() and f._resync_reason.startswith("diverged"), f._resync_reason
    assert f._confirmed < 1.0


def test_a_large_event_batch_for_an_unknown_worker_asks_for_a_resync() -> None:
    f = _follower(ChunkIndex())
    raw = pack_ints(range(2 * WALK_STEP))
    push = proto.IndexEvents(0, "e", 1, "nobody/0", [(proto.EventKind.ADMIT, "l1", raw)])

    async def run() -> None:
        f._take(push)
        assert f._replacing is not None  # stepped: the worker is looked up in its task
        await f._replacing

    asyncio.run(run())
    assert f._resync.is_set() and f._resync_reason.startswith("diverged")
    assert f._held is None and f.seq == 0


def test_a_snapshot_is_built_in_steps_of_walk_step_chunks() -> None:
    # 100,000 inserts a step into a dict of millions held every request for 0.1-0.4 s.
    n = 4 * WALK_STEP + 1
    worker = proto.IndexWorker("a/0", "a", 0, 1, [NS[0]])
    state = proto.IndexWorkerState(worker, {"l1": pack_ints(range(n)), "disk": pack_ints([1])})
    snap = proto.IndexSnapshotReply(1, "e", 0, [state])
    f = _follower(ChunkIndex())

    async def run() -> tuple[ChunkIndex, int]:
        turns = 0
        build = asyncio.ensure_future(f._build(snap))
        while not build.done():
            turns += 1
            await asyncio.sleep(0)
        return build.result(), turns

    index, turns = asyncio.run(run())
    assert index.chunks == n
    assert turns >= 5, turns
