"""L2: chunks read from other engines' L1 through a TransferChannel.

The tier stores nothing (`submit_put` is a no-op): peers find our chunks through the
controller, which learns of them from our KV events.

- **Lookups** (`batched_contains`, synchronous, from the scheduler's thread) ask the
  engine's PeerLocator which peer holds the longest run of the keys, bounded by
  `lookup_timeout_s`; the answer is remembered per key so the retrieve that follows
  goes straight to that peer. No locator attached → 0. Pins are not possible on a
  peer: a chunk it evicts meanwhile is a miss at retrieve time.
- **Gets** (`aget`, on the engine's loop): the StorageManager asks for each key of a
  prefix at once; gets for one peer that arrive in the same loop turn are read in one
  batch (one request, one NIXL read). Each chunk is checked after landing: its
  key, its dtype and size, and the xxh3 of its bytes (over NIXL, hashed as each
  chunk lands while the next ones are still moving). Whatever fails (dead peer,
  deadline, bad reply, bad checksum, no memory) is a miss and is counted.
- **Peers that stopped answering**: the controller goes on naming a dead peer until it
  misses its heartbeats (3 s by default), and each read of it would wait the whole
  `timeout_s`. A peer whose connection got no reply at all during PEER_DOWN_AFTER reads
  in a row (dead, unreachable) is left alone for PEER_DOWN_S: lookups naming it count
  0 (`down`) and gets of chunks already located there miss at once. The first lookup
  after that asks it again. One slow read, or a transfer late after the peer answered,
  is not enough: a live peer losing every hit for seconds would cost more than a dead
  one's second deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

from kvmesh.common.chunk_codec import chunk_bytes, chunk_checksums, dtype_from_name
from kvmesh.common.config import P2PConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.protocol.p2p import ChunkMeta
from kvmesh.common.transport.channel import Landed, PeerError, TransferChannel
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.peer_locator import PeerLocator
from kvmesh.services.worker.tiers.base import Allocator, drop_late, without_wait
from kvmesh.services.worker.tiers.misses import MissReason, TierMisses
from kvmesh.services.worker.tiers.p2p_stats import P2PStats

log = get_logger(__name__)

WHERE_CAPACITY = 1 << 16  # keys whose peer we remember between lookup and retrieve
# Longer than the controller's default window for a dead worker (3 heartbeats of 1 s),
# so a dead peer costs one read's deadline instead of one per request until then; short
# enough that a peer back from a pause (or restarted behind its endpoint) is soon read.
PEER_DOWN_S = 5.0
PEER_DOWN_AFTER = 2  # connections in a row silent through a read's deadline
_Waiter = tuple[ChunkKey, "asyncio.Future[MemoryObj | None]", Allocator]
# Why chunks of a read did not arrive, filled in by `fetch` for its caller.
Reasons = dict[ChunkKey, MissReason]


class P2PTier:
    name = "p2p"

    def __init__(
        self,
        channel: TransferChannel,
        loop: LoopThread,
        config: P2PConfig,
        locator: Callable[[], PeerLocator | None],
        own_endpoint: Callable[[], str],
        metrics: Metrics | None = None,
    ) -> None:
        self.channel = channel
        self.config = config
        self._loop = loop
        self._locator = locator
        self._own = own_endpoint
        self.stats = P2PStats(metrics)
        self.misses = TierMisses(self.name, self.stats.metrics)
        self._where: OrderedDict[ChunkKey, str] = OrderedDict()
        self._batches: dict[str, list[_Waiter]] = {}
        self._reads: set[asyncio.Future[None]] = set()
        # Endpoint -> monotonic time until which it is not asked (it did not answer).
        # Written on the loop, read from the scheduler's thread too (single dict ops).
        self._down: dict[str, float] = {}
        # Endpoint -> (connections in a row silent through a read's deadline, the last
        # of them) (loop only).
        self._silent: dict[str, tuple[int, int]] = {}
        self._closed = False

    # -- lookups ------------------------------------------------------------------------
    def _locate(self, keys: Sequence[ChunkKey]) -> tuple[str, int]:
        """(peer endpoint, how many leading keys it holds); ("", 0) for none."""
        locator = self._locator()
        if locator is None or self._closed or not keys:
            self.stats.lookups["no_locator" if locator is None else "none"].inc()
            return "", 0
        t0 = time.perf_counter()
        try:
            where = locator.locate(keys, self.config.lookup_timeout_s)
        except Exception as exc:  # the contract says it never raises; be safe anyway
            log.warning("peer locator failed", error=repr(exc))
            self.stats.lookups["error"].inc()
            return "", 0
        finally:
            self.stats.seconds["locate"].observe(time.perf_counter() - t0)
        if where is None or where.count <= 0 or not where.endpoint:
            self.stats.lookups["none"].inc()
            return "", 0
        if where.endpoint == self._own():
            self.stats.lookups["self"].inc()
            return "", 0
        if self._is_down(where.endpoint):
            self.stats.lookups["down"].inc()
            return "", 0
        n = min(where.count, len(keys))
        for key in keys[:n]:
            self._where[key] = where.endpoint
            self._where.move_to_end(key)
        while len(self._where) > WHERE_CAPACITY:
            self._where.popitem(last=False)
        self.stats.lookups["found"].inc()
        return where.endpoint, n

    def batched_contains(self, keys: Sequence[ChunkKey], pin: bool = False) -> int:
        return self._locate(keys)[1]

    def contains(self, key: ChunkKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    # -- gets ---------------------------------------------------------------------------
    async def aget(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        if self._closed:
            self.misses.inc(MissReason.ERROR)
            return None
        endpoint = self._where.get(key)
        if endpoint is None:
            # No lookup came first (a retrieve without lookup): ask now, off the loop,
            # since a locator may itself wait on this loop.
            endpoint, n = await asyncio.to_thread(self._locate, [key])
            if not n:
                self.stats.gets["no_peer"].inc()
                self.misses.inc(MissReason.NOT_STORED)
                return None
        elif self._is_down(endpoint):  # located before its peer stopped answering
            self.stats.gets["down"].inc()
            self.misses.inc(MissReason.REMOTE_DOWN)
            return None
        fut: asyncio.Future[MemoryObj | None] = asyncio.get_running_loop().create_future()
        batch = self._batches.get(endpoint)
        if batch is None:
            batch = self._batches[endpoint] = []
            # The other gets of this prefix start in this same loop turn: read them
            # together once they have queued.
            asyncio.get_running_loop().call_soon(self._start_batch, endpoint)
        batch.append((key, fut, allocator))
        return await fut

    def _start_batch(self, endpoint: str) -> None:
        waiters = self._batches.pop(endpoint, [])
        if waiters:
            task = asyncio.ensure_future(self._read_batch(endpoint, waiters))
            self._reads.add(task)
            task.add_done_callback(self._reads.discard)

    async def _read_batch(self, endpoint: str, waiters: list[_Waiter]) -> None:
        results: dict[ChunkKey, MemoryObj] = {}
        reasons: Reasons = {}
        keys = [key for key, _, _ in waiters]
        t0 = time.perf_counter()
        started = time.monotonic()
        try:
            results = await self.fetch(
                endpoint, keys, waiters[0][2], self.config.timeout_s, reasons=reasons
            )
        except PeerError as exc:
            log.info("p2p read failed", peer=endpoint, error=str(exc))
            self.stats.gets["error"].inc(len(waiters))
            reason = self._peer_error_reason(exc, time.perf_counter() - t0)
            reasons.update(dict.fromkeys(keys, reason))
            for key in keys:
                self._where.pop(key, None)
            # Silence: its connection got no reply at all within a request's own
            # deadline. Not: a refusal, a restart found (AgentChanged), a reply during
            # the read (a NIXL transfer late after its pin reply), a connection closed
            # under the read (another request's failure), a local fault.
            silent = exc.timed_out and exc.conn is not None and exc.conn.last_reply < started
            self._count_silent(endpoint, exc.conn.serial if silent and exc.conn else 0)
        except Exception:
            log.exception("p2p read failed", peer=endpoint)
            self.stats.gets["error"].inc(len(waiters))
            reasons.update(dict.fromkeys(keys, MissReason.ERROR))
        else:
            self._down.pop(endpoint, None)  # it answered
            self._silent.pop(endpoint, None)
        finally:
            self.stats.seconds["read"].observe(time.perf_counter() - t0)
            for key, fut, _ in waiters:
                obj = results.pop(key, None)
                if fut.done():  # the waiter was cancelled (its deadline)
                    if obj is not None:
                        obj.ref_down()
                else:
                    if obj is None:
                        # Named by the controller, not sent by the peer: evicted there.
                        self.misses.inc(reasons.get(key, MissReason.EVICTED))
                    fut.set_result(obj)
            for obj in results.values():  # duplicates of one key
                obj.ref_down()

    def _is_down(self, endpoint: str) -> bool:
        until = self._down.get(endpoint)
        return until is not None and time.monotonic() < until

    def _count_silent(self, endpoint: str, conn_serial: int) -> None:
        """A read of endpoint failed; conn_serial: the connection that stayed silent
        through its deadline (0: not silence). One strike a connection: the reads
        pending on it all fail together at one deadline, one outage, not several."""
        if not conn_serial:
            self._silent.pop(endpoint, None)
            return
        n, struck = self._silent.pop(endpoint, (0, 0))
        if struck == conn_serial:
            self._silent[endpoint] = (n, struck)
            return
        if n + 1 >= PEER_DOWN_AFTER:
            self._mark_down(endpoint)
            return
        if len(self._silent) >= WHERE_CAPACITY:  # peers that failed once, never read again
            self._silent.clear()
        self._silent[endpoint] = (n + 1, conn_serial)

    def _mark_down(self, endpoint: str) -> None:
        now = time.monotonic()
        for ep, until in list(self._down.items()):  # bounded by the peers that failed lately
            if until <= now:
                self._down.pop(ep, None)
        self._down[endpoint] = now + PEER_DOWN_S
        log.info("p2p peer not asked for a while", peer=endpoint, seconds=PEER_DOWN_S)

    def _peer_error_reason(self, exc: PeerError, elapsed_s: float) -> MissReason:
        if elapsed_s >= self.config.timeout_s * 0.95:
            return MissReason.TIMEOUT
        if exc.code is not None:  # the peer answered, and said no
            return MissReason.ERROR
        return MissReason.REMOTE_DOWN

    async def fetch(
        self,
        endpoint: str,
        keys: Sequence[ChunkKey],
        allocator: Allocator,
        timeout_s: float,
        *,
        reasons: Reasons | None = None,
    ) -> dict[ChunkKey, MemoryObj]:
        """The chunks of keys the peer at endpoint holds and that pass the checks, one
        reference each for the caller (not inserted anywhere). Raises PeerError. Gets
        and admin copies (services/worker/peer_copy.py) both land chunks through here,
        so no chunk reaches L1 unchecked."""
        digests: dict[int, int] = {}  # id(landed buffer) -> xxh3 of its bytes
        partial: dict[int, xxhash.xxh3_64] = {}  # id -> the hash of its first ranges

        def on_landed(meta: ChunkMeta, obj: MemoryObj, off: int, n: int) -> None:
            # Off the loop, while the channel still moves the next ranges. xxhash's
            # update drops the GIL on big inputs; the ranges of a chunk come in order.
            h = partial.pop(id(obj), None) if off else xxhash.xxh3_64()
            if h is None:
                return  # a range came out of order: leave the chunk to _verify
            h.update(chunk_bytes(obj)[off : off + n])
            if off + n == obj.nbytes:
                digests[id(obj)] = h.intdigest()
            else:
                partial[id(obj)] = h

        landed = await self.channel.read(
            endpoint,
            [k.to_str() for k in keys],
            self._alloc_fn(allocator, reasons),
            timeout_s,
            on_landed,
        )
        return await self._verify(landed, set(keys), reasons, digests)

    def _alloc_fn(
        self, allocator: Allocator, reasons: Reasons | None = None
    ) -> Callable[[ChunkMeta], MemoryObj | None]:
        # Channels call this on the event loop: a page must be there at once (an L1
        # whose pages are all in use would otherwise hold the loop for alloc_timeout_s).
        allocate = without_wait(allocator).allocate

        def alloc(meta: ChunkMeta) -> MemoryObj | None:
            try:
                dtype = dtype_from_name(meta.dtype)
                obj = allocate(tuple(meta.shape), dtype, MemoryFormat(meta.fmt))
            except Exception as exc:  # full L1, or a description we cannot build
                log.info("no buffer for a peer chunk", key=meta.key, error=repr(exc))
                obj = None
            if obj is None:
                self.stats.gets["no_memory"].inc()
                if reasons is not None:
                    _note(reasons, meta.key, MissReason.ERROR)
            return obj

        return alloc

    async def _verify(
        self,
        landed: list[Landed],
        asked: set[ChunkKey],
        reasons: Reasons | None = None,
        digests: dict[int, int] | None = None,
    ) -> dict[ChunkKey, MemoryObj]:
        """The landed chunks whose key was asked and whose bytes match their checksum;
        the rest are dropped (counted as corrupt). digests: the xxh3 of landed buffers
        already hashed (by id); the others are hashed here, off the loop."""
        digests = digests if digests is not None else {}
        todo = [obj for _, obj in landed if id(obj) not in digests]
        for obj, digest in zip(todo, await chunk_checksums(todo), strict=True):
            digests[id(obj)] = digest
        verdicts = [
            obj.nbytes == meta.nbytes and digests[id(obj)] == meta.checksum for meta, obj in landed
        ]
        good: dict[ChunkKey, MemoryObj] = {}
        for (meta, obj), ok in zip(landed, verdicts, strict=True):
            try:
                key = ChunkKey.from_str(meta.key)
            except ValueError:
                key = None
            if not ok or key not in asked or key in good:
                self.stats.gets["corrupt"].inc()
                if reasons is not None and key in asked and key not in good:
                    reasons[key] = MissReason.CHECKSUM
                log.warning("peer chunk failed its check; dropped", key=meta.key)
                obj.ref_down()
                continue
            obj.key = key
            obj.checksum = meta.checksum
            good[key] = obj
            self.stats.received.inc(meta.nbytes)
            self.stats.gets["hit"].inc()
        self.stats.gets["miss"].inc(len(asked) - len(good))
        return good

    def get(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        if self._loop.in_loop_thread():
            raise RuntimeError("P2PTier.get from the engine's loop: await aget instead")
        try:
            return self._loop.run(
                self.aget(key, allocator), self.config.timeout_s + 1.0, orphan=drop_late
            )
        except TimeoutError:
            return None

    # -- the rest of the Tier interface: a peer tier holds nothing of its own -----------
    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        return None

    def remove(self, key: ChunkKey) -> bool:
        self._where.pop(key, None)
        return False

    def clear(self) -> int:
        self._where.clear()
        return 0

    def pin(self, key: ChunkKey) -> bool:
        return False

    def unpin(self, key: ChunkKey) -> bool:
        return False

    def touch(self, key: ChunkKey) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        """Close the channel on the loop (its sockets live there); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop.running and not self._loop.in_loop_thread():
            try:
                self._loop.run(self.channel.aclose(), 5.0)
            except Exception as exc:
                log.warning("p2p channel close failed", error=repr(exc))


def _note(reasons: Reasons, key_str: str, reason: MissReason) -> None:
    # A key that does not parse was never asked for: nothing of ours to explain.
    with contextlib.suppress(ValueError):
        reasons[ChunkKey.from_str(key_str)] = reason
