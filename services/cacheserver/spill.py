"""Spill: where the cache-server's memory LRU sends what it evicts, one file per value.

A spill file is a fixed header, then the key, the meta and the value:

| offset | size | field |
|---:|---:|---|
| 0 | 8 | magic `b"KVMSPIL1"` |
| 8 | 4 | key length |
| 12 | 4 | meta length |
| 16 | 8 | value length |
| 24 | 8 | xxh3-64 of the value (the entry's checksum) |
| 32 | 8 | xxh3-64 of bytes 0–31, the key and the meta |

File names come from a hash of the key plus a sequence number
(`<xxh3-128 hex>-<seq>.val`), never from the key itself. Writes go to a `.tmp` name
and are renamed into place. A read checks the header checksum, the key and the value
checksum; a file that fails is deleted and the read is a miss.

The spill is a cache of the memory tier, not a store: it is bounded by `max_size`
(oldest files deleted first) and starts empty (leftover files are deleted on start).
I/O runs on a small thread pool; the index is only touched on the event loop. A write
that fails because the disk is full or read-only, or the directory is gone or not
writable (or the disk fails), pauses spilling for `retry_s` (what would have been
spilled is dropped), rather than failing every eviction the same way. The directory
is not made again: where a volume went away, that would fill the disk beneath it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvmesh.common.observability import get_logger
from kvmesh.services.cacheserver.store import Entry, checksum_of

log = get_logger(__name__)

MAGIC = b"KVMSPIL1"
_HEAD = struct.Struct("<8sIIQQ")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _HEAD.size + _CHECK.size
SUFFIX = ".val"
# Write errors that every following write would hit too: a full or read-only disk, a
# directory removed or made unwritable (one warning per eviction otherwise: 1,937 of
# them for 2,000 puts into a spill whose directory was deleted), a failing disk.
_DISK_FULL = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EIO,
)


class SpillCorrupt(ValueError):
    pass


def pack_file_header(key: bytes, meta: bytes, value_len: int, checksum: int) -> bytes:
    head = _HEAD.pack(MAGIC, len(key), len(meta), value_len, checksum)
    check = xxhash.xxh3_64_intdigest(head + key + meta)
    return head + _CHECK.pack(check) + key + meta


def parse_file(data: bytes, key: bytes) -> tuple[bytes, memoryview, int]:
    """(meta, value view, checksum) of a spill file's bytes, all checks passed."""
    if len(data) < HEADER_SIZE:
        raise SpillCorrupt("file shorter than its header")
    magic, key_len, meta_len, value_len, checksum = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SpillCorrupt("bad magic")
    (check,) = _CHECK.unpack_from(data, _HEAD.size)
    body = HEADER_SIZE + key_len + meta_len
    if len(data) != body + value_len:
        raise SpillCorrupt(f"size {len(data)} does not match the header ({body + value_len})")
    if xxhash.xxh3_64_intdigest(data[: _HEAD.size] + data[HEADER_SIZE:body]) != check:
        raise SpillCorrupt("header checksum mismatch")
    if data[HEADER_SIZE : HEADER_SIZE + key_len] != key:
        raise SpillCorrupt("file holds another key")
    meta = data[HEADER_SIZE + key_len : body]
    value = memoryview(data)[body:]
    if checksum_of(value) != checksum:
        raise SpillCorrupt("value checksum mismatch")
    return meta, value, checksum


@dataclass(slots=True)
class _Spilled:
    name: str
    size: int


