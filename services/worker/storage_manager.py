"""Tiers in order: write-all puts, waterfall gets with promotion to L1.

L1 is consulted inline on the caller's thread (a dict lookup under a lock is
microseconds; a hop to the event loop would cost more than the work). Lower tiers
run on the engine's event loop with a bound on each tier's concurrent I/O and the I/O
deadline (retrieves and prefetches alike), and anything they fail at is a miss. A plugin
tier's lookups (batched_contains) run on threads of their own under the same
deadline, so a plugin that hangs never holds the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import operator
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.common.observability import get_logger
from kvmesh.services.worker.events import KVEventBuffer, KVEventKind
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers.base import Allocator, Tier, without_wait
from kvmesh.services.worker.tiers.host import HostTier
from kvmesh.services.worker.tiers.misses import MissReason, TierMisses

log = get_logger(__name__)


class StorageManager:
    """L1 plus any lower tiers; every method may be called from any thread."""

    def __init__(
        self,
        l1: HostTier,
        lower: Sequence[Tier],
        loop: LoopThread,
        events: KVEventBuffer,
        *,
        max_inflight_io: int = 64,
        io_timeout_s: float = 5.0,
    ) -> None:
        self.l1 = l1
        self.lower = list(lower)
        # What each lower tier's aget allocates from (tiers/base.py: allocation on the
        # event loop never waits, unless the tier waits on its own threads).
        self._allocators: dict[int, Allocator] = {
            id(t): l1 if getattr(t, "waits_for_pages", False) else without_wait(l1)
            for t in self.lower
        }
        # Each lower tier's miss counters: its own, or (a plugin's, which has none) ones
        # kept here in L1's registry, so that what the engine sees of it (errors,
        # timeouts, chunks it does not have) is counted like any tier's.
        self._misses: dict[int, TierMisses] = {}
        self._counts_absent: set[int] = set()
        for t in self.lower:
            own = getattr(t, "misses", None)
            if not isinstance(own, TierMisses):
                own = TierMisses(t.name, l1.misses.metrics)
                self._counts_absent.add(id(t))
            self._misses[id(t)] = own
        # Where L1's pages lie: a lower tier's chunk must be one of them (its allocator's).
        self._l1_base = l1.pool.buffer.data_ptr()
        self._l1_bytes = l1.pool.capacity_bytes
        self._lookup_pool: _DaemonPool | None = None  # made by the first lookup needing it
        self._lookup_lock = threading.Lock()
        self._closed = False
        # Set by the engine's close() as it stops the loop: lower-tier gets are misses.
        self._closing = False
        self._overdue: dict[int, concurrent.futures.Future] = {}
        self._loop = loop
        self._events = events
        self._io_timeout_s = io_timeout_s
        # Each tier its own slots: one that hangs (a remote that never answers) holds
        # only its own until the deadline, while gets of the tiers above it, for other
        # requests, go on (with one shared bound they waited behind it for up to the
        # whole I/O deadline, 4.7 s of 5 in a review's run, though their tier answered).
        self._io_slots = {id(t): asyncio.Semaphore(max_inflight_io) for t in self.lower}
        self._pending: set[asyncio.Future] = set()

    @property
    def io_timeout_s(self) -> float:
        """The deadline of one lower-tier get or lookup."""
        return self._io_timeout_s

    @property
    def tiers(self) -> list[Tier | HostTier]:
        return [self.l1, *self.lower]

    def tier(self, name: str) -> Tier | HostTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")

    # -- store ----------------------------------------------------------------------
    def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Store obj (allocated from L1, the caller's reference is taken over) in L1 and
        submit it to every lower tier; False when L1 already had the key."""
        for tier in self.lower:
            try:
                tier.submit_put(key, obj)
            except Exception as exc:  # a failing tier is skipped, never fatal
                log.warning("tier put failed", tier=tier.name, error=repr(exc))
        if not self.l1.insert(key, obj):
            return False
        self._events.record(KVEventKind.STORED, key.to_str(), self.l1.name)
        return True

    def put_run(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj | None]) -> list[bool]:
        """`put` of each (key, obj) whose obj is not None, and a touch of the L1 copy of
        each key whose obj is None (the caller found it held), in order: L1's map, its
        policy and the KV events see one lock and one event batch instead of one per
        chunk. Returns, for each obj, whether L1 took it (False: it already had the key).
        """
        for tier in self.lower:
            for key, obj in zip(keys, objs, strict=True):
                if obj is None:
                    continue
                try:
                    tier.submit_put(key, obj)
                except Exception as exc:  # a failing tier is skipped, never fatal
                    log.warning("tier put failed", tier=tier.name, error=repr(exc))
        added = self.l1.insert_run(keys, objs)
        stored = [k for k, o in zip(keys, objs, strict=True) if o is not None]
        self._events.record_many(
            KVEventKind.STORED,
            [k.to_str() for k, new in zip(stored, added, strict=True) if new],
            self.l1.name,
        )
        return added

    # -- lookup ---------------------------------------------------------------------
    def prefix_hits(
        self, keys: Sequence[ChunkKey], pin: bool = False
    ) -> tuple[int, list[tuple[Tier | HostTier, int]], list[tuple[Tier | HostTier, ChunkKey]]]:
        """How many keys, from the first, some tier holds.

        Returns (count, [(tier, chunks counted in it)], [(tier, key) pinned]).
        """
        n = self.l1.batched_contains(keys, pin=pin)
        per_tier: list[tuple[Tier | HostTier, int]] = [(self.l1, n)] if n else []
        pinned = [(self.l1, k) for k in keys[:n]] if pin else []
        while n < len(keys) and self.lower:
            for tier in self.lower:
                try:
                    if id(tier) in self._counts_absent:
                        answer = self._foreign_count(tier, keys[n:], pin)
                    else:
                        answer = tier.batched_contains(keys[n:], pin=pin)
                    m = _checked_count(answer, len(keys) - n)
                    if m is None:
                        if pin:  # what it pinned of its claim, nobody would unpin
                            _unpin_claimed(tier, keys[n:], answer)
                        raise TypeError(
                            f"batched_contains answered {answer!r}, not a count in "
                            f"0..{len(keys) - n}"
                        )
                except Exception as exc:
                    log.warning("tier lookup failed", tier=tier.name, error=repr(exc))
                    m = 0
                if m:
                    per_tier.append((tier, m))
                    if pin:
                        pinned.extend((tier, k) for k in keys[n : n + m])
                    n += m
                    break
            else:
                break
        return n, per_tier, pinned

    def _foreign_count(self, tier: Tier, keys: Sequence[ChunkKey], pin: bool) -> object:
        """batched_contains of a tier from another package, within the I/O deadline.

        kvmesh's own tiers answer from memory (or put their own deadline on a remote
        question); a plugin's runs on a thread of its own here, so one that hangs costs
        a lookup the deadline once, not the caller's thread. While that call is still
        overdue the tier is left out of lookups (TimeoutError at once); what it pinned
        for a lookup that gave up on it is unpinned when it answers."""
        overdue = self._overdue.get(id(tier))
        if overdue is not None and not overdue.done():
            raise TimeoutError("its last lookup is still running past the deadline")
        with self._lookup_lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if self._lookup_pool is None:
                self._lookup_pool = _DaemonPool(4 * len(self._counts_absent), "kvmesh-lookup")
            pool = self._lookup_pool
        fut = pool.submit(tier.batched_contains, keys, pin)
        try:
            return fut.result(timeout=self._io_timeout_s)
        except concurrent.futures.TimeoutError:
            self._overdue[id(tier)] = fut
            if pin:
                fut.add_done_callback(lambda f: _unpin_late(tier, keys, f))
            raise TimeoutError(f"no answer within {self._io_timeout_s}s") from None

    # -- retrieve -------------------------------------------------------------------
    def get_prefix(self, keys: Sequence[ChunkKey]) -> tuple[list[MemoryObj], list[str]]:
        """Objects for the longest prefix of keys found in any tier (one reference each
        for the caller) and the name of the tier each came from."""
        objs = self._l1_prefix(keys)
        names = [self.l1.name] * len(objs)
        if len(objs) < len(keys) and self.lower and self._closing:
            # The engine is closing: a get submitted now waited out the whole I/O
            # deadline on a loop that a tier's task keeps from stopping, while close()
            # waited for it. A miss of the lower tiers; the L1 prefix is the caller's.
            return objs, names
        if len(objs) < len(keys) and self.lower:
            deadline = time.monotonic() + self._io_timeout_s
            rest = self._lower_prefix(keys[len(objs) :], deadline)
            try:
                more = self._loop.run(rest, self._io_timeout_s, orphan=_drop_pairs)
            except RuntimeError:
                if not self._closing:
                    _drop_all(objs)
                    raise
                more = []  # the loop stopped since the check above: a miss, as there
            except TimeoutError:
                # The gets still in flight are cancelled on the loop, which counts each
                # as a timeout miss of the tier it was waiting on.
                more = []
            except concurrent.futures.CancelledError:
                if not self._loop.stopping:
                    _drop_all(objs)
                    raise
                # The engine is closing: its loop's stop cancelled these gets. A miss
                # of the lower tiers, not an error in the inference thread (it got
                # CancelledError); the L1 prefix stays the caller's to load.
                more = []
            except BaseException:
                _drop_all(objs)  # the L1 prefix's references were the caller's to drop
                raise
            for obj, name in more:
                objs.append(obj)
                names.append(name)
        return objs, names

    async def aget_prefix(
        self, keys: Sequence[ChunkKey], timeout_s: float
    ) -> tuple[list[MemoryObj], list[str]]:
        """`get_prefix` for code already on the engine's event loop, within timeout_s:
        a tier whose get never answers must not hold a prefetch (and its I/O slot)
        forever. Past it, the prefix found so far in L1."""
        objs = self._l1_prefix(keys)
        names = [self.l1.name] * len(objs)
        if len(objs) < len(keys) and self.lower:
            deadline = time.monotonic() + timeout_s
            try:
                # One timer for the whole prefix: the gets it cancels count their
                # timeout misses themselves (_aget_lower), without a warning each.
                async with asyncio.timeout(timeout_s):
                    more = await self._lower_prefix(keys[len(objs) :], deadline)
            except TimeoutError:
                more = []
            except BaseException:
                # Cancelled (a prefetch released, the engine closing): the L1 prefix's
                # references were the caller's, and no caller gets them now.
                _drop_all(objs)
                raise
            for obj, name in more:
                objs.append(obj)
                names.append(name)
        return objs, names

    def _l1_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """L1's prefix of keys, counting a miss for each later key L1 does not hold
        (they are all asked of the lower tiers next)."""
        objs = self.l1.get_prefix(keys)
        for key in keys[len(objs) :]:
            reason = self.l1.miss_reason(key)
            if reason is not None:
                self.l1.misses.inc(reason)
        return objs

    async def _lower_prefix(
        self, keys: Sequence[ChunkKey], deadline: float | None = None
    ) -> list[tuple[MemoryObj, str]]:
        tasks = [asyncio.ensure_future(self._aget_lower(k, deadline)) for k in keys]
        try:
            fetched = await asyncio.gather(*tasks)
        except BaseException:
            # Cancelled (the caller's deadline): what was fetched, or still lands, goes
            # back to the allocator instead of leaking its page.
            for task in tasks:
                task.add_done_callback(_drop_fetched)
            raise
        out: list[tuple[MemoryObj, str]] = []
        for i, item in enumerate(fetched):
            if item is None:
                # Prefix semantics: what lies past the first miss is dropped.
                for later in fetched[i + 1 :]:
                    if later is not None:
                        later[0].ref_down()
                break
            out.append(item)
        return out

    async def _aget_lower(
        self, key: ChunkKey, deadline: float | None
    ) -> tuple[MemoryObj, str] | None:
        """The first lower tier's copy of key. A tier counts its own misses when it
        answers None (a tier without counters, a plugin's, has them counted here);
        what it cannot count (it raised, answered something that is no chunk, or
        `deadline` passed) is counted here. A get cancelled before its deadline (a
        prefetch released, the engine closing) was abandoned, not missed."""
        for tier in self.lower:
            try:
                async with self._io_slots[id(tier)]:
                    obj = await tier.aget(key, self._allocators[id(tier)])
            except asyncio.CancelledError:
                if _past(deadline):
                    self._count_miss(tier, MissReason.TIMEOUT)
                raise
            except Exception as exc:
                log.warning("tier get failed", tier=tier.name, error=repr(exc))
                timed_out = isinstance(exc, TimeoutError)
                self._count_miss(tier, MissReason.TIMEOUT if timed_out else MissReason.ERROR)
                if _past(deadline):
                    return None  # it answered the cancel late: the tiers below get no time
                continue
            if obj is None:
                if _past(deadline):
                    # It swallowed the cancel at the deadline: its timeout, and the
                    # tiers below get no time of their own.
                    self._count_miss(tier, MissReason.TIMEOUT)
                    return None
                if id(tier) in self._counts_absent:
                    self._count_miss(tier, MissReason.NOT_STORED)
                continue
            if not isinstance(obj, MemoryObj) or obj.is_freed:
                # A plugin tier that broke its contract: what it gave is not a chunk
                # the caller may read (nor a reference it may drop), so it is a miss.
                log.error(
                    "tier get returned no usable chunk; treated as a miss",
                    tier=tier.name,
                    returned=type(obj).__name__ if not isinstance(obj, MemoryObj) else repr(obj),
                )
                self._count_miss(tier, MissReason.ERROR)
                continue
            if not self._in_l1(obj):
                # Not from the allocator it was given: promoted, it would sit in L1
                # outside L1's pool, uncounted and past its capacity. Its reference is
                # ours to drop, which gives the page back to wherever it came from.
                log.error(
                    "tier get returned a chunk from outside L1's pool; treated as a miss",
                    tier=tier.name,
                )
                obj.ref_down()
                self._count_miss(tier, MissReason.ERROR)
                continue
            self._promote(key, obj)
            return obj, tier.name
        return None

    def _removed_from_l1(self, key: ChunkKey) -> None:
        self._events.record(KVEventKind.REMOVED, key.to_str(), self.l1.name)

    def _in_l1(self, obj: MemoryObj) -> bool:
        return 0 <= obj.data_ptr - self._l1_base < self._l1_bytes

    def _count_miss(self, tier: Tier, reason: MissReason) -> None:
        self._misses[id(tier)].inc(reason)

    def _promote(self, key: ChunkKey, obj: MemoryObj) -> None:
        obj.ref_up()  # L1's own reference; the caller keeps the one aget gave
        if self.l1.insert(key, obj):
            self._events.record(KVEventKind.STORED, key.to_str(), self.l1.name)

    # -- management -----------------------------------------------------------------
    def unpin(self, pinned: Sequence[tuple[Tier | HostTier, ChunkKey]]) -> None:
        for tier, key in pinned:
            try:
                tier.unpin(key)
            except Exception as exc:  # a failing tier is skipped: the other pins still go
                log.warning("tier unpin failed", tier=tier.name, error=repr(exc))

    def remove(self, key: ChunkKey, tier: str | None = None) -> int:
        n = 0
        for t in self.tiers:
            if (tier is None or t.name == tier) and t.remove(key):
                n += 1
                self._events.record(KVEventKind.REMOVED, key.to_str(), t.name)
        return n

    def clear(self, tier: str | None = None) -> int:
        n = 0
        for t in self.tiers:
            if tier is not None and t.name != tier:
                continue
            if t is self.l1:
                # As remove() does: without these events the controller went on naming
                # this engine as the holder of every chunk it had dropped.
                n += self.l1.clear(self._removed_from_l1)
            else:
                n += t.clear()
        return n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the puts in flight to every lower tier, all within one deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for tier in self.lower:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = tier.flush(left) and done
        return done

    def begin_close(self) -> None:
        """The engine is closing (its loop about to stop): from now on get_prefix asks
        no lower tier, a miss there; close() comes once no retrieve runs."""
        self._closing = True

    def close(self) -> None:
        with self._lookup_lock:
            self._closed = True
            pool, self._lookup_pool = self._lookup_pool, None
        if pool is not None:
            pool.shutdown()
        for tier in self.lower:
            tier.close()
        self.l1.close()


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _checked_count(m: object, asked: int) -> int | None:
    """A lower tier's batched_contains answer as a count in 0..asked (any integer type
    a plugin may use, numpy's included), or None: a tier that claims more than it was
    asked (or answers something else) would make the lookup promise tokens that do
    not exist."""
    if inspect.iscoroutine(m):
        m.close()  # an `async def` batched_contains: never awaited, nothing to run
        return None
    try:
        n = operator.index(m)  # type: ignore[arg-type]
    except TypeError:
        return None
    return n if 0 <= n <= asked else None


