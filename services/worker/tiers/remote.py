"""L4: a remote store shared by many workers, behind one connector chosen by URL.

- **Puts** (`submit_put`) never block: the tier takes a reference on the chunk, and a
  task on the engine's loop encodes it (remote_codec.py: common/chunk_codec.py's
  value header with key, shape, dtype, format and checksum; optional zstd/lz4 when it
  shrinks the bytes; a checksum the chunk already carries is reused, else it is
  computed off the loop for large chunks) and sends it, then drops the reference once
  the connector no longer reads the buffer. A key already known to be there, or
  already on its way, is not sent again; at `max_pending_puts` in flight, or while the
  remote is down, puts are dropped and counted.
- **Gets** (`aget`, on the engine's loop) have a deadline (`timeout_s`); the value is
  verified while it is copied into an L1 buffer, or, from a connector that can
  receive in place (`get_into`: the cache-server's data connections), after it was
  received straight into one. Timeouts, errors and failed checks are misses.
- **Lookups** (`batched_contains`) come synchronously from the scheduler's thread, so
  they must be fast and bounded. The tier first answers from its presence cache
  (remote_presence.py: keys it stored, fetched or saw recently); only for the first
  key it knows nothing about does it ask the remote, for all remaining keys in one
  batched exists run on the engine's loop with a short deadline (`lookup_timeout_s`).
  A timeout answers with what was known so far. Remote keys cannot be pinned: a
  counted chunk may still be evicted before its retrieve, which then recomputes it.
- **Health** (remote_health.py): while the remote is down, lookups and gets answer
  "miss" at once and puts are dropped; the monitor reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence

from kvmesh.common import offload
from kvmesh.common.chunk_codec import CODECS, Codec, CorruptChunk
from kvmesh.common.codecs import Codec as ChunkCodec
from kvmesh.common.codecs import codec_from_config
from kvmesh.common.config import RemoteConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.recent_keys import RecentKeys
from kvmesh.common.transport.cacheserver_errors import CacheServerUnavailable
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers.base import Allocator, drop_late, without_wait
from kvmesh.services.worker.tiers.misses import MissReason, TierMisses
from kvmesh.services.worker.tiers.remote_codec import (
    available,
    decode_or_none,
    encode,
    finish_placed,
    placement,
    release_result,
)
from kvmesh.services.worker.tiers.remote_connector import Connector, ValueRefused
from kvmesh.services.worker.tiers.remote_health import HealthMonitor, describe
from kvmesh.services.worker.tiers.remote_presence import PresenceCache
from kvmesh.services.worker.tiers.remote_stats import RemoteStats

log = get_logger(__name__)

MAX_LOOKUP_KEYS = 4096
CLEAR_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0
# At most one warning this often for puts the store refuses (too large, or it is full):
# every chunk of a model may be over the limit, a warning each would flood the log.
REFUSED_WARN_S = 60.0


class RemoteTier:
    """The L4 tier; every method may be called from any thread (see module doc)."""

    name = "remote"
    waits_for_pages = True  # waits for an L1 page only off the loop (tiers/base.py)

    def __init__(
        self,
        connector: Connector,
        loop: LoopThread,
        config: RemoteConfig,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.connector = connector
        self.config = config
        self._loop = loop
        codec = CODECS[config.compression]
        if not connector.compresses:
            codec = Codec.NONE
        elif codec is not Codec.NONE and not available(codec):
            raise ValueError(
                f"remote compression {config.compression!r} needs the "
                f"{'zstandard' if codec is Codec.ZSTD else 'lz4'} package"
            )
        self._codec = codec
        self._codec_impl = codec_from_config(
            codec.name.lower() if codec is not Codec.NONE else "none", config.cachegen
        )
        self.stats = RemoteStats(metrics)
        self.misses = TierMisses(self.name, self.stats.metrics)
        # Keys this worker stored, fetched or saw in the remote: one of them missing
        # later was evicted there (or deleted by another worker), not never stored.
        self._held: RecentKeys[ChunkKey] = RecentKeys()
        self.presence = PresenceCache(
            config.presence_max_keys, config.presence_ttl_s, config.absence_ttl_s
        )
        self.health = HealthMonitor(
            ping=self._ping,
            reconnect=connector.reconnect,
            interval_s=config.health_interval_s,
            timeout_s=config.timeout_s,
            failures_to_down=config.failures_to_down,
            name=connector.display,
            on_change=self._health_changed,
        )
        self._lock = threading.Lock()
        self._inflight: set[ChunkKey] = set()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._namespaces: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None
        self._closed = False
        self._disconnects_seen = 0
        self._refused_warned_at = -REFUSED_WARN_S
        loop.call_soon(self._start)

    # -- lifecycle ----------------------------------------------------------------------
    def _start(self) -> None:
        self._monitor = asyncio.get_running_loop().create_task(
            self.health.run(), name="kvmesh-remote-health"
        )

    async def _ping(self) -> None:
        if self.connector.connected() is False:
            raise ConnectionError("connection lost")
        await self.connector.ping()

    def _health_changed(self, up: bool, reason: str) -> None:
        if up:
            # Back after being down: the remote may have restarted and lost what it
            # held, and a key still remembered as present would be neither counted
            # right nor stored again until its TTL ran out.
            self.presence.clear()
        self.stats.up.set(1 if up else 0)
        self.stats.went["up" if up else "down"].inc()

    def _failed(self, what: str, exc: BaseException) -> None:
        """A request failed. Unless it only ran out of time, the store may be another
        process once it answers again (a restart quicker than the health check, which
        redis-py's pool hides behind one failed request per connection): the keys
        remembered as present are forgotten, or chunks stored again would be dropped as
        duplicates and lookups promise hits every get then misses."""
        self.health.failure(f"{what}: {describe(exc)}")
        if not isinstance(exc, TimeoutError):
            if self._loop.in_loop_thread():
                self.presence.clear()
            else:  # the scheduler's exists: the cache is the loop's to change
                self._loop.call_soon(self.presence.clear)

    def _check_connection(self) -> bool:
        """Up, and (where the connector can tell) still connected."""
        if not self.health.up:
            return False
        if self.connector.connected() is False:
            self.health.lost("connection lost")
            return False
        # A connector that counts its lost connections (the cache-server's) tells of a
        # restart even when it was too quick for the health monitor to see it down.
        lost = getattr(self.connector, "disconnects", None)
        if lost is not None and lost != self._disconnects_seen:
            self._disconnects_seen = lost
            self.presence.clear()
        return True

    def wait_ready(self, timeout: float) -> bool:
        """Block until the remote answers (True) or timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while not self.health.up:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted put has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Stop the monitor and the puts in flight, close the connection."""
        if self._closed:
            return
        self._closed = True
        if self._loop.running and not self._loop.in_loop_thread():
            try:
                self._loop.run(self._aclose(), CLOSE_TIMEOUT_S)
            except (TimeoutError, RuntimeError) as exc:
                log.warning("remote tier did not close cleanly", error=repr(exc))

    async def _aclose(self) -> None:
        tasks = [t for t in (self._monitor, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.connector.close()

    # -- puts ---------------------------------------------------------------------------
    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        stats = self.stats.puts
        if self._closed:
            return
        if not self._check_connection():
            stats["down"].inc()
            return
        if self.presence.get(key):
            stats["duplicate"].inc()
            return
        with self._lock:
            if key in self._inflight:
                stats["duplicate"].inc()
                return
            if self._pending >= self.config.max_pending_puts:
                stats["queue_full"].inc()
                return
            self._inflight.add(key)
            self._pending += 1
            self.stats.pending_puts.set(self._pending)
        self._namespaces.add(key.namespace_id)
        obj.ref_up()
        try:
            self._loop.call_soon(self._spawn_put, key, obj)
        except RuntimeError:  # the loop is gone: the engine is closing
            self._put_done(key)
            obj.ref_down()

    def _spawn_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        task = asyncio.get_running_loop().create_task(self._put(key, obj))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _put_done(self, key: ChunkKey) -> None:
        with self._idle:
            self._inflight.discard(key)
            self._pending -= 1
            self.stats.pending_puts.set(self._pending)
            if self._pending == 0:
                self._idle.notify_all()

    async def _put(self, key: ChunkKey, obj: MemoryObj) -> None:
        stats = self.stats
        t0 = time.perf_counter()
        try:
            if not self._check_connection():
                stats.puts["down"].inc()
                return
            known = obj.checksum
            if self._codec is Codec.NONE and (
                known is not None or obj.nbytes < offload.OFFLOAD_FROM
            ):
                header, packed, payload = encode(key, obj, checksum=known)
            else:  # checksum (and compression) of a large chunk: off the loop
                header, packed, payload = await offload.offload(
                    encode, key, obj, self._codec_impl, self.config.compression_min_saving, known
                )
            # Kept on the object, so a peer or another tier that needs it later does
            # not hash the same bytes again.
            obj.checksum = header.checksum
            async with asyncio.timeout(self.config.timeout_s):
                await self.connector.put(key, header, packed, payload)
        except ValueRefused as exc:
            # Only puts fail: the store is up, and what it holds is as remembered.
            stats.puts[exc.result].inc()
            self._warn_refused(exc)
        except Exception as exc:  # any failure is a dropped put, never the caller's problem
            stats.puts["error"].inc()
            self._failed("put", exc)
            log.debug("remote put failed", key=key.to_str(), error=repr(exc))
        else:
            self.health.success()
            self.presence.set(key, True)
            self._held.add(key)
            stats.puts["written"].inc()
            stats.sent.inc(header.stored_nbytes)
            stats.raw_sent.inc(header.nbytes)
            stats.seconds["put"].observe(time.perf_counter() - t0)
        finally:
            obj.ref_down()
            self._put_done(key)

    def _warn_refused(self, exc: ValueRefused) -> None:
        now = time.monotonic()
        if now - self._refused_warned_at >= REFUSED_WARN_S:
            self._refused_warned_at = now
            log.warning(
                "remote store refused a chunk; it stays local",
                remote=self.connector.display,
                error=str(exc),
            )

    # -- gets ---------------------------------------------------------------------------
    async def aget(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        gets = self.stats.gets
        if self._closed:
            gets["down"].inc()
            self.misses.inc(MissReason.ERROR)
            return None
        if not self._check_connection():
            gets["down"].inc()
            self.misses.inc(MissReason.REMOTE_DOWN)
            return None
        if self.presence.get(key) is False:
            gets["miss"].inc()
            self.misses.inc(self._absent(key))
            return None
        self._namespaces.add(key.namespace_id)
        t0 = time.perf_counter()
        placed: list[MemoryObj] = []  # an L1 buffer the payload was received into
        try:
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    get_into = getattr(self.connector, "get_into", None)
                    if get_into is not None:
                        fetched = await get_into(key, placement(key, allocator, placed))
                    else:
                        fetched = await self.connector.get(key)
                # Decoding is local work with no deadline: a buffer it allocates must
                # always reach the caller (a cancelled thread would leak it).
                header = fetched.header if fetched is not None else None
                if header is None:
                    obj = None
                elif placed:
                    target = placed.pop()
                    if header.nbytes >= offload.OFFLOAD_FROM:
                        obj = await offload.offload(
                            finish_placed, key, header, target, abandoned=release_result
                        )
                    else:
                        obj = finish_placed(key, header, target)
                else:
                    obj = None
                    if header.nbytes < offload.OFFLOAD_FROM and not header.codec:
                        # Small: decoded here while a page is free at once; when the L1
                        # must wait for one, the wait happens on a thread, not the loop.
                        obj = decode_or_none(key, header, fetched.payload, without_wait(allocator))
                    if obj is None:
                        obj = await offload.offload(
                            decode_or_none,
                            key,
                            header,
                            fetched.payload,
                            allocator,
                            abandoned=release_result,
                        )
            finally:
                for unused in placed:  # the get failed after its buffer was given
                    unused.ref_down()
        except CorruptChunk as exc:
            gets["corrupt"].inc()
            self.misses.inc(MissReason.CHECKSUM)
            log.warning("remote value failed its checks; dropped", key=key.to_str(), error=str(exc))
            self.presence.set(key, False)
            self._held.discard(key)  # deleted for being corrupt: not an eviction
            self._drop_remote_copy(key)
            return None
        except Exception as exc:
            gets["error"].inc()
            self.misses.inc(self._failure_reason(exc, time.perf_counter() - t0))
            self._failed("get", exc)
            return None
        self.health.success()
        if fetched is None:
            self.presence.set(key, False)
            gets["miss"].inc()
            self.misses.inc(self._absent(key))
            return None
        if obj is None:
            gets["no_memory"].inc()
            self.misses.inc(MissReason.ERROR)
            return None
        self.presence.set(key, True)
        self._held.add(key)
        gets["hit"].inc()
        self.stats.received.inc(fetched.header.stored_nbytes)
        self.stats.seconds["get"].observe(time.perf_counter() - t0)
        return obj

    async def arewrite(self, key: ChunkKey, codec: ChunkCodec | None, allocator: Allocator) -> str:
        """Store the chunk again through codec (None: raw): "rewritten", "unchanged",
        "absent" or "failed". The store replaces a value whole (one SET, one cache-server
        put), so a reader gets the old value or the new one, each with its own header."""
        if self._closed or not self._check_connection():
            return "failed"
        obj: MemoryObj | None = None
        try:
            async with asyncio.timeout(self.config.timeout_s):
                fetched = await self.connector.get(key)
            if fetched is None:
                return "absent"
            old = fetched.header
            if old.codec == (Codec.NONE if codec is None else codec.id):
                return "unchanged"
            obj = await offload.offload(
                decode_or_none, key, old, fetched.payload, allocator, abandoned=release_result
            )
            if obj is None:
                return "failed"
            header, packed, payload = await offload.offload(
                encode, key, obj, codec, self.config.compression_min_saving
            )
            if header.codec == old.codec:
                return "unchanged"  # the codec did not pay off
            async with asyncio.timeout(self.config.timeout_s):
                await self.connector.put(key, header, packed, payload)
        except CorruptChunk as exc:
            self.misses.inc(MissReason.CHECKSUM)
            log.warning("remote value failed its checks; dropped", key=key.to_str(), error=str(exc))
            self.presence.set(key, False)
            self._drop_remote_copy(key)
            return "failed"
        except ValueRefused as exc:
            self._warn_refused(exc)
            return "failed"
        except Exception as exc:
            self._failed("rewrite", exc)
            return "failed"
        finally:
            if obj is not None:
                obj.ref_down()
        self.stats.sent.inc(header.stored_nbytes)
        return "rewritten"

    def known_keys(self) -> list[ChunkKey]:
        """The chunks this worker put in the store or read from it lately (a shared
        store lists no keys per worker); bounded, oldest first."""
        return self._held.snapshot()

    def _absent(self, key: ChunkKey) -> MissReason:
        return MissReason.EVICTED if key in self._held else MissReason.NOT_STORED

    def _failure_reason(self, exc: Exception, elapsed_s: float) -> MissReason:
        """A failed get's reason. Clients report their own deadline in their own
        error types (redis-py's TimeoutError, the cache-server client's "no reply
        within"), so a get that failed at its deadline is a timeout whatever it raised."""
        names = {c.__name__ for c in type(exc).__mro__}
        if isinstance(exc, TimeoutError) or elapsed_s >= self.config.timeout_s * 0.95:
            return MissReason.TIMEOUT
        if "TimeoutError" in names:
            return MissReason.TIMEOUT
        if isinstance(exc, (ConnectionError, CacheServerUnavailable)) or "ConnectionError" in names:
            return MissReason.REMOTE_DOWN
        return MissReason.ERROR

    def _drop_remote_copy(self, key: ChunkKey) -> None:
        task = asyncio.get_running_loop().create_task(self._delete_quietly([key]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _delete_quietly(self, keys: list[ChunkKey]) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.config.timeout_s):
                await self.connector.delete(keys)

    def get(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        if self._loop.in_loop_thread():
            raise RuntimeError("RemoteTier.get from the engine's loop: await aget instead")
        try:
            return self._loop.run(
                self.aget(key, allocator), self.config.timeout_s + 1.0, orphan=drop_late
            )
        except TimeoutError:
            return None

    # -- lookups ------------------------------------------------------------------------
    def contains(self, key: ChunkKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: Sequence[ChunkKey], pin: bool = False) -> int:
        """How many keys, from the first, the remote holds (pins are not possible
        remotely and are ignored); bounded by lookup_timeout_s."""
        lookups = self.stats.lookups
        if not keys or self._closed:
            return 0
        if not self._check_connection():
            lookups["down"].inc()
            return 0
        n, next_state = self.presence.prefix(keys)
        if n == len(keys) or next_state is False or self._loop.in_loop_thread():
            lookups["cached"].inc()
            return n
        rest = list(keys[n : n + MAX_LOOKUP_KEYS])
        lookups["asked"].inc()
        try:
            found = self._loop.run(self._exists(rest), self.config.lookup_timeout_s)
        except TimeoutError:
            # Not a health failure: a remote too slow for the scheduler's deadline may
            # still serve gets, which have a longer one.
            lookups["timeout"].inc()
            return n
        except Exception as exc:
            lookups["error"].inc()
            self._failed("exists", exc)
            return n
        for here in found:
            if not here:
                break
            n += 1
        return n

    async def _exists(self, keys: list[ChunkKey]) -> list[bool]:
        t0 = time.perf_counter()
        found = await self.connector.exists(keys)
        self.health.success()
        self.presence.update(keys, found)
        for key, here in zip(keys, found, strict=False):
            if here:
                self._held.add(key)
        self._namespaces.update(k.namespace_id for k in keys)
        self.stats.seconds["exists"].observe(time.perf_counter() - t0)
        return found

    # -- management ---------------------------------------------------------------------
    def remove(self, key: ChunkKey, force: bool = False) -> bool:
        self.presence.discard(key)
        self._held.discard(key)
        if self._closed or not self._check_connection():
            return False
        try:
            return self._loop.run(self._delete([key]), self.config.timeout_s) > 0
        except Exception as exc:
            log.warning("remote delete failed", error=repr(exc))
            return False

    async def _delete(self, keys: list[ChunkKey]) -> int:
        async with asyncio.timeout(self.config.timeout_s):
            return await self.connector.delete(keys)

    def clear(self) -> int:
        """Delete every chunk of the namespaces this tier has seen (the remote is shared:
        other namespaces' chunks stay)."""
        self.presence.clear()
        self._held.clear()
        with self._lock:
            namespaces = sorted(self._namespaces)
        if self._closed or not self._check_connection() or not namespaces:
            return 0
        try:
            return self._loop.run(self.connector.clear(namespaces), CLEAR_TIMEOUT_S)
        except Exception as exc:
            log.warning("remote clear failed", error=repr(exc))
            return 0

    def pin(self, key: ChunkKey) -> bool:
        return False

    def unpin(self, key: ChunkKey) -> bool:
        return False

    def touch(self, key: ChunkKey) -> None:
        pass

    @property
    def up(self) -> bool:
        return self.health.up

    @property
    def pending_puts(self) -> int:
        return self._pending