class DiskSpill:
    """Files for evicted entries under `path`, bounded by `max_size` bytes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_size: int,
        *,
        max_backlog: int = 256 << 20,
        io_threads: int = 2,
        retry_s: float = 30.0,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.max_size = max_size
        self.max_backlog = max_backlog
        self.retry_s = retry_s
        self._retry_at = 0.0  # no spilling before this (monotonic): the disk is full
        self._index: OrderedDict[str, _Spilled] = OrderedDict()  # written files, LRU
        self._pending: dict[str, Entry] = {}  # being written: still readable from memory
        self._backlog = 0
        self.used_bytes = 0
        self._seq = 0
        self.dropped = 0
        self.corrupt = 0
        self.on_forget: Callable[[str], None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, "kvmesh-spill")
        removed = self._wipe()
        if removed:
            log.info("spill: deleted leftover files", path=str(self.path), files=removed)

    def _wipe(self) -> int:
        """Delete leftover spill files; how many. One that cannot be deleted (a
        directory remounted read-only after a disk error) stays, with one warning:
        the spill is a cache, and its writes pause themselves on such a directory,
        so the server starts rather than dying on a traceback. A leftover is never
        read (the index starts empty) and a write of its name replaces it."""
        n = kept = 0
        error: OSError | None = None
        try:
            entries = list(os.scandir(self.path))
        except OSError as exc:  # unreadable (EIO): nothing known to delete
            entries, error = [], exc
        for entry in entries:
            try:
                if not entry.name.endswith((SUFFIX, ".tmp")) or not entry.is_file():
                    continue
                os.unlink(entry.path)
                n += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                kept += 1
                error = error or exc
        if error is not None:
            log.warning(
                "spill: leftover files not deleted",
                path=str(self.path),
                files=kept,
                error=str(error),
            )
        return n

    def __len__(self) -> int:
        return len(self._index) + len(self._pending)

    def __contains__(self, key: str) -> bool:
        return key in self._index or key in self._pending

    # -- writes -------------------------------------------------------------------
    def submit(self, key: str, entry: Entry) -> bool:
        """Start writing an evicted entry; False (dropped) when it cannot fit, the
        write backlog is full or spilling is paused."""
        size = HEADER_SIZE + len(key.encode()) + len(entry.meta) + entry.nbytes
        if (
            size > self.max_size
            or self._backlog + entry.nbytes > self.max_backlog
            or time.monotonic() < self._retry_at
        ):
            self.dropped += 1
            return False
        self.discard(key)
        while self._index and self.used_bytes + size > self.max_size:
            old_key, old = self._index.popitem(last=False)
            self.used_bytes -= old.size
            self._unlink_later(old.name)
            if self.on_forget is not None:
                self.on_forget(old_key)
        if self.used_bytes + size > self.max_size:  # the rest is still being written
            self.dropped += 1
            return False
        self._seq += 1
        name = f"{xxhash.xxh3_128_hexdigest(key.encode())}-{self._seq}{SUFFIX}"
        self._pending[key] = entry
        self._backlog += entry.nbytes
        self.used_bytes += size
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, self._write, name, key, entry)
        fut.add_done_callback(lambda f: self._written(f, key, entry, name, size))
        return True

    def _write(self, name: str, key: str, entry: Entry) -> None:
        header = pack_file_header(key.encode(), entry.meta, entry.nbytes, entry.checksum)
        tmp = self.path / (name + ".tmp")
        try:
            # Spilled values are clients' KV: readable by the server's own user only.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(header)
                f.write(entry.view)
            os.rename(tmp, self.path / name)
        except BaseException:
            # A part-written file is counted nowhere: it would stay until a restart.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _written(self, fut: asyncio.Future, key: str, entry: Entry, name: str, size: int) -> None:
        self._backlog -= entry.nbytes
        current = self._pending.get(key) is entry
        if current:
            del self._pending[key]
        exc = fut.exception()
        if exc is not None or not current:
            self.used_bytes -= size
            self._unlink_later(name)
            if exc is not None:
                now = time.monotonic()
                if now >= self._retry_at:  # once per pause, not for each write queued
                    full = isinstance(exc, OSError) and exc.errno in _DISK_FULL
                    if full:
                        self._retry_at = now + self.retry_s
                    log.warning(
                        "spill write failed", error=repr(exc), paused_s=self.retry_s if full else 0
                    )
                self.dropped += 1
                if current and self.on_forget is not None:
                    self.on_forget(key)
            return
        self._index[key] = _Spilled(name, size)

    def discard(self, key: str) -> bool:
        """Forget key (its file is deleted in the background)."""
        if self._pending.pop(key, None) is not None:
            return True  # _written sees it is no longer current and cleans up
        old = self._index.pop(key, None)
        if old is None:
            return False
        self.used_bytes -= old.size
        self._unlink_later(old.name)
        return True

    def _unlink_later(self, name: str) -> None:
        try:
            self._pool.submit(_unlink_quietly, self.path / name)
        except RuntimeError:  # closed: a write that ended after close() cleans up here
            _unlink_quietly(self.path / name)

    # -- reads --------------------------------------------------------------------
    async def read(self, key: str) -> Entry | None:
        """The key's current entry, verified; None when it is gone or its file fails its
        checks (the file is then deleted)."""
        loop = asyncio.get_running_loop()
        while True:
            pending = self._pending.get(key)
            if pending is not None:
                return pending
            spilled = self._index.get(key)
            if spilled is None:
                return None
            try:
                # The read and the checksum check, both on the pool's thread.
                meta, view, checksum = await loop.run_in_executor(
                    self._pool, _read_parsed, self.path / spilled.name, key.encode()
                )
            except (OSError, SpillCorrupt) as exc:
                if self._index.get(key) is not spilled:
                    continue  # evicted or replaced while read: gone, not corrupt
                self.corrupt += 1
                log.warning("spill file dropped", error=str(exc))
                self.discard(key)
                if self.on_forget is not None:
                    self.on_forget(key)
                return None
            if self._index.get(key) is spilled:
                return Entry(view, view, meta, checksum)
            # The key was put again (or deleted) while its file was read: what was read
            # may be older than its value now, so look again.

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _read_parsed(path: Path, key: bytes) -> tuple[bytes, memoryview, int]:
    return parse_file(_read_all(path), key)


def _read_all(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # Nothing awaits this: unsaid, the file would stay on disk, counted nowhere.
        log.warning("spill file not deleted", path=str(path), error=str(exc))