def _unpin_claimed(tier: Tier, keys: Sequence[ChunkKey], answer: object) -> None:
    """Unpin what a refused answer claimed to have pinned (at most the keys asked)."""
    try:
        n = operator.index(answer)  # type: ignore[arg-type]
    except TypeError:
        return
    for key in keys[: max(0, min(n, len(keys)))]:
        try:
            tier.unpin(key)
        except Exception as exc:
            log.warning("tier unpin failed", tier=tier.name, error=repr(exc))


class _DaemonPool:
    """Threads for calls that may never return (a plugin's, stuck): daemons, so a
    stuck one holds up neither close nor the process's exit, as the workers of a
    ThreadPoolExecutor would (they are joined at exit)."""

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
        self._n = n

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        for _ in range(self._n):
            self._jobs.put(None)  # each idle thread ends; a stuck one ends with the process

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)


def _unpin_late(tier: Tier, keys: Sequence[ChunkKey], fut: concurrent.futures.Future) -> None:
    """A lookup gave up on this answer: whatever it pinned nobody will unpin."""
    if fut.cancelled() or fut.exception() is not None:
        return
    _unpin_claimed(tier, keys, fut.result())


def _drop_all(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.ref_down()


def _drop_pairs(pairs: list[tuple[MemoryObj, str]]) -> None:
    """A waterfall's late result: the caller that would have dropped them gave up."""
    _drop_all([obj for obj, _ in pairs])


def _drop_fetched(task: asyncio.Future) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    item = task.result()
    if item is not None:
        item[0].ref_down()
