"""The cache-server's store: values in memory under an LRU bound, spilled to disk if set.

- **Memory** holds `Entry`s in an OrderedDict in LRU order. Each entry counts its
  value, its meta, its key and a fixed overhead against `max_memory`; a put evicts the
  least recently used entries until it fits.
- **Spill** (optional, spill.py): an evicted entry is written to a file instead of
  being dropped, and a get that misses memory reads it back (checksum verified) and
  promotes it to memory again.
- **Checksums**: every entry keeps the xxh3-64 of its value, computed on put.
- **Listing** walks keys by hash bucket (`KeyIndex`), so a page costs one bucket's
  sort, never the whole key set, and a cursor survives concurrent puts and deletes.

All methods run on the server's event loop thread: no locks.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from kvmesh.common import offload
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.common.recent_keys import RecentKeys

ENTRY_OVERHEAD = 200  # bytes of bookkeeping counted per entry (dict slot, Entry, key object)
N_BUCKETS = 256
INTERNAL_PREFIX = "\x00"  # keys no client can name (e.g. the lm:// listener's)
# Why a get found nothing: never stored (or deleted), evicted for room (and not kept
# in a spill), its spill file failed verification, or the spill read passed its deadline.
MISS_REASONS = ("not_stored", "evicted", "checksum", "timeout")


class StoreError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True, eq=False)
class Entry:
    """One value. `value` is what gets sent back (bytes, or a received zmq.Frame kept to
    avoid a copy); `view` is its bytes as a memoryview."""

    value: Any
    view: memoryview
    meta: bytes
    checksum: int

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


def checksum_of(view: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(view)


def value_view(value: Any) -> memoryview:
    """The bytes of a value (bytes-like or zmq.Frame) as a flat byte view, no copy."""
    view = value.buffer if hasattr(value, "buffer") else memoryview(value)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


async def checksums_off_loop(values: list[Any]) -> list[int]:
    """The checksum of each value, computed on a thread: hashing large values on the
    event loop (~3 ms per 32 MiB here) would hold up every other request meanwhile.
    The xxhash module lets go of the GIL on large inputs."""
    return await offload.offload(lambda: [checksum_of(value_view(v)) for v in values])


def make_entry(
    value: Any, meta: bytes = b"", checksum: int | None = None, actual: int | None = None
) -> Entry:
    """An Entry over value (bytes-like or zmq.Frame); its checksum is computed here
    (unless `actual` says what it is) and, when the client gave one, compared
    (StoreError CHECKSUM_MISMATCH)."""
    view = value_view(value)
    if actual is None:
        actual = checksum_of(view)
    if checksum is not None and checksum != actual:
        raise StoreError(
            ErrorCode.CHECKSUM_MISMATCH,
            f"value checksum {actual:#018x} does not match the client's {checksum:#018x}",
        )
    return Entry(value, view, meta, actual)


def entry_cost(key: str, entry: Entry) -> int:
    return entry.nbytes + len(entry.meta) + len(key) + ENTRY_OVERHEAD


class KeyIndex:
    """Every key the store holds (memory or spill), split into hash buckets for paged,
    mutation-safe listing."""

    # Keys a page looks at before it returns (whole buckets, so possibly more): a
    # prefix that matches little must not walk the whole index in one request.
    SCAN_PER_PAGE = 16384

    def __init__(self) -> None:
        self._buckets: list[set[str]] = [set() for _ in range(N_BUCKETS)]

    @staticmethod
    def bucket(key: str) -> int:
        return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")) % N_BUCKETS

    def add(self, key: str) -> None:
        self._buckets[self.bucket(key)].add(key)

    def discard(self, key: str) -> None:
        self._buckets[self.bucket(key)].discard(key)

    def page(self, prefix: str, cursor: str, limit: int) -> tuple[list[str], str]:
        """Up to limit keys after cursor; the next cursor ("" when done). A page stops
        early, possibly empty, after SCAN_PER_PAGE keys looked at.

        A cursor is `"<bucket>:<last key returned>"`, or `"<bucket>:"` for the start
        of that bucket; ValueError if malformed.
        """
        start, after = 0, None
        if cursor:
            head, sep, after = cursor.partition(":")
            if not sep or not head.isdigit() or not 0 <= int(head) < N_BUCKETS:
                raise ValueError(f"malformed cursor {cursor[:60]!r}")
            start = int(head)
        out: list[str] = []
        examined = 0
        for b in range(start, N_BUCKETS):
            keys = sorted(
                k
                for k in self._buckets[b]
                if k.startswith(prefix)
                and not k.startswith(INTERNAL_PREFIX)
                and (after is None or b != start or k > after)
            )
            room = limit - len(out)
            if len(keys) > room:
                out.extend(keys[:room])
                return out, f"{b}:{out[-1]}"
            out.extend(keys)
            if len(out) == limit:
                return out, f"{b}:{out[-1]}" if b + 1 < N_BUCKETS else ""
            examined += len(self._buckets[b])
            if examined >= self.SCAN_PER_PAGE and b + 1 < N_BUCKETS:
                return out, f"{b + 1}:"
        return out, ""


class MemoryStore:
    """Bounded LRU of entries with an optional spill (see module doc)."""

    def __init__(
        self,
        max_memory: int,
        max_value_size: int,
        spill: Any | None = None,
        on_evict: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.max_memory = max_memory
        self.max_value_size = max_value_size
        self.spill = spill
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.index = KeyIndex()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.miss_reasons = dict.fromkeys(MISS_REASONS, 0)
        self.evictions = 0
        # Keys dropped for room, to tell "evicted" from "never stored" (bounded).
        self._evicted: RecentKeys[str] = RecentKeys()
        # Keys whose spill file just failed its checks, until their miss is counted.
        self._corrupt: set[str] = set()
        self._on_evict = on_evict
        if spill is not None:
            spill.on_forget = self._forget_spilled

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def keys_total(self) -> int:
        return len(self._entries) + (len(self.spill) if self.spill is not None else 0)

    # -- writes ---------------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> None:
        """Store entry under key (replacing any), evicting LRU entries to make room."""
        if entry.nbytes > self.max_value_size:
            raise StoreError(
                ErrorCode.VALUE_TOO_LARGE,
                f"value of {entry.nbytes} bytes exceeds max_value_size {self.max_value_size}",
            )
        cost = entry_cost(key, entry)
        if cost > self.max_memory:
            raise StoreError(ErrorCode.VALUE_TOO_LARGE, "value larger than max_memory")
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= entry_cost(key, old)
        if self.spill is not None:
            self.spill.discard(key)
        self._evicted.discard(key)
        self._corrupt.discard(key)
        self._make_room(cost)
        self._entries[key] = entry
        self.used_bytes += cost
        self.index.add(key)

    def _make_room(self, cost: int) -> None:
        entries = self._entries
        while entries and self.used_bytes + cost > self.max_memory:
            victim, old = entries.popitem(last=False)
            self.used_bytes -= entry_cost(victim, old)
            self.evictions += 1
            spilled = self.spill is not None and self.spill.submit(victim, old)
            if not spilled:
                self.index.discard(victim)
                self._evicted.add(victim)
            if self._on_evict is not None:
                self._on_evict(victim, spilled)

    def delete(self, key: str) -> bool:
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= entry_cost(key, old)
        in_spill = self.spill is not None and self.spill.discard(key)
        self._evicted.discard(key)  # deleted by a client: "not stored" from now on
        if old is None and not in_spill:
            return False
        self.index.discard(key)
        return True

    def _forget_spilled(self, key: str) -> None:
        """The spill dropped key (its own eviction, a failed write or a failed read)."""
        if key not in self._entries:
            self.index.discard(key)
            self._evicted.add(key)

    # -- reads ----------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return key in self._entries or (self.spill is not None and key in self.spill)

    def get_memory(self, key: str) -> Entry | None:
        """The entry if it is in memory (counted a use), else None; no hit/miss counted."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def needs_disk(self, key: str) -> bool:
        return key not in self._entries and self.spill is not None and key in self.spill

    async def read_spilled(self, key: str) -> Entry | None:
        """The entry read back from the spill (verified) and promoted to memory; None if
        it is gone or fails its checks. No hit/miss counted."""
        if self.spill is None or key not in self.spill:
            return self.get_memory(key)
        corrupt_before = self.spill.corrupt
        entry = await self.spill.read(key)
        if key in self._entries:  # put again while the file was read
            return self.get_memory(key)
        if entry is None and self.spill.corrupt > corrupt_before:
            self._corrupt.add(key)
            self._evicted.discard(key)  # deleted for failing its checks, not evicted
        if entry is None or key not in self.spill:  # failed, or deleted meanwhile
            return None
        with contextlib.suppress(StoreError):
            self.put(key, entry)  # promote (this drops the spill copy)
        return entry

    async def get(self, key: str) -> Entry | None:
        """The entry from memory or the spill, counted as a hit or a miss."""
        entry = self.get_memory(key)
        if entry is None:
            entry = await self.read_spilled(key)
        self.count(entry is not None, key)
        return entry

    def count(self, hit: bool, key: str = "", reason: str = "") -> str:
        """Count a get of key; for a miss, its reason (given, or found here) is
        counted and returned."""
        if hit:
            self.hits += 1
            return ""
        self.misses += 1
        reason = reason or self.miss_reason(key)
        self.miss_reasons[reason] += 1
        return reason

    def miss_reason(self, key: str) -> str:
        if key in self._corrupt:
            self._corrupt.discard(key)
            return "checksum"
        return "evicted" if key in self._evicted else "not_stored"

    def list_keys(self, prefix: str, cursor: str, limit: int) -> tuple[list[str], str]:
        return self.index.page(prefix, cursor, limit)
