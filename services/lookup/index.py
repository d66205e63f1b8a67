"""The lookup-server's copy of the controller's registry: which worker holds which
chunk in which tier, enough to answer prefix counts (BestInstances, lookups by hashes)
and an instance's workers, without asking the controller.

Fed by the controller's index pushes (follower.py); keyed like the registry, by the
60-bit chunk int `(chunk hash ^ namespace id) & CHUNK_INT_MASK`, with `holders[chunk]`
a bitmask of TIER_BITS bits per worker slot (l1, disk, remote, other).

Memory: the holders dict is most of what there is per chunk (about 100 bytes: the key
int, the mask and the dict entry; ~108 with the key list below); unlike the registry
it keeps no per-worker set of chunks. The price is that a worker leaving (or
replacing its state) cannot clear its bits itself: its slot is retired instead.
Queries only read the bits of live workers' slots, so a retired slot's bits are
invisible at once, and `sweep` clears them in steps of at most SWEEP_STEP chunks
later (the follower runs it between requests); a retired slot is reused only once
swept.

A sweep can neither walk the dict itself in steps (a dict changed between two steps
cannot be iterated on) nor copy its keys (`list(holders)` of 4M keys held every
request up for 30-370 ms). So the index also lists its keys in `_log` (8 bytes a
chunk), which a sweep walks from the end, cutting off each step. It is a list of
fixed-size arrays, not one array: growing or cutting one array of millions of keys
may realloc-copy all of it (up to ~10 ms at 3M keys), one segment at most 512 KiB. A
chunk no worker holds any more keeps its key, with mask 0, until a walk passes it and
deletes both (a key deleted at once would stay listed, and be listed again if it came
back); a walk runs for that alone once such chunks pass a quarter of the others
(`_compaction_due`). The arrays and the dict of plain ints are nothing the garbage
collector walks (a list of 4M ints would add ~30 ms to each full collection; the
log's ~60 segments are nothing). Sharding the dict by key bits instead would have
made the pieces small too, but cost each lookup's walk over its chunks 25-40 % more.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvmesh.common.chunk_holders import (
    SLOT_MASK,
    TIER_BITS,
    WALK_STEP,
    PrefixRow,
    prefix_counts,
    slot_bits,
    tier_bit,
    unpack_ints,
)
from kvmesh.common.protocol import controller as proto

_RETIRED = ""  # a slot whose bits may linger: not reusable until swept
# Chunks a sweep call walks at most, whatever its budget: ~1 ms at 4M chunks.
SWEEP_STEP = 2048
# Chunks no worker holds, kept with mask 0 until a walk passes them: past a quarter of
# the chunks (~20 bytes a chunk then), and this many, a walk runs to delete them.
DEAD_FLOOR = 65_536
# Keys per segment of the key log (512 KiB): the most one call copies when an array
# grows or shrinks by realloc.
SEGMENT = 65_536


class UnknownWorker(KeyError):
    """A change for a worker the index does not know: the copy has diverged."""


@dataclass(slots=True, eq=False)
class IndexedWorker:
    info: proto.IndexWorker
    slot: int
    namespaces: list[int]

    def bit(self, tier: str) -> int:
        return tier_bit(self.slot, tier)

    @property
    def slot_bits(self) -> int:
        return slot_bits(self.slot)


class ChunkIndex:
    def __init__(self) -> None:
        # Mask 0: a chunk no worker holds (`_dead` of them), deleted when a walk passes.
        self._holders: dict[int, int] = {}
        self._dead = 0
        self.workers: dict[str, IndexedWorker] = {}
        self._slots: list[str | None] = []  # worker id, _RETIRED, or None (free)
        self._retired: list[int] = []
        # Each key of _holders exactly once, in no order: in _log, or while a walk is in
        # progress in _log or _walking (the entries it has still to visit, from the end).
        # New keys go to _log.
        self._log = _KeyLog()
        self._walking: _KeyLog | None = None
        # The walk in progress: the bits it clears and the slots it frees when done.
        self._drop = 0
        self._sweep_slots: list[int] = []

    # -- membership -----------------------------------------------------------------------
    def join(self, info: proto.IndexWorker) -> IndexedWorker:
        """Add a worker, or update one already known (its chunks stay)."""
        namespaces = [int(ns, 16) for ns in info.namespaces]
        w = self.workers.get(info.worker_id)
        if w is None:
            w = IndexedWorker(info, self._take_slot(info.worker_id), namespaces)
            self.workers[info.worker_id] = w
        else:
            w.info, w.namespaces = info, namespaces
        return w

    def leave(self, worker_id: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            self._retire(w.slot)

    def replace(self, worker_id: str, tiers: dict[str, bytes]) -> None:
        """The worker's chunks are exactly `tiers` now (replace_steps in one go)."""
        for _ in self.replace_steps(worker_id, tiers):
            pass

    def replace_steps(self, worker_id: str, tiers: dict[str, bytes]) -> Iterator[None]:
        """The worker's chunks become exactly `tiers`, WALK_STEP chunks a step: they go
        under a fresh slot and the worker moves to it when all are in (queries meanwhile
        see its old state), the old slot retired. Closed midway, the fresh slot is
        retired instead. UnknownWorker at once for a worker the index does not know."""
        return self._replace(self._worker(worker_id), tiers)

    def _replace(self, w: IndexedWorker, tiers: dict[str, bytes]) -> Iterator[None]:
        slot = self._take_slot(w.info.worker_id)
        done = False
        try:
            for tier, raw in tiers.items():
                bit, ints = tier_bit(slot, tier), unpack_ints(raw)
                for start in range(0, len(ints), WALK_STEP):
                    self._admit(bit, ints[start : start + WALK_STEP])
                    yield
            # A worker that left (or left and joined again) meanwhile has had its slot
            # retired already: retiring it twice would free it twice, the second time
            # from under its next owner. The fresh slot goes instead.
            if self.workers.get(w.info.worker_id) is w:
                self._retire(w.slot)
                w.slot, done = slot, True
        finally:
            if not done:
                self._retire(slot)

    def _take_slot(self, worker_id: str) -> int:
        for i, owner in enumerate(self._slots):
            if owner is None:
                self._slots[i] = worker_id
                return i
        self._slots.append(worker_id)
        return len(self._slots) - 1

    def _retire(self, slot: int) -> None:
        if self._slots[slot] == _RETIRED:
            return  # once: a second entry would free it again under its next owner
        self._slots[slot] = _RETIRED
        self._retired.append(slot)

    def _worker(self, worker_id: str) -> IndexedWorker:
        w = self.workers.get(worker_id)
        if w is None:
            raise UnknownWorker(worker_id)
        return w

    def worker(self, worker_id: str) -> IndexedWorker:
        """The worker, or UnknownWorker."""
        return self._worker(worker_id)

    def instance_workers(self, instance_id: str) -> list[proto.IndexWorker]:
        return [w.info for w in self.workers.values() if w.info.instance_id == instance_id]

    # -- chunks ---------------------------------------------------------------------------
    def apply(self, w: IndexedWorker, kind: int, tier: str, chunks: array | list[int]) -> None:
        if kind == proto.EventKind.ADMIT:
            self._admit(w.bit(tier), chunks)
            return
        holders, clear, died = self._holders, ~w.bit(tier), 0
        for k in chunks:
            m = holders.get(k)
            if m:
                m &= clear
                holders[k] = m
                died += not m  # listed still: deleted by the next walk
        self._dead += died

    def _admit(self, bit: int, chunks: array | list[int]) -> None:
        if not (isinstance(chunks, array) and chunks.typecode == "Q"):
            # A key that is no uint64 fails here, before any change: every key held
            # must be listed, or a sweep would miss it.
            chunks = array("Q", chunks)
        holders, fresh, revived = self._holders, [], 0
        listed = fresh.append
        for k in chunks:
            m = holders.get(k)
            if m is None:
                listed(k)
                holders[k] = bit
            elif m:
                holders[k] = m | bit
            else:  # listed still
                holders[k] = bit
                revived += 1
        self._log.extend(fresh)  # at once: ~30 % less than an append each
        self._dead -= revived

    @property
    def chunks(self) -> int:
        """Distinct chunks held (a retired slot's not yet swept included)."""
        return len(self._holders) - self._dead

    @property
    def holders(self) -> Mapping[int, int]:
        """Chunk → mask, of the chunks held (a retired slot's not yet swept included)."""
        return _Held(self)

    # -- queries --------------------------------------------------------------------------
    def prefix_counts(self, hashes: list[bytes], instance_id: str = "") -> list[PrefixRow]:
        """(instance id, world size, ranks known, chunks, l1 chunks) per instance (or just
        instance_id), most chunks first: the leading run of hashes every rank holds in
        any tier, and in L1. An instance missing a rank holds nothing. The controller's
        PrefixCounts, answered here."""
        workers = (
            (w.info.instance_id, w.info.world_size, w.slot, w.namespaces)
            for w in self.workers.values()
            if not instance_id or w.info.instance_id == instance_id
        )
        return prefix_counts(self._holders, hashes, workers)

    # -- cleanup --------------------------------------------------------------------------
    def sweep(self, budget: int = SWEEP_STEP) -> bool:
        """Clear retired slots' bits, walking at most min(budget, SWEEP_STEP) chunks a
        call; True once no retired slot is left (nor a walk due to delete dead chunks).

        A walk clears the slots retired before it began (their slots are free once it
        ends); chunks admitted meanwhile cannot carry their bits (no change is applied
        to a retired slot), and slots retired meanwhile wait for the next walk."""
        if self._walking is None:
            if not self._retired and not self._compaction_due():
                return True
            self._sweep_slots, self._retired = self._retired, []
            drop = 0
            for slot in self._sweep_slots:
                drop |= SLOT_MASK << (slot * TIER_BITS)
            # The entries to visit leave _log; what the walk keeps goes back, as new keys
            # do meanwhile (none carries a retired slot's bits). Taken from the end, the
            # step's entries are cut off in O(step): nothing O(chunks) when it ends.
            self._walking, self._log, self._drop = self._log, _KeyLog(), drop
        walking, keep = self._walking, []
        kept = keep.append
        step = walking.take(max(1, min(budget, SWEEP_STEP)))
        holders, drop, deleted = self._holders, self._drop, 0
        keep_bits = ~drop
        for k in step:
            m = holders.get(k)
            if m is None:
                continue  # (never: every key listed is held) not listed again
            if not m:
                del holders[k]  # held by none since the last walk: goes with its entry
                deleted += 1
            elif m & drop:
                m &= keep_bits
                if m:
                    holders[k] = m
                    kept(k)
                else:
                    del holders[k]
            else:
                kept(k)
        self._log.extend(keep)
        self._dead -= deleted
        if walking:
            return False
        self._walking, self._drop = None, 0
        for slot in self._sweep_slots:
            self._slots[slot] = None
        self._sweep_slots = []
        return not self._retired and not self._compaction_due()

    def _compaction_due(self) -> bool:
        dead = self._dead
        return dead > DEAD_FLOOR and dead * 4 > len(self._holders) - dead

    @property
    def slots(self) -> int:
        """Slots in use or waiting for a sweep (bits per chunk mask / TIER_BITS)."""
        return sum(owner is not None for owner in self._slots)


