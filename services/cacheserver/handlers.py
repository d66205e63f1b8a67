"""The cache-server's request handlers: one per message type, in one table.

Each handler takes the decoded header and its value frames and returns the reply
header and the value frames to send back. Handlers raise `RequestError` for a request
they refuse; the server turns it into an `ErrorReply`. Handlers are plain functions
that only touch memory, run inline by the receive callback in arrival order; a get
that must read the spill has an async twin (`async_table`) that the server runs as a
task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvmesh.common import offload
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.services.cacheserver.stats import ServerStats
from kvmesh.services.cacheserver.store import (
    Entry,
    MemoryStore,
    StoreError,
    checksums_off_loop,
    make_entry,
    value_view,
)

log = get_logger(__name__)

# Values below this are copied out of the received frame (which may share a larger
# receive buffer); larger ones are kept as the frame itself, with no copy.
KEEP_FRAME_FROM = 64 * 1024
# Spill reads one batch get keeps in flight: enough to keep the spill's I/O threads
# busy, few enough to leave them to other requests too.
SPILL_READS_PER_BATCH = 4

Result = tuple[Any, list[Any]]
Handler = Callable[[Any, list[Any]], Result]
AsyncHandler = Callable[[Any, list[Any]], Awaitable[Result]]


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_key(key: str) -> None:
    if not proto.valid_key(key):
        raise RequestError(
            ErrorCode.BAD_KEY,
            f"keys are 1–{proto.MAX_KEY_BYTES} bytes of printable UTF-8; got {key[:40]!r}",
        )


def _check_batch(keys: list[str]) -> None:
    if len(keys) > proto.MAX_BATCH:
        raise RequestError(
            ErrorCode.BATCH_TOO_LARGE, f"{len(keys)} keys in one batch (max {proto.MAX_BATCH})"
        )
    for key in keys:
        check_key(key)


def _kept(frame: Any) -> Any:
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return frame if buf.nbytes >= KEEP_FRAME_FROM else bytes(buf)


class Handlers:
    """The table `Handlers(...).table[type(msg)]` and the handlers behind it."""

    def __init__(
        self,
        store: MemoryStore,
        stats: ServerStats,
        *,
        server_name: str,
        request_timeout_s: float,
        started: float,
        connections: Callable[[], int],
    ) -> None:
        self.store = store
        self.stats = stats
        self.server_name = server_name
        self.request_timeout_s = request_timeout_s
        self.started = started
        self._connections = connections
        # Handlers that may wait (for the spill, or a large value's checksum on a
        # thread), used when `suspends(msg, values)`.
        self.async_table: dict[type, AsyncHandler] = {
            proto.GetValue: self.aget,
            proto.GetValues: self.aget_many,
            proto.PutValue: self.aput,
            proto.PutValues: self.aput_many,
        }
        self.table: dict[type, Handler] = {
            proto.PutValue: self.put,
            proto.GetValue: self.get,
            proto.CheckValue: self.exists,
            proto.DeleteValue: self.delete,
            proto.PutValues: self.put_many,
            proto.GetValues: self.get_many,
            proto.CheckValues: self.exists_many,
            proto.DeleteValues: self.delete_many,
            proto.ListKeys: self.list_keys,
            proto.GetStats: self.get_stats,
            proto.CheckHealth: self.health,
        }

    def suspends(self, msg: Any, values: list[Any]) -> bool:
        """Whether handling msg may wait (for disk, or to hash large values on a
        thread), so it should run as a task."""
        if isinstance(msg, proto.GetValue):
            return self.store.needs_disk(msg.key)
        if isinstance(msg, proto.GetValues):
            return any(self.store.needs_disk(k) for k in msg.keys)
        if isinstance(msg, proto.PutValue | proto.PutValues):
            return sum(value_view(v).nbytes for v in values) >= offload.OFFLOAD_FROM
        return False

    # -- storing ------------------------------------------------------------------------
    def _store(
        self, key: str, frame: Any, meta: bytes, checksum: int | None, actual: int | None
    ) -> Entry:
        check_key(key)
        if len(meta) > proto.MAX_META_BYTES:
            raise RequestError(
                ErrorCode.BAD_MESSAGE, f"meta of {len(meta)} bytes (max {proto.MAX_META_BYTES})"
            )
        try:
            entry = make_entry(_kept(frame), meta, checksum, actual)
            self.store.put(key, entry)
        except StoreError as exc:
            raise RequestError(exc.code, str(exc)) from None
        self.stats.bytes_in.inc(entry.nbytes)
        return entry

    def put(self, msg: proto.PutValue, frames: list[Any], sums: list[int] | None = None) -> Result:
        """sums: the frames' checksums when already computed (`aput`)."""
        if len(frames) != 1:
            raise RequestError(ErrorCode.BAD_FRAMES, f"put needs 1 value frame, got {len(frames)}")
        actual = sums[0] if sums else None
        entry = self._store(msg.key, frames[0], msg.meta, msg.checksum, actual)
        return proto.PutValueReply(msg.rid, entry.checksum), []

    async def aput(self, msg: proto.PutValue, frames: list[Any]) -> Result:
        return self.put(msg, frames, await checksums_off_loop(frames))

    async def aput_many(self, msg: proto.PutValues, frames: list[Any]) -> Result:
        return self.put_many(msg, frames, await checksums_off_loop(frames))

    def put_many(
        self, msg: proto.PutValues, frames: list[Any], sums: list[int] | None = None
    ) -> Result:
        """sums: the frames' checksums when already computed (`aput_many`)."""
        keys = msg.keys
        if len(keys) > proto.MAX_BATCH:
            _check_batch(keys)
        if len(frames) != len(keys):
            raise RequestError(
                ErrorCode.BAD_FRAMES, f"mput of {len(keys)} keys carried {len(frames)} frames"
            )
        if msg.metas and len(msg.metas) != len(keys):
            raise RequestError(ErrorCode.BAD_MESSAGE, "metas must be empty or one per key")
        if msg.checksums and len(msg.checksums) != len(keys):
            raise RequestError(ErrorCode.BAD_MESSAGE, "checksums must be empty or one per key")
        errors: list[int] = []
        for i, (key, frame) in enumerate(zip(keys, frames, strict=True)):
            meta = msg.metas[i] if msg.metas else b""
            checksum = msg.checksums[i] if msg.checksums else None
            try:
                self._store(key, frame, meta, checksum, sums[i] if sums else None)
                errors.append(0)
            except RequestError as exc:
                self.stats.errors[exc.code].inc()
                errors.append(int(exc.code))
        return proto.PutValuesReply(msg.rid, errors), []

    # -- reading ------------------------------------------------------------------------
    def _counted(self, key: str, entry: Entry | None, reason: str = "") -> Entry | None:
        reason = self.store.count(entry is not None, key, reason)
        if entry is None:
            self.stats.misses.inc()
            self.stats.miss_reasons[reason].inc()
        else:
            self.stats.hits.inc()
            self.stats.bytes_out.inc(entry.nbytes)
        return entry

    async def fetch(self, key: str) -> Entry | None:
        """From memory, or from the spill within the request deadline (else a miss)."""
        return (await self.fetch_many([key]))[0]

    async def fetch_many(self, keys: list[str]) -> list[Entry | None]:
        """Each key's entry, from memory or from the spill, the spill reads a few at a
        time under one deadline for the whole batch: a key not read by then is a miss
        (a deadline per key let one batch run for thousands of them)."""
        store = self.store
        entries = [store.get_memory(k) for k in keys]
        unread = {i for i, e in enumerate(entries) if e is None and store.needs_disk(keys[i])}
        if unread:
            todo = iter(sorted(unread))

            async def read() -> None:
                for i in todo:
                    entries[i] = await store.read_spilled(keys[i])
                    unread.discard(i)

            try:
                async with asyncio.timeout(self.request_timeout_s), asyncio.TaskGroup() as tg:
                    for _ in range(min(SPILL_READS_PER_BATCH, len(unread))):
                        tg.create_task(read())
            except TimeoutError:
                log.warning("spill reads passed the batch's deadline", unread=len(unread))
        return [
            self._counted(k, e, "timeout" if i in unread else "")
            for i, (k, e) in enumerate(zip(keys, entries, strict=True))
        ]

    @staticmethod
    def _get_reply(rid: int, entry: Entry | None) -> Result:
        if entry is None:
            return proto.GetValueReply(rid, False), []
        return proto.GetValueReply(rid, True, entry.meta, entry.checksum), [entry.value]

    @staticmethod
    def _get_many_reply(rid: int, entries: list[Entry | None]) -> Result:
        found = [e is not None for e in entries]
        metas = [e.meta if e is not None else b"" for e in entries]
        checksums = [e.checksum if e is not None else 0 for e in entries]
        return (
            proto.GetValuesReply(rid, found, metas, checksums),
            [e.value for e in entries if e is not None],
        )

    def get(self, msg: proto.GetValue, frames: list[Any]) -> Result:
        """From memory only (what does not suspend); see aget."""
        check_key(msg.key)
        return self._get_reply(msg.rid, self._counted(msg.key, self.store.get_memory(msg.key)))

    async def aget(self, msg: proto.GetValue, frames: list[Any]) -> Result:
        check_key(msg.key)
        return self._get_reply(msg.rid, await self.fetch(msg.key))

    def get_many(self, msg: proto.GetValues, frames: list[Any]) -> Result:
        _check_batch(msg.keys)
        get = self.store.get_memory
        return self._get_many_reply(msg.rid, [self._counted(k, get(k)) for k in msg.keys])

    async def aget_many(self, msg: proto.GetValues, frames: list[Any]) -> Result:
        _check_batch(msg.keys)
        return self._get_many_reply(msg.rid, await self.fetch_many(msg.keys))

    def exists(self, msg: proto.CheckValue, frames: list[Any]) -> Result:
        check_key(msg.key)
        return proto.CheckValueReply(msg.rid, self.store.contains(msg.key)), []

    def exists_many(self, msg: proto.CheckValues, frames: list[Any]) -> Result:
        _check_batch(msg.keys)
        contains = self.store.contains
        return proto.CheckValuesReply(msg.rid, [contains(k) for k in msg.keys]), []

    # -- deleting and listing -----------------------------------------------------------
    def delete(self, msg: proto.DeleteValue, frames: list[Any]) -> Result:
        check_key(msg.key)
        return proto.DeleteValueReply(msg.rid, self.store.delete(msg.key)), []

    def delete_many(self, msg: proto.DeleteValues, frames: list[Any]) -> Result:
        _check_batch(msg.keys)
        delete = self.store.delete
        return proto.DeleteValuesReply(msg.rid, [delete(k) for k in msg.keys]), []

    def list_keys(self, msg: proto.ListKeys, frames: list[Any]) -> Result:
        if not 1 <= msg.limit <= proto.MAX_LIST_LIMIT:
            raise RequestError(
                ErrorCode.BAD_MESSAGE, f"limit must be 1–{proto.MAX_LIST_LIMIT}, got {msg.limit}"
            )
        if msg.prefix:
            check_key(msg.prefix)
        try:
            keys, cursor = self.store.list_keys(msg.prefix, msg.cursor, msg.limit)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_MESSAGE, str(exc)) from None
        return proto.ListKeysReply(msg.rid, keys, cursor), []

    # -- introspection ------------------------------------------------------------------
    def get_stats(self, msg: proto.GetStats, frames: list[Any]) -> Result:
        store = self.store
        spill = store.spill
        return (
            proto.GetStatsReply(
                msg.rid,
                keys=store.keys_total,
                memory_bytes=store.used_bytes,
                max_memory=store.max_memory,
                spilled_keys=len(spill) if spill is not None else 0,
                spilled_bytes=spill.used_bytes if spill is not None else 0,
                hits=store.hits,
                misses=store.misses,
                evictions=store.evictions,
                connections=self._connections(),
                uptime_s=time.monotonic() - self.started,
            ),
            [],
        )

    def health(self, msg: proto.CheckHealth, frames: list[Any]) -> Result:
        return (
            proto.CheckHealthReply(msg.rid, True, proto.PROTOCOL_VERSION, self.uptime()),
            [],
        )

    def uptime(self) -> float:
        return time.monotonic() - self.started
