"""The lookup-server index's sweep (services/lookup/index.py): each call touches a
bounded number of chunks whatever its budget and however many chunks the index holds
(a copy of every key in one call held every request up for 30-370 ms at 4M chunks),
no array of its key list grows past a segment (one array of 4M keys was
realloc-copied whole now and then, 4-13 ms a call), and sweeps interleaved with every
other change keep the index equal to a simple model: a retired slot's bits never
show, a slot is reused only once its bits are gone, chunks admitted during a sweep
keep theirs."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvmesh.common.chunk_holders import PrefixRow, pack_ints
from kvmesh.common.protocol import controller as proto
from kvmesh.services.lookup import index as index_mod
from kvmesh.services.lookup.index import SWEEP_STEP, ChunkIndex

# Keys in a segment of the index's key list (512 KiB): the most a resize may copy.
SEGMENT_KEYS = 65_536

NS = ["0123456789abcdef", "fedcba9876543210"]
TIERS = ["l1", "disk", "remote", "weird"]
ADMIT, EVICT = proto.EventKind.ADMIT, proto.EventKind.EVICT


class CountingDict(dict):
    """A holders dict that counts the keys each operation touches."""

    touched = 0

    def get(self, k, default=None):
        self.touched += 1
        return super().get(k, default)

    def __getitem__(self, k):
        self.touched += 1
        return super().__getitem__(k)

    def __setitem__(self, k, v):
        self.touched += 1
        super().__setitem__(k, v)

    def __delitem__(self, k):
        self.touched += 1
        super().__delitem__(k)

    def __contains__(self, k):
        self.touched += 1
        return super().__contains__(k)

    def __iter__(self) -> Iterator[int]:
        for k in super().__iter__():
            self.touched += 1
            yield k

    def keys(self):
        return list(iter(self))

    def items(self):
        return [(k, super(CountingDict, self).__getitem__(k)) for k in self]

    def values(self):
        return [v for _, v in self.items()]


def worker(wid: str, ns: str = NS[0]) -> proto.IndexWorker:
    inst, rank = wid.split("/")
    return proto.IndexWorker(wid, inst, int(rank), 1, [ns])


def sweep_counting(index: ChunkIndex, budget: int) -> list[int]:
    """Sweep to the end; the keys of holders each call touched."""
    holders = index._holders
    assert isinstance(holders, CountingDict)
    per_call = []
    for _ in range(100_000):
        holders.touched = 0
        done = index.sweep(budget)
        per_call.append(holders.touched)
        if done:
            return per_call
    raise AssertionError("the sweep never ends")


@pytest.mark.parametrize("budget", [10**9, 50_000, 100])
def test_no_sweep_call_touches_more_than_a_step_of_chunks_whatever_the_budget(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 25 * SWEEP_STEP
    index = ChunkIndex()
    index._holders = CountingDict()
    a, b = index.join(worker("a/0")), index.join(worker("b/0"))
    index.apply(a, ADMIT, "l1", list(range(n)))
    index.apply(b, ADMIT, "disk", list(range(0, n, 2)))
    index.leave("a/0")
    per_call = sweep_counting(index, budget)
    # get + set or delete per chunk: each call stays within a step however big the
    # index is (a copy of its keys touched all n at once).
    assert max(per_call) <= 2 * SWEEP_STEP, max(per_call)
    assert len(per_call) >= n // SWEEP_STEP
    assert index.chunks == n // 2 and index.slots == 1
    assert all(m == b.bit("disk") for m in index.holders.values())
    # Evictions: the walk that deletes the chunks no worker holds is bounded as well.
    monkeypatch.setattr(index_mod, "DEAD_FLOOR", 100)
    index.apply(b, EVICT, "disk", list(range(0, n, 2)))
    assert index.chunks == 0
    visited = []  # entries of the key list each call walked
    for _ in range(10_000):
        walking = index._walking
        before = len(walking if walking is not None else index._log)
        done = index.sweep(10**9)
        visited.append(before - len(index._walking if index._walking is not None else []))
        if done:
            break
    assert max(visited) <= SWEEP_STEP and len(visited) >= n // 2 // SWEEP_STEP, visited[:3]
    assert index._dead == 0 and not index._holders and not index._log  # all deleted


def key_arrays(log: object) -> list:
    """The arrays a key list (ChunkIndex._log or _walking) keeps its keys in."""
    return list(getattr(log, "_segments", [log]))


def test_no_array_of_the_key_list_grows_past_a_segment_at_any_size() -> None:
    """Growing (an admit, a walk putting back what it keeps) or cutting (each walk
    step) an array may realloc, and so copy, all of it: the array of every key took
    4-13 ms now and then at 3-4M chunks. Segments bound that copy whatever the size."""
    n = 3 * SEGMENT_KEYS + 5000
    index = ChunkIndex()
    a, b = index.join(worker("a/0")), index.join(worker("b/0"))
    keys = [folded(NS[0], i) for i in range(n)]
    for start in range(0, n, 8192):
        index.apply(a, ADMIT, "l1", keys[start : start + 8192])
        assert max(map(len, key_arrays(index._log))) <= SEGMENT_KEYS
    index.apply(b, ADMIT, "disk", keys[::3])
    assert len(index._log) == n
    index.leave("a/0")
    calls = 0
    while not index.sweep():
        calls += 1
        for log in (index._log, index._walking):
            if log is not None:
                assert max(map(len, key_arrays(log)), default=0) <= SEGMENT_KEYS, calls
    assert calls >= n // SWEEP_STEP
    assert len(index._log) == index.chunks == len(keys[::3])
    assert sorted(index._log) == sorted(keys[::3])


def test_a_worker_leaving_during_its_replacement_frees_its_slot_once() -> None:
    """Its old slot is retired by the leave; the replacement that ends after must not
    retire it again (by then a newcomer may hold it, whose bits a sweep would clear)
    and must give up its fresh slot."""
    index = ChunkIndex()
    a = index.join(worker("a/0"))
    index.apply(a, ADMIT, "l1", [1, 2])
    steps = index.replace_steps("a/0", {"l1": pack_ints(range(10, 10 + 3 * 8192))})
    next(steps)
    index.leave("a/0")
    while not index.sweep():
        pass
    b = index.join(worker("b/0"))
    assert b.slot == a.slot  # swept: a's old slot is free again
    index.apply(b, ADMIT, "disk", [1, 5])
    for _ in steps:  # the replacement ends, its worker gone
        pass
    while not index.sweep():
        pass
    assert index.holders == {1: b.bit("disk"), 5: b.bit("disk")}
    assert index.slots == 1
    c = index.join(worker("c/0"))
    assert c.slot != b.slot


# -- a randomized comparison with a model --------------------------------------------------


class Model:
    """Per live worker incarnation, its chunks per tier."""

    def __init__(self) -> None:
        self.tiers: dict[str, dict[str, set[int]]] = {}
        self.incarnation: dict[str, int] = {}


def folded(ns: str, i: int) -> int:
    return (i * 0x9E3779B97F4A7C15 & proto.CHUNK_INT_MASK) ^ int(ns, 16) & proto.CHUNK_INT_MASK


def leading(keys: list[int], held: set[int]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


def reference_prefix_counts(model: Model, keys: list[int], instance_id: str) -> list[PrefixRow]:
    """What the model says prefix_counts answers: each worker here is an instance of
    one rank, holding the leading keys it has in any tier, and in L1."""
    rows = []
    for wid, tiers in model.tiers.items():
        inst = wid.split("/")[0]
        if instance_id and inst != instance_id:
            continue
        held = set().union(*tiers.values())
        rows.append((inst, 1, 1, leading(keys, held), leading(keys, tiers.get("l1", set()))))
    rows.sort(key=lambda r: (-r[3], -r[4], r[0]))
    return rows


def check_prefix_counts(
    index: ChunkIndex, model: Model, keyspace: list[int], rnd: random.Random
) -> None:
    """Queries see exactly the live workers' chunks: no retired slot's bits, no dead
    chunk, whatever walk is in progress."""
    ns = int(NS[0], 16)
    for _ in range(3):
        keys: list[int] = []
        if model.tiers and rnd.random() < 0.8:  # runs of some length: one worker's keys
            held = sorted(set().union(*rnd.choice(list(model.tiers.values())).values()))
            rnd.shuffle(held)
            keys = held[: rnd.randrange(len(held) + 1)]
        keys += rnd.sample(keyspace, rnd.randrange(0, 3))
        hashes = [rnd.randbytes(8) + (k ^ ns).to_bytes(8, "big") for k in keys]
        instance_id = rnd.choice(["", "", "a", "b", "c", "d"])
        got = index.prefix_counts(hashes, instance_id)
        assert got == reference_prefix_counts(model, keys, instance_id), (keys, instance_id)


def check(index: ChunkIndex, model: Model) -> None:
    holders = index.holders
    assert set(index.workers) == set(model.tiers)
    assert index._dead == sum(not m for m in index._holders.values())
    assert index.chunks == len(holders) == len(list(holders))
    for wid, w in index.workers.items():
        assert index._slots[w.slot] == wid  # live: neither retired nor free
        for tier in TIERS:
            bit = w.bit(tier)
            got = {k for k, m in holders.items() if m & bit}
            assert got == model.tiers[wid].get(tier, set()), (wid, tier)
    slots = [w.slot for w in index.workers.values()]
    assert len(set(slots)) == len(slots)
    # What the sweep walks: every key in the dict, dead or not, exactly once (a key
    # missed would keep a retired slot's bits after its reuse).
    listed = list(index._log) + list(index._walking or [])
    assert len(listed) == len(set(listed))
    assert set(listed) == set(index._holders)
    # Its arrays: none empty or past a segment; the log's all full but its last.
    for log in (index._log, index._walking):
        if log is not None:
            sizes = [len(a) for a in key_arrays(log)]
            assert len(log) == sum(sizes) and all(0 < n <= index_mod.SEGMENT for n in sizes)
    assert all(len(a) == index_mod.SEGMENT for a in key_arrays(index._log)[:-1])


@pytest.mark.parametrize("seed", range(8))
def test_sweeps_interleaved_with_every_change_keep_the_index_equal_to_a_model(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small steps and an eager drop of deleted keys: walks span many changes.
    monkeypatch.setattr(index_mod, "SWEEP_STEP", 3)
    monkeypatch.setattr(index_mod, "DEAD_FLOOR", 4)
    # Tiny segments: admits and walk steps span several.
    monkeypatch.setattr(index_mod, "SEGMENT", 5)
    rnd = random.Random(seed)
    index, model = ChunkIndex(), Model()
    ids = ["a/0", "b/0", "c/0", "d/0"]
    keyspace = [folded(NS[0], i) for i in range(40)]
    # replacements in progress: (worker id, incarnation, its steps, its tiers)
    replacing: list[tuple[str, int, Iterator[None], dict[str, set[int]]]] = []
    incarnations = walks_seen = 0
    for step in range(1500):
        wid = rnd.choice(ids)
        op = rnd.random()
        if wid not in model.tiers:
            w = index.join(worker(wid))
            # A reused slot carries nothing of its last owner.
            assert not any(m & w.slot_bits for m in index.holders.values()), step
            incarnations += 1
            model.tiers[wid], model.incarnation[wid] = {}, incarnations
        elif op < 0.05:
            index.leave(wid)
            del model.tiers[wid], model.incarnation[wid]
        elif op < 0.1:
            tiers = {
                t: set(rnd.sample(keyspace, rnd.randrange(0, 25)))
                for t in rnd.sample(TIERS, rnd.randrange(0, 3))
            }
            raw = {t: pack_ints(sorted(s)) for t, s in tiers.items()}
            with monkeypatch.context() as m:
                m.setattr(index_mod, "WALK_STEP", 4)  # several steps a replacement
                steps = index.replace_steps(wid, raw)
                ended = next(steps, "ended") == "ended"  # all in one step: in already
            if ended:
                model.tiers[wid] = {t: set(s) for t, s in tiers.items() if s}
            else:
                replacing.append((wid, model.incarnation[wid], steps, tiers))
        elif op < 0.2 and replacing:
            rid, inc, steps, tiers = replacing.pop(rnd.randrange(len(replacing)))
            if rnd.random() < 0.25:
                steps.close()  # given up: nothing changes
            else:
                with monkeypatch.context() as m:
                    m.setattr(index_mod, "WALK_STEP", 4)
                    for _ in steps:
                        pass
                if model.incarnation.get(rid) == inc:
                    model.tiers[rid] = {t: set(s) for t, s in tiers.items() if s}
        else:
            kind = ADMIT if rnd.random() < 0.6 else EVICT
            tier = rnd.choice(TIERS)
            ints = rnd.sample(keyspace, rnd.randrange(1, 8))
            index.apply(index.worker(wid), kind, tier, ints)
            held = model.tiers[wid].setdefault(tier, set())
            if kind == ADMIT:
                held.update(ints)
            else:
                held.difference_update(ints)
            if not held:
                del model.tiers[wid][tier]
        if rnd.random() < 0.5:
            index.sweep(rnd.choice([1, 2, 50, 10**9]))
        walks_seen += index._walking is not None
        check(index, model)
        check_prefix_counts(index, model, keyspace, rnd)
    assert walks_seen > 300  # changes happened during walks, many
    for _, _, steps, _ in replacing:
        steps.close()
    for _ in range(10_000):
        if index.sweep(10**9):
            break
    check(index, model)
    check_prefix_counts(index, model, keyspace, rnd)
    live = 0
    for w in index.workers.values():
        live |= w.slot_bits
    assert all(m & ~live == 0 for m in index.holders.values())
    assert index.slots == len(index.workers)
