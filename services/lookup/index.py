"""The lookup-server's copy of the controller's registry: which worker holds which
chunk in which tier, enough to answer prefix counts (BestInstances, lookups by hashes)
and an instance's workers, without asking the controller.

Fed by the controller's index pushes (follower.py); keyed like the registry, by the
60-bit chunk int `(chunk hash ^ namespace id) & CHUNK_INT_MASK`, with `holders[chunk]`
a bitmask of TIER_BITS bits per worker slot (l1, disk, remote, other).

Memory: the holders dict is all there is per chunk (about 100 bytes: the key int, the
mask and the dict entry); unlike the registry it keeps no per-worker set of chunks.
The price is that a worker leaving (or replacing its state) cannot clear its bits
itself: its slot is retired instead. Queries only read the bits of live workers'
slots, so a retired slot's bits are invisible at once, and `sweep` clears them in
bounded steps later (the server runs it between requests); a retired slot is reused
only once swept.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
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
        self.holders: dict[int, int] = {}
        self.workers: dict[str, IndexedWorker] = {}
        self._slots: list[str | None] = []  # worker id, _RETIRED, or None (free)
        self._retired: list[int] = []
        self._sweep_keys: list[int] | None = None
        self._sweep_pos = 0
        self._sweep_slots: list[int] = []
        self._sweep_keep = -1

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
        holders, done = self.holders, False
        try:
            for tier, raw in tiers.items():
                bit, ints = tier_bit(slot, tier), unpack_ints(raw)
                for start in range(0, len(ints), WALK_STEP):
                    for k in ints[start : start + WALK_STEP]:
                        holders[k] = holders.get(k, 0) | bit
                    yield
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
        holders, bit = self.holders, w.bit(tier)
        if kind == proto.EventKind.ADMIT:
            for k in chunks:
                holders[k] = holders.get(k, 0) | bit
            return
        clear = ~bit
        for k in chunks:
            m = holders.get(k)
            if m is not None:
                m &= clear
                if m:
                    holders[k] = m
                else:
                    del holders[k]

    @property
    def chunks(self) -> int:
        """Distinct chunks held (a retired slot's not yet swept included)."""
        return len(self.holders)

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
        return prefix_counts(self.holders, hashes, workers)

    # -- cleanup --------------------------------------------------------------------------
    def sweep(self, budget: int = 50_000) -> bool:
        """Clear retired slots' bits from up to `budget` chunks; True once none is left.

        A sweep works on the chunks present when it began: chunks added later cannot
        carry a retired slot's bits (no change is applied to a retired slot)."""
        if self._sweep_keys is None:
            if not self._retired:
                return True
            self._sweep_slots, self._retired = self._retired, []
            keep = 0
            for slot in self._sweep_slots:
                keep |= SLOT_MASK << (slot * TIER_BITS)
            self._sweep_keep = ~keep
            self._sweep_keys, self._sweep_pos = list(self.holders), 0
        keys, pos, keep, holders = self._sweep_keys, self._sweep_pos, self._sweep_keep, self.holders
        for k in keys[pos : pos + budget]:
            m = holders.get(k)
            if m is not None and m & ~keep:
                m &= keep
                if m:
                    holders[k] = m
                else:
                    del holders[k]
        self._sweep_pos = pos + budget
        if self._sweep_pos < len(keys):
            return False
        for slot in self._sweep_slots:
            self._slots[slot] = None
        self._sweep_keys, self._sweep_slots = None, []
        return not self._retired

    @property
    def slots(self) -> int:
        """Slots in use or waiting for a sweep (bits per chunk mask / TIER_BITS)."""
        return sum(owner is not None for owner in self._slots)