class _KeyLog:
    """Chunk keys as arrays of SEGMENT keys, all full but the last: keys are added to
    the last (or a new one) and taken from the last, so no call reallocs, and so
    copies, more than one segment, however many keys there are."""

    __slots__ = ("_len", "_segments")

    def __init__(self) -> None:
        self._segments: list[array] = []  # none empty
        self._len = 0

    def extend(self, keys: list[int]) -> None:
        segments, i, n = self._segments, 0, len(keys)
        while i < n:
            if segments and len(segments[-1]) < SEGMENT:
                tail = segments[-1]
            else:
                tail = array("Q")
                segments.append(tail)
            room = SEGMENT - len(tail)
            if i == 0 and n <= room:
                tail.fromlist(keys)  # the usual case: no slice copied
            else:
                tail.fromlist(keys[i : i + room])
            i += room
        self._len += n

    def take(self, n: int) -> array:
        """Up to n keys, removed from the end."""
        segments, out = self._segments, None
        while n > 0 and segments:
            tail = segments[-1]
            start = max(0, len(tail) - n)
            if start:
                part = tail[start:]
                del tail[start:]
            else:
                part = segments.pop()
            out = part if out is None else out + part
            n -= len(part)
        if out is None:
            return array("Q")
        self._len -= len(out)
        return out

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for segment in self._segments:
            yield from segment


class _Held(Mapping[int, int]):
    """A ChunkIndex's holders without its dead chunks (mask 0): for reading it, in
    tests and tools; the index's own hot paths read the dict."""

    __slots__ = ("_index",)

    def __init__(self, index: ChunkIndex) -> None:
        self._index = index

    def __getitem__(self, k: int) -> int:
        m = self._index._holders[k]
        if not m:
            raise KeyError(k)
        return m

    def __iter__(self) -> Iterator[int]:
        return (k for k, m in self._index._holders.items() if m)

    def __len__(self) -> int:
        return self._index.chunks
