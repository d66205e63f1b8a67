"""The cluster registry: instance → worker → tier → chunks, and chunk → holders.

Sized for tens of millions of chunks, so a chunk is not its 49-character key string
(~100 bytes as a Python str) but a 60-bit int folded from it: the low 60 bits of the
chunk hash XOR the namespace id. A 60-bit int is a 32-byte object; two keys folding to
the same int (about 4e-5 odds among 10M keys) can only make a lookup name a peer that
then misses, which the P2P reader treats as a miss (it checks key and checksum).

`holders[chunk]` is a bitmask with TIER_BITS bits per worker slot (l1, disk, remote,
other), so "who holds this in L1" is a mask test and a longest-prefix lookup is a
running AND over the keys. Each worker also keeps one set per tier of its chunk ints
(the same int objects), so dropping a worker costs O(its chunks), not O(all).

Nothing here walks a worker's chunks in one go on the caller's event loop: a million
chunks cost 0.1-0.4 s to pack and ~1 s to parse from key strings (3 s before the C
fold and the steps), long enough to miss other workers' heartbeats. A worker that
leaves or is replaced gives up its slot, whose bits `sweep` clears a step at a time
before the slot is given out again (lookups only read the slots of workers present);
a full state is parsed under a fresh slot a step at a time (`replace_steps`) and takes
effect at once when complete; snapshots are packed a step at a time (`pack_workers`).

Every change is also told to `sink` when one is set (index_feed.py, which pushes them
to the lookup-servers' copies): a worker (re)registered or gone, a worker's state
replaced, and each event batch as runs of chunk ints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from kvmesh.common.chunk_holders import (
    TIER_BITS,
    WALK_STEP,
    PrefixRow,
    chunk_int,
    chunk_ints,
    pack_ints,
    prefix_counts,
    slot_bits,
    tier_bit,
    unpack_ints,
)
from kvmesh.common.keys import NS_ID_HEX_LEN

SNAPSHOT_VERSION = 1


@dataclass(slots=True, eq=False)
class WorkerEntry:
    worker_id: str
    instance_id: str
    rank: int
    world_size: int
    namespaces: list[str]
    p2p_endpoint: str
    heartbeat_s: float
    slot: int
    last_seen: float
    peer: bytes | None = None  # its ROUTER routing id; None until it (re)registers
    last_seq: int = 0
    restored: bool = False
    resync_sent: float = 0.0  # monotonic time of a pending Resync, 0 = none pending
    tiers: dict[str, set[int]] = field(default_factory=dict)
    lookup_endpoint: str = ""
    state_gen: int = 0  # bumped by each full state begun (replace_steps)
    # Event batches that arrived while a full state is applied (None: none is).
    held: list[Any] | None = None
    held_overflow: bool = False
    held_bytes: int = 0  # what `held` costs in memory, estimated (handlers.held_cost)

    def bit(self, tier: str) -> int:
        return tier_bit(self.slot, tier)

    @property
    def slot_bits(self) -> int:
        return slot_bits(self.slot)

    def counts(self) -> dict[str, int]:
        return {tier: len(keys) for tier, keys in self.tiers.items()}


# (kind, tier, chunk ints): consecutive events of one kind in one tier.
Run = tuple[int, str, list[int]]


_HEX = frozenset("0123456789abcdef")


def is_namespace_id(ns: str) -> bool:
    """A KeyNamespace id as the engines write it: NS_ID_HEX_LEN lower-case hex digits."""
    return len(ns) == NS_ID_HEX_LEN and _HEX.issuperset(ns)


class RegistrySink(Protocol):
    """Told of every registry change, after it is made."""

    @property
    def active(self) -> bool: ...  # False: nobody listens, runs need not be built
    def joined(self, entry: WorkerEntry) -> None: ...
    def left(self, worker_id: str) -> None: ...
    def replaced(self, entry: WorkerEntry, tiers: dict[str, bytes]) -> None: ...
    def events(self, entry: WorkerEntry, runs: list[Run]) -> None: ...


class _SnapWorker(msgspec.Struct, array_like=True):
    worker_id: str
    instance_id: str
    rank: int
    world_size: int
    namespaces: list[str]
    p2p_endpoint: str
    heartbeat_s: float
    last_seq: int
    tiers: dict[str, bytes]  # tier → little-endian uint64 chunk ints
    lookup_endpoint: str = ""


class Snapshot(msgspec.Struct, array_like=True):
    version: int
    saved_at: float
    workers: list[_SnapWorker]


# (worker, its last_seq when taken, tier → packed chunk ints): Registry.pack_workers
PackedWorker = tuple[WorkerEntry, int, dict[str, bytes]]


def _snap_worker(e: WorkerEntry, last_seq: int, tiers: dict[str, bytes]) -> _SnapWorker:
    return _SnapWorker(
        e.worker_id,
        e.instance_id,
        e.rank,
        e.world_size,
        e.namespaces,
        e.p2p_endpoint,
        e.heartbeat_s,
        last_seq,
        tiers,
        e.lookup_endpoint,
    )


def encode_snapshot(parts: list[PackedWorker]) -> bytes:
    workers = [_snap_worker(*p) for p in parts]
    return msgspec.msgpack.encode(Snapshot(SNAPSHOT_VERSION, time.time(), workers))


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerEntry] = {}
        self.holders: dict[int, int] = {}
        self._slots: list[WorkerEntry | None] = []
        # slot → the sets of chunks that may still carry its bits (sweep clears them)
        self._retired: dict[int, list[set[int]]] = {}
        self.bad_keys = 0
        self.sink: RegistrySink | None = None

    # -- membership ---------------------------------------------------------------------
    def register(
        self,
        instance_id: str,
        rank: int,
        world_size: int,
        namespaces: list[str],
        p2p_endpoint: str,
        heartbeat_s: float,
        peer: bytes | None,
        lookup_endpoint: str = "",
    ) -> WorkerEntry:
        """Add a worker, or refresh one already known (a reconnect, or one restored
        from the snapshot): its chunks stay until its FullState replaces them."""
        worker_id = f"{instance_id}/{rank}"
        now = time.monotonic()
        entry = self.workers.get(worker_id)
        if entry is None:
            entry = WorkerEntry(
                worker_id,
                instance_id,
                rank,
                world_size,
                list(namespaces),
                p2p_endpoint,
                heartbeat_s,
                self._free_slot(),
                now,
            )
            self._slots[entry.slot] = entry
            self.workers[worker_id] = entry
        entry.world_size, entry.namespaces = world_size, list(namespaces)
        entry.p2p_endpoint, entry.heartbeat_s = p2p_endpoint, heartbeat_s
        entry.lookup_endpoint = lookup_endpoint
        entry.peer, entry.last_seen, entry.restored = peer, now, False
        entry.last_seq, entry.resync_sent = 0, 0.0
        if self.sink is not None:
            self.sink.joined(entry)
        return entry

    def _free_slot(self) -> int:
        for i, e in enumerate(self._slots):
            if e is None and i not in self._retired:
                return i
        self._slots.append(None)
        return len(self._slots) - 1

    def drop(self, worker_id: str) -> int:
        """Forget a worker and its chunks; returns how many chunk copies went. Its
        bits are cleared by `sweep` (a step of it now)."""
        entry = self.workers.pop(worker_id, None)
        if entry is None:
            return 0
        n = sum(len(keys) for keys in entry.tiers.values())
        self._slots[entry.slot] = None
        self._retire(entry.slot, list(entry.tiers.values()))
        entry.tiers = {}
        if self.sink is not None:
            self.sink.left(worker_id)
        return n

    def _retire(self, slot: int, sets: list[set[int]]) -> None:
        self._retired.setdefault(slot, []).extend(sets)
        self.sweep(WALK_STEP)

    def sweep(self, budget: int = WALK_STEP) -> bool:
        """Clear up to `budget` chunks' bits of retired slots; True when none is left
        (their slots are free again)."""
        holders = self.holders
        while self._retired and budget > 0:
            slot, sets = next(iter(self._retired.items()))
            keep = ~slot_bits(slot)
            while sets and budget > 0:
                keys = sets[-1]  # no longer any worker's: emptied as it is cleared
                for _ in range(min(budget, len(keys))):
                    k = keys.pop()
                    m = holders.get(k, 0) & keep
                    if m:
                        holders[k] = m
                    else:
                        holders.pop(k, None)
                    budget -= 1
                if not keys:
                    sets.pop()
            if not sets:
                del self._retired[slot]
        return not self._retired

    # -- events -------------------------------------------------------------------------
    def apply(self, entry: WorkerEntry, events: list[tuple[int, str, str]]) -> None:
        """Apply (kind, key, tier) events: kind 1 admit, 2 evict. A bad key is skipped
        and counted."""
        holders, tiers = self.holders, entry.tiers
        sink = self.sink if self.sink is not None and self.sink.active else None
        runs: list[Run] = []
        run: list[int] = []
        run_kind, run_tier = 0, ""
        for kind, key, tier in events:
            try:
                k = chunk_int(key)
            except ValueError:
                self.bad_keys += 1
                continue
            if sink is not None:
                if kind != run_kind or tier != run_tier:
                    run, run_kind, run_tier = [], kind, tier
                    runs.append((kind, tier, run))
                run.append(k)
            bit = entry.bit(tier)
            keys = tiers.get(tier)
            if keys is None:
                keys = tiers[tier] = set()
            if kind == 1:
                holders[k] = holders.get(k, 0) | bit
                keys.add(k)
            elif k in keys:
                keys.discard(k)
                m = holders.get(k, 0) & ~bit
                if m:
                    holders[k] = m
                else:
                    del holders[k]
        if sink is not None and runs:
            sink.events(entry, runs)

    def replace_steps(self, entry: WorkerEntry, tiers: dict[str, list[str]]) -> Iterator[None]:
        """Make the worker's chunks exactly `tiers` (key strings), WALK_STEP keys per step.

        The new chunks go under a fresh slot, and the worker moves to it only when all
        are in, so a lookup meanwhile sees the old state; the old slot is retired. The
        caller holds the worker's events back until the last step (they follow the
        state). Closed early, or its worker gone or given another state meanwhile, it
        stops and its partial state is retired. Bad keys are skipped and counted.
        """
        entry.state_gen += 1  # now: a state begun earlier stops at its next step
        return self._replace(entry, tiers, entry.state_gen)

    def _replace(self, entry: WorkerEntry, tiers: dict[str, list[str]], gen: int) -> Iterator[None]:
        slot = self._free_slot()
        self._slots[slot] = entry  # taken: lookups read only the slots of entry.slot
        new: dict[str, set[int]] = {}
        packed: dict[str, list[bytes]] | None = {} if self._sink_active() else None
        holders, done = self.holders, False
        try:
            for tier, keys in tiers.items():
                bit, ints = tier_bit(slot, tier), new.setdefault(tier, set())
                for start in range(0, len(keys), WALK_STEP):
                    step, bad = chunk_ints(keys[start : start + WALK_STEP])
                    self.bad_keys += bad
                    for k in step:
                        holders[k] = holders.get(k, 0) | bit
                    ints.update(step)
                    if packed is not None:
                        packed.setdefault(tier, []).append(pack_ints(step))
                    yield
                    if self.workers.get(entry.worker_id) is not entry or entry.state_gen != gen:
                        return
            old, old_sets = entry.slot, list(entry.tiers.values())
            entry.slot, entry.tiers = slot, {t: ints for t, ints in new.items() if ints}
            self._slots[old] = None
            self._retire(old, old_sets)
            done = True
        finally:
            if not done:
                self._slots[slot] = None
                self._retire(slot, list(new.values()))
        if self.sink is not None and self.sink.active:
            if packed is None:  # the first subscriber came meanwhile: pack it all now
                packed = {t: [pack_ints(keys)] for t, keys in entry.tiers.items()}
            self.sink.replaced(entry, {t: b"".join(packed[t]) for t in entry.tiers})

    def _sink_active(self) -> bool:
        return self.sink is not None and self.sink.active

    # -- lookups ------------------------------------------------------------------------
    def locate(self, keys: list[str], exclude_instance: str) -> tuple[WorkerEntry, int] | None:
        """The P2P-serving worker (not of exclude_instance) whose L1 holds the longest
        run of keys from the first, with that run's length."""
        if not keys:
            return None
        try:
            first = self.holders.get(chunk_int(keys[0]), 0)
        except ValueError:
            return None
        cand = first & self._l1_servers(exclude_instance)
        if not cand:
            return None
        count = 1
        holders = self.holders
        for key in keys[1:]:
            try:
                m = cand & holders.get(chunk_int(key), 0)
            except ValueError:
                break
            if not m:
                break
            cand, count = m, count + 1
        slot = (cand & -cand).bit_length() - 1  # lowest set bit → its slot
        entry = self._slots[slot // TIER_BITS]
        assert entry is not None
        return entry, count

    def _l1_servers(self, exclude_instance: str) -> int:
        # Recomputed per lookup: a handful of workers, cheaper than keeping it in sync.
        mask = 0
        for e in self.workers.values():
            if e.p2p_endpoint and e.instance_id != exclude_instance:
                mask |= e.bit("l1")
        return mask

    def prefix_counts(self, hashes: list[bytes], instance_id: str = "") -> list[PrefixRow]:
        """(instance id, world size, ranks registered, chunks, l1 chunks) per instance
        (or just instance_id), most chunks first: the leading run of hashes that every
        rank holds, in any tier and in L1. A rank not registered holds nothing."""
        workers = (
            (e.instance_id, e.world_size, e.slot, [int(ns, 16) for ns in e.namespaces])
            for e in self.workers.values()
            if not instance_id or e.instance_id == instance_id
        )
        return prefix_counts(self.holders, hashes, workers)

    def chunks_total(self) -> int:
        return len(self.holders)

    # -- snapshot -----------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The registry as bytes (msgpack): workers and their chunk ints per tier."""
        parts: list[PackedWorker] = []
        for _ in self.pack_workers(parts):
            pass
        return encode_snapshot(parts)

    def pack_workers(self, out: list[PackedWorker]) -> Iterator[None]:
        """Append (worker, its last_seq, its packed chunk ints per tier) to `out` for
        each worker present now, WALK_STEP chunks per step. A worker's chunks and last_seq
        are taken together (a copy of its sets: ~30 ms per million) and packed from
        that copy, so changes between steps do not tear it; a worker that leaves
        meanwhile is packed as it is when its turn comes (no chunks), which keeps the
        updates that follow a snapshot applicable to it."""
        for e in list(self.workers.values()):
            taken = {t: list(keys) for t, keys in e.tiers.items()}
            last_seq = e.last_seq
            tiers: dict[str, bytes] = {}
            for tier, ints in taken.items():
                parts = []
                for start in range(0, len(ints), WALK_STEP):
                    parts.append(pack_ints(ints[start : start + WALK_STEP]))
                    yield
                tiers[tier] = b"".join(parts)
            out.append((e, last_seq, tiers))
            yield

    def load(self, data: bytes) -> int:
        """Replace the registry with a snapshot's; its workers count as restored (and
        seen now) until they register again or miss their heartbeats. Returns workers."""
        snap = msgspec.msgpack.decode(data, type=Snapshot)
        if snap.version != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {snap.version}, expected {SNAPSHOT_VERSION}")
        sink = self.sink
        self.__init__()
        self.sink = sink
        try:
            self._load(snap.workers)
        except BaseException:
            self.__init__()  # empty, not half a snapshot: the caller says it starts empty
            self.sink = sink
            raise
        return len(snap.workers)

    def _load(self, workers: list[_SnapWorker]) -> None:
        now = time.monotonic()
        for w in workers:
            # Read as hex ints by every later prefix count, of any worker.
            if not 0 <= w.rank < w.world_size or not all(map(is_namespace_id, w.namespaces)):
                raise ValueError(f"snapshot worker {w.worker_id[:80]!r}: bad rank or namespace")
            entry = WorkerEntry(
                w.worker_id,
                w.instance_id,
                w.rank,
                w.world_size,
                w.namespaces,
                w.p2p_endpoint,
                w.heartbeat_s,
                self._free_slot(),
                now,
                last_seq=w.last_seq,
                restored=True,
                lookup_endpoint=w.lookup_endpoint,
            )
            self._slots[entry.slot] = entry
            self.workers[entry.worker_id] = entry
            for tier, raw in w.tiers.items():
                bit, keys = entry.bit(tier), set(unpack_ints(raw))
                entry.tiers[tier] = keys
                for k in keys:
                    self.holders[k] = self.holders.get(k, 0) | bit
