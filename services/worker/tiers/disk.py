"""L3: chunks in one local directory, one self-describing file per chunk.

- **Format** (disk_format.py; the header is common/chunk_codec.py's `FILE_LAYOUT`):
  a 4 KiB header (magic, version, full key, shape, dtype, memory format, payload
  length, xxh3 of the payload and of the header), then the payload. Files are named
  by the key's hash, never by a user string. With `codec` (engine.disk.compression)
  the payload is the codec's (common/codecs/, written only when smaller) and the
  header names the codec, so any tier reads any file; an entry's size is then the
  file's, smaller than header + chunk, which is how a read knows to decode.
- **Writes** go to a temporary name and are renamed into place, so a crash never
  leaves a half-written file under a real name; O_DIRECT when buffer and length are
  aligned (disk_io.py). `submit_put` never blocks: it takes a reference on the source
  object, held until its write ends, and queues the write on a priority pool of
  `io_threads` threads (disk_executor.py: reads before deletes before puts). A key
  already here or being written is not written again. When a put would exceed
  `max_size`, the eviction policy picks unpinned, unread chunks to delete first; if
  they do not make room, the put is dropped.
- **Reads** run on the same pool (`aget` awaits them without blocking the event loop);
  the checks of an `aget` run on a small pool of their own, so an I/O thread goes on
  to the next read while the last one is hashed (2 MiB O_DIRECT reads 0.76-0.80 of raw
  against 0.68-0.77 with the hash on the I/O thread, 2026-11-26). The file's header
  must match the index (key, shape, dtype, format, length) and the payload its
  checksum. A file that fails is deleted, counted in
  `kvmesh_disk_corrupt_total`, and the read is a miss: never wrong bytes.
- **Index**: a dict under a lock that is never held across I/O. An entry is WRITING
  (its file is not readable yet), READY, or DELETING (gone for lookups; the file is
  being removed). A key stays in the index until its file is gone, so two writes or a
  write and a delete of the same file never overlap.
- **Restart**: each tier owns its directory (an flock on `.lock`; a second tier on the
  same directory stays degraded until the first lets go). On start a background thread
  re-indexes the directory from the headers (disk_scan.py), oldest file first: lookups
  miss until a file is indexed, temporary and failing files are deleted, the maximum
  size is enforced, and progress is logged. Puts and deletes go on meanwhile: a key
  the tier wrote or deleted since the start is left to the index, never to what the
  scan saw of it (the old file of a key whose new write fails is indexed after all).
- **Degraded mode**: a write that fails (disk full, read-only filesystem, directory
  gone, any I/O error) logs once and marks the tier degraded: puts are dropped (reads
  go on where files are still readable) until `retry_s` later, when one put is let
  through as a probe; its success ends the degraded state. No error reaches the caller.

Durability: files are not fsynced. A process crash (kill -9) loses only writes in
flight, which stay temporary files; after a power loss a renamed file may hold stale
blocks, which the checksum catches on read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from pathlib import Path

import torch

from kvmesh.common.chunk_codec import (
    FILE_LAYOUT,
    ChunkHeader,
    CorruptChunk,
    check_key,
    chunk_bytes,
)
from kvmesh.common.chunk_codec import Codec as CodecId
from kvmesh.common.codecs import Codec
from kvmesh.common.codecs.stored import decode_chunk, encode_chunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.policy import make_policy
from kvmesh.services.worker.tiers.base import Allocator
from kvmesh.services.worker.tiers.disk_executor import Priority, PriorityExecutor
from kvmesh.services.worker.tiers.disk_format import (
    chunk_file_name,
    key_of_file_name,
    temp_file_name,
)
from kvmesh.services.worker.tiers.disk_io import (
    DIR_MODE,
    FILE_MODE,
    header_buffer,
    read_file,
    write_file,
)
from kvmesh.services.worker.tiers.disk_scan import (
    LOCK_FILE,
    ScannedFile,
    check_files,
    list_dir,
)
from kvmesh.services.worker.tiers.disk_stats import DiskStats
from kvmesh.services.worker.tiers.misses import MissReason, TierMisses

log = get_logger(__name__)

REINDEX_BATCH = 1024
# Threads checking what reads brought in; hashing is CPU work, one thread a core.
CHECK_THREADS = max(1, os.cpu_count() or 1)
PROGRESS_EVERY_S = 1.0
# Read errors of the process or the system, not of the file (out of descriptors or
# memory, interrupted): the read misses and the chunk stays.
TRANSIENT_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS}
)


class _State(IntEnum):
    WRITING = 0
    READY = 1
    DELETING = 2


@dataclass(slots=True, eq=False)
class _Entry:
    state: _State
    size: int  # bytes of the file: header + payload
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    pins: int = 0
    readers: int = 0
    # A rewrite is renaming this entry's file into place: deletes and evictions leave
    # it (and the entry) to the rewrite, which deletes it after the rename if need be.
    replacing: bool = False
    # Indexed from a file the re-index found: the scan is past its name, so deleting
    # it needs no note in `_gone` (which would grow with every eviction of a restart).
    found: bool = False

    @property
    def nbytes(self) -> int:
        """The chunk's bytes, uncompressed (a compressed file holds fewer)."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def compressed(self) -> bool:
        return self.size < FILE_LAYOUT.size + self.nbytes


class DiskTier:
    """The L3 tier over one directory; every method may be called from any thread."""

    name = "disk"
    waits_for_pages = True  # allocates on its I/O threads (tiers/base.py)

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_size: int,
        *,
        io_threads: int = 4,
        o_direct: bool = True,
        eviction_policy: str = "lru",
        retry_s: float = 30.0,
        max_pending_puts: int = 256,
        metrics: Metrics | None = None,
        codec: Codec | None = None,
        max_chunk_bytes: int | None = None,
    ) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be > 0, got {max_size}")
        if max_chunk_bytes is not None and max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes must be > 0, got {max_chunk_bytes}")
        self.path = str(Path(path))
        self.max_size = int(max_size)
        self.o_direct = o_direct
        self.retry_s = retry_s
        self.max_pending_puts = max_pending_puts
        self.codec = codec  # None: chunks are written raw
        # The largest chunk a read can land in (the engine's pool page): the re-index
        # drops files claiming more, which would be a hit and then a failed read each
        # time. None: not known, every size is indexed.
        self.max_chunk_bytes = max_chunk_bytes
        self.stats = DiskStats(metrics)
        self.misses = TierMisses(self.name, self.stats.metrics)
        self.stats.capacity.set(self.max_size)
        self._policy_name = eviction_policy
        self._policy = make_policy(eviction_policy)
        self._index: dict[ChunkKey, _Entry] = {}
        self._lock = threading.Lock()
        self._used = 0  # bytes of every entry, WRITING and DELETING included
        # Chunks whose file could not be deleted (EROFS, EACCES): no longer served, but
        # their bytes stay in `_used`, so the directory keeps to max_size; tried again
        # when the tier recovers.
        self._stuck: dict[ChunkKey, int] = {}
        # While the re-index runs, what it scanned may have changed since: keys whose
        # file this tier deleted (the index knows their state better than the scan),
        # and, for a key being written anew, the file the scan found under it (still
        # there, and the key's, if the write fails). None once the re-index ended.
        self._gone: set[ChunkKey] | None = set()
        self._shadowed: dict[ChunkKey, ScannedFile] = {}
        self._ready = 0  # READY entries
        self._pending_puts = 0
        self._closed = False
        # Temporary files carry this run's id, so the re-index leaves our own alone.
        self._run_id = uuid.uuid4().hex[:12]
        self._lock_fd: int | None = None
        self._degraded: str | None = None
        self._degraded_since = 0.0
        self._retry_at = 0.0
        self._probing = False
        self._indexed = threading.Event()
        self._stop = threading.Event()
        self._reindex_thread: threading.Thread | None = None
        self._exec = PriorityExecutor(io_threads, name="kvmesh-disk-io")
        # Reads' checks (xxh3 of the payload, decoding), apart from the I/O threads.
        self._checks = concurrent.futures.ThreadPoolExecutor(
            CHECK_THREADS, thread_name_prefix="kvmesh-disk-check"
        )
        try:
            self._acquire_dir()
        except OSError as exc:
            self._degrade(self._describe(exc, "open"))
        else:
            self._start_reindex()

    # -- directory ownership and the re-index ---------------------------------------------
    def _acquire_dir(self) -> None:
        """Create the directory and take its lock; OSError if either is impossible."""
        if self._lock_fd is not None:
            if os.path.isdir(self.path):
                return
            # The directory vanished under us: the old lock guards nothing any more.
            os.close(self._lock_fd)
            self._lock_fd = None
        # A directory made here is the engine user's alone; one that exists is left as
        # its owner set it (its files are FILE_MODE either way).
        os.makedirs(self.path, mode=DIR_MODE, exist_ok=True)
        lock_path = os.path.join(self.path, LOCK_FILE)
        # Held read-only: a file open for writing would keep the filesystem from being
        # remounted read-only, and flock needs no write access.
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, "directory in use by another kvmesh disk tier") from None
        except OSError:
            os.close(fd)
            raise
        with contextlib.suppress(OSError), open(lock_path, "w") as f:
            f.write(f"{os.getpid()}\n")  # for people: who holds it
        self._lock_fd = fd

    def _start_reindex(self) -> None:
        if self._reindex_thread is not None:
            return
        self._reindex_thread = threading.Thread(
            target=self._reindex, name="kvmesh-disk-reindex", daemon=True
        )
        self._reindex_thread.start()

    def _reindex(self) -> None:
        try:
            self._reindex_dir()
        except Exception as exc:  # never leave waiters hanging, whatever failed
            log.error("disk re-index failed", path=self.path, error=repr(exc))
        finally:
            with self._lock:
                self._gone = None
            self._indexed.set()

    def _reindex_dir(self) -> None:
        t0 = time.monotonic()
        self.stats.reindex_seconds.set(0)
        counts = {"kept": 0, "deleted": 0, "evicted": 0, "ignored": 0, "kept_bytes": 0}
        try:
            listing = list_dir(self.path, own_run_id=self._run_id, private=True)
        except OSError as exc:
            log.warning("disk re-index: directory unreadable", path=self.path, error=str(exc))
            return
        total = len(listing.chunks)
        counts["ignored"] = len(listing.ignored)
        log.info(
            "disk re-index started",
            path=self.path,
            files=total,
            temporary=len(listing.temps),
            ignored=len(listing.ignored),
        )
        for name in listing.temps:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, name))
                counts["deleted"] += 1
                self.stats.scanned["deleted"].inc()
        last_log = time.monotonic()
        for start in range(0, total, REINDEX_BATCH):
            if self._stop.is_set():
                break
            part = listing.chunks[start : start + REINDEX_BATCH]
            limit = self.max_chunk_bytes
            batch = list(check_files(self.path, part, max_nbytes=limit))  # still oldest first
            if not self._index_batch(batch, counts):
                break
            now = time.monotonic()
            if now - last_log >= PROGRESS_EVERY_S:
                last_log = now
                log.info(
                    "disk re-index progress",
                    path=self.path,
                    scanned=start + len(batch),
                    files=total,
                    **counts,
                )
        self.stats.scanned["kept"].inc(counts["kept"])
        elapsed = time.monotonic() - t0
        self.stats.reindex_seconds.set(elapsed)
        log.info(
            "disk re-index done", path=self.path, files=total, seconds=round(elapsed, 3), **counts
        )

    def _index_batch(self, batch: list[ScannedFile], counts: dict[str, int]) -> bool:
        """Index a batch of checked files (oldest first), delete the failing ones, evict
        down to the maximum size. False once the tier is closed."""
        bad: list[tuple[ChunkKey | None, _Entry | None, str, str]] = []
        with self._lock:
            if self._closed:
                return False
            for f in batch:
                if f.ok:
                    assert f.header is not None
                    key = f.header.key
                    if self._deleted_since_scan(key):
                        continue  # deleted (or replaced and deleted) since the scan
                    held = self._index.get(key)
                    if held is not None:
                        # Written again since the start: the new file counts. Until its
                        # rename (or a delete of the name), this file is still there:
                        # the key's if the write fails.
                        if held.state is not _State.READY:
                            self._shadowed[key] = f
                        continue
                    self._index[key] = _found_entry(f)
                    # Before the chunks this run stored: on a full directory those are
                    # the ones to keep (they were evicted first, every one of them).
                    self._policy.on_restore(key)
                    self._used += f.size
                    self._ready += 1
                    counts["kept"] += 1
                    counts["kept_bytes"] += f.size
                    continue
                # The name's key, not the header's (a misplaced file may name another):
                # the file unlinked below is that name's.
                key = key_of_file_name(f.name)
                if key is not None and (key in self._index or self._deleted_since_scan(key)):
                    continue  # a fresh write owns that name now, or the tier deleted it
                holder = None
                if key is not None:
                    # A placeholder keeps puts of this key away while the file goes.
                    holder = _Entry(_State.DELETING, 0, (), torch.uint8, MemoryFormat.BINARY)
                    self._index[key] = holder
                bad.append((key, holder, f.name, f.problem or ""))
            victims = self._evict_to_fit_locked(0) or []
        for key, holder, name, problem in bad:
            log.info("disk re-index: deleting failing file", file=name, problem=problem)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, name))
            counts["deleted"] += 1
            self.stats.scanned["deleted"].inc()
            if key is not None and holder is not None:
                self._forget(key, holder)
        counts["evicted"] += len(victims)
        self.stats.scanned["evicted"].inc(len(victims))
        self._delete_async(victims)
        self._update_gauges()
        return True

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Block until the start's re-index finished (True) or timeout passed."""
        return self._indexed.wait(timeout)

    # -- eviction -------------------------------------------------------------------------
    def _evictable(self, key: ChunkKey) -> bool:
        e = self._index[key]
        return e.state is _State.READY and e.pins == 0 and e.readers == 0 and not e.replacing

    def _evict_to_fit_locked(self, incoming: int) -> list[tuple[ChunkKey, _Entry]] | None:
        """Mark for deletion enough chunks that `incoming` more bytes fit; the victims,
        or None (and nothing marked) if the evictable chunks are not enough."""
        need = self._used + incoming - self.max_size
        if need <= 0:
            return []
        chosen: list[ChunkKey] = []
        freed = 0
        for key in self._policy:
            if self._evictable(key):
                chosen.append(key)
                freed += self._index[key].size
                if freed >= need:
                    break
        if freed < need:
            return None if incoming else self._mark_deleting_locked(chosen)
        return self._mark_deleting_locked(chosen)

    def _mark_deleting_locked(self, keys: Sequence[ChunkKey]) -> list[tuple[ChunkKey, _Entry]]:
        out = []
        for key in keys:
            e = self._index[key]
            if e.state is _State.READY:
                self._policy.on_remove(key)
                self._ready -= 1
            e.state = _State.DELETING
            out.append((key, e))
        return out

    def _delete_async(
        self, victims: Sequence[tuple[ChunkKey, _Entry]] | None, evicted: bool = True
    ) -> None:
        for key, entry in victims or ():
            if evicted:
                self.stats.evictions.inc()
                self.misses.evicted.add(key)
            try:
                self._exec.submit(Priority.DELETE, self._delete, key, entry)
            except RuntimeError:  # shut down: delete inline
                self._delete(key, entry)

    def _delete(self, key: ChunkKey, entry: _Entry) -> None:
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.stats.io_errors["delete"].inc()
            self._forget(key, entry, stuck=True)
            self._degrade(self._describe(exc, "delete"))
            return
        self._forget(key, entry)

    def _forget(self, key: ChunkKey, entry: _Entry, stuck: bool = False) -> None:
        with self._lock:
            self._shadowed.pop(key, None)  # the name was unlinked: whatever file it was
            if self._gone is not None and not entry.found:
                self._gone.add(key)
            if self._index.get(key) is entry:
                del self._index[key]
                if stuck:
                    self._stuck[key] = entry.size
                else:
                    self._used -= entry.size
                if entry.state is _State.READY:
                    self._policy.on_remove(key)
                    self._ready -= 1
        self._update_gauges()

    def _delete_stuck(self) -> None:
        """Try again to delete the files an earlier delete could not."""
        with self._lock:
            if not self._stuck:
                return
            # A placeholder keeps puts of the key away while its file goes.
            held = {
                key: _Entry(_State.DELETING, 0, (), torch.uint8, MemoryFormat.BINARY)
                for key in self._stuck
                if key not in self._index
            }
            self._index.update(held)
        for key, holder in held.items():
            try:
                os.unlink(self._file(key))
                gone = True
            except FileNotFoundError:
                gone = True
            except OSError:
                gone = False
            with self._lock:
                if self._index.get(key) is holder:
                    del self._index[key]
                if self._gone is not None:
                    self._gone.add(key)
                if gone:
                    self._used -= self._stuck.pop(key, 0)
        self._update_gauges()

    # -- put --------------------------------------------------------------------------------
    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        """Queue a copy of obj to disk; never blocks and never raises for I/O."""
        size = FILE_LAYOUT.size + obj.nbytes
        fmt = MemoryFormat(obj.fmt)
        probe = False
        with self._lock:
            if self._closed:
                return
            entry = self._index.get(key)
            if entry is not None:
                if entry.state is _State.READY:
                    self._policy.on_access(key)
                result = "duplicate"
            elif self._degraded is not None and (
                self._probing or time.monotonic() < self._retry_at
            ):
                result = "degraded"
            elif self._pending_puts >= self.max_pending_puts:
                result = "queue_full"
            elif size > self.max_size or (victims := self._evict_to_fit_locked(size)) is None:
                result = "no_space"
            else:
                result = ""
                if self._degraded is not None:
                    self._probing = probe = True
                entry = _Entry(_State.WRITING, size, tuple(obj.shape), obj.dtype, fmt)
                self._index[key] = entry
                self.misses.evicted.discard(key)
                self._used += size
                self._pending_puts += 1
        if result:
            self.stats.puts[result].inc()
            return
        obj.ref_up()  # held until the write ends
        self._delete_async(victims)
        try:
            fut = self._exec.submit(Priority.PUT, self._write, key, entry, obj, probe)
        except RuntimeError:  # closed meanwhile
            self._put_abandoned(key, entry, obj, probe)
            return
        fut.add_done_callback(
            lambda f: f.cancelled() and self._put_abandoned(key, entry, obj, probe)
        )
        self._update_gauges()

    def _put_abandoned(self, key: ChunkKey, entry: _Entry, obj: MemoryObj, probe: bool) -> None:
        """A queued put that will never run (shutdown): give everything back."""
        obj.ref_down()
        with self._lock:
            self._pending_puts -= 1
            if probe:
                self._probing = False
            if self._index.get(key) is entry:
                del self._index[key]
                self._used -= entry.size
            self._shadowed.pop(key, None)

    def _write(self, key: ChunkKey, entry: _Entry, obj: MemoryObj, probe: bool) -> None:
        final = self._file(key)
        tmp = os.path.join(self.path, temp_file_name(key, self._run_id))
        t0 = time.perf_counter()
        try:
            try:
                if probe:
                    self._acquire_dir()
                header, payload, raw_sum = encode_chunk(
                    key, obj, self.codec, checksum=obj.checksum, written_ns=time.time_ns()
                )
                # Kept on the object, so a peer or another tier that needs it later
                # does not hash the same bytes again.
                obj.checksum = raw_sum
                hdr = header_buffer()
                FILE_LAYOUT.pack_into(header, hdr)
                write_file(tmp, [hdr, memoryview(payload)], self.o_direct)
            finally:
                obj.ref_down()  # the source buffer is free once the bytes are out
            os.rename(tmp, final)
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.stats.io_errors["write"].inc()
            self.stats.puts["error"].inc()
            with self._lock:
                self._pending_puts -= 1
                if self._index.get(key) is entry:
                    del self._index[key]
                    self._used -= entry.size
                if probe:
                    self._probing = False
                restored = self._restore_shadowed_locked(key, entry)
            if restored is not None:
                self._delete_async([(key, restored)], evicted=False)
            if isinstance(exc, OSError):
                self._degrade(self._describe(exc, "write"))
            else:  # this chunk cannot be written (not the disk's fault)
                log.warning("disk put failed", key=key.to_str(), error=repr(exc))
            self._update_gauges()
            return
        self.stats.io_seconds["write"].observe(time.perf_counter() - t0)
        self.stats.bytes_written.inc(FILE_LAYOUT.total_size(header))
        self.stats.puts["written"].inc()
        removed = False
        with self._lock:
            self._pending_puts -= 1
            self._used -= self._stuck.pop(key, 0)  # the rename replaced that file
            if probe:
                self._probing = False
            # A compressed chunk took less than the room reserved for it.
            size = FILE_LAYOUT.total_size(header)
            self._shadowed.pop(key, None)  # the rename replaced the file the scan saw
            if self._index.get(key) is entry:
                self._used += size - entry.size
            entry.size = size
            if entry.state is _State.DELETING:
                removed = True  # removed while it was being written
            elif self._index.get(key) is entry:
                entry.state = _State.READY
                self._policy.on_insert(key)
                self._ready += 1
        if removed:
            self._delete(key, entry)
        if probe:
            self._recover()
        if self._reindex_thread is None:
            self._start_reindex()  # the directory became usable after a failed start
        self._update_gauges()

    def _deleted_since_scan(self, key: ChunkKey) -> bool:
        """Whether this tier deleted key's file while the re-index runs (under _lock)."""
        return self._gone is not None and key in self._gone

    def _restore_shadowed_locked(self, key: ChunkKey, entry: _Entry) -> _Entry | None:
        """A write of key failed: the older file the re-index found under key (skipped
        for the write) is still there, so it is indexed after all; or, if the chunk was
        removed meanwhile, returned (DELETING) for the caller to delete."""
        f = self._shadowed.pop(key, None)
        if f is None or f.header is None or key in self._index or self._closed:
            return None
        old = self._index[key] = _found_entry(f)
        self._used += f.size
        if entry.state is _State.DELETING:
            old.state = _State.DELETING
            return old
        self._policy.on_restore(key)
        self._ready += 1
        return None

    # -- degraded mode ----------------------------------------------------------------------
    def _describe(self, exc: BaseException, op: str) -> str:
        if isinstance(exc, OSError) and exc.errno is not None:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.isdir(self.path):
                return "directory vanished"
            name = errno.errorcode.get(exc.errno, str(exc.errno))
            return f"{op} failed: {name} ({exc.strerror})"
        return f"{op} failed: {exc!r}"

    def _degrade(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            first = self._degraded is None
            self._degraded = reason
            if first:
                self._degraded_since = now
            self._retry_at = now + self.retry_s
            lost: list[tuple[ChunkKey, _Entry]] = []
            if reason == "directory vanished":
                # Every file is gone with it: forget them.
                lost = [(k, e) for k, e in self._index.items() if e.state is _State.READY]
                for key, _e in lost:
                    del self._index[key]
                    self._policy.on_remove(key)
                    self._used -= _e.size
                self._ready -= len(lost)
                self._used -= sum(self._stuck.values())
                self._stuck.clear()
                # Files the re-index skipped for a write in flight went too: a write
                # that then fails must not index them back.
                self._shadowed.clear()
        self.stats.degraded.set(1)
        if first:
            log.warning(
                "disk tier degraded: puts are skipped, the engine serves from other tiers",
                path=self.path,
                reason=reason,
                retry_s=self.retry_s,
                forgotten_chunks=len(lost),
            )
        else:
            log.debug("disk tier still degraded", path=self.path, reason=reason)

    def _recover(self) -> None:
        with self._lock:
            reason, self._degraded = self._degraded, None
        self._delete_stuck()
        if reason is not None:
            self.stats.degraded.set(0)
            log.info(
                "disk tier recovered",
                path=self.path,
                was=reason,
                after_s=round(time.monotonic() - self._degraded_since, 1),
            )

    @property
    def degraded(self) -> str | None:
        """Why the tier is degraded, or None when it is healthy."""
        return self._degraded

    # -- get --------------------------------------------------------------------------------
    def _submit_read(
        self, key: ChunkKey, allocator: Allocator, verify: bool = True
    ) -> concurrent.futures.Future | None:
        """The read of key on the I/O pool: its future gives the chunk (or None), or
        with verify=False the `_Landed` bytes still to be checked by `_check`."""
        with self._lock:
            if self._closed:
                self.misses.inc(MissReason.ERROR)
                return None
            entry = self._index.get(key)
            if entry is None or entry.state is not _State.READY:
                entry = None
            else:
                entry.readers += 1
                self._policy.on_access(key)
        if entry is None:
            self._miss_absent(key)
            return None
        fn = self._read if verify else self._read_bytes
        try:
            fut = self._exec.submit(Priority.PREFETCH, fn, key, entry, allocator)
        except RuntimeError:
            self._end_read(entry)
            self.misses.inc(MissReason.ERROR)
            return None
        fut.add_done_callback(lambda _f: self._end_read(entry))
        return fut

    def _end_read(self, entry: _Entry) -> None:
        with self._lock:
            entry.readers -= 1

    def get(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        fut = self._submit_read(key, allocator)
        if fut is None:
            return None
        try:
            return fut.result()
        except concurrent.futures.CancelledError:  # the pool shut down before the read
            self.misses.inc(MissReason.ERROR)
            return None

    async def aget(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        """The chunk read on the I/O pool and checked on the check pool (an I/O thread
        goes on to the next read instead of hashing: the device stays busy); the event
        loop only awaits."""
        fut = self._submit_read(key, allocator, verify=False)
        if fut is None:
            return None
        try:
            landed = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The read may still finish: its buffer must go back to the allocator.
            fut.add_done_callback(_drop_landed_result)
            if _cancelled_by_pool(fut):  # close() dropped the queued read
                self.misses.inc(MissReason.ERROR)
                return None
            raise
        if landed is None:
            return None
        try:
            checked = self._checks.submit(self._check, landed)
        except RuntimeError:  # closed meanwhile
            _drop_landed(landed)
            self.misses.inc(MissReason.ERROR)
            return None
        try:
            return await asyncio.wrap_future(checked)
        except asyncio.CancelledError:
            # A check not yet started is cancelled with us: its buffer is dropped here.
            checked.add_done_callback(
                lambda f: _drop_landed(landed) if f.cancelled() else _drop_result(f)
            )
            if _cancelled_by_pool(checked):
                self.misses.inc(MissReason.ERROR)
                return None
            raise

    def _read(self, key: ChunkKey, entry: _Entry, allocator: Allocator) -> MemoryObj | None:
        landed = self._read_bytes(key, entry, allocator)
        return None if landed is None else self._check(landed)

    def _read_bytes(self, key: ChunkKey, entry: _Entry, allocator: Allocator) -> _Landed | None:
        """The file's header and payload in a buffer of allocator's; None (a miss,
        counted) when there is no buffer or the read fails."""
        try:
            return self._read_io(key, entry, allocator)
        except Exception as exc:
            self._read_error(key, exc)
            return None

    def _read_io(self, key: ChunkKey, entry: _Entry, allocator: Allocator) -> _Landed | None:
        try:
            obj = allocator.allocate(torch.Size(entry.shape), entry.dtype, entry.fmt)
        except Exception as exc:
            log.debug("disk read skipped: no buffer", key=key.to_str(), error=str(exc))
            obj = None
        if obj is None:
            self.stats.gets["miss"].inc()
            self.misses.inc(MissReason.ERROR)  # no L1 buffer to read into
            return None
        t0 = time.perf_counter()
        hdr = header_buffer()
        # A rewrite renaming the file into place: the file opened may be the old one.
        renaming = entry.replacing
        try:
            payload = chunk_bytes(obj)
            if entry.compressed:  # read into a scratch buffer, decoded into obj below
                payload = memoryview(bytearray(entry.size - FILE_LAYOUT.size))
            n = read_file(self._file(key), [hdr, payload], self.o_direct)
        except BaseException as exc:
            obj.ref_down()
            if not isinstance(exc, OSError):
                raise
            if isinstance(exc, FileNotFoundError) and self._removed_since(key, entry):
                # Removed after the read was queued, its file deleted before the open:
                # a plain miss, not an I/O error of the disk.
                self._miss_absent(key)
                return None
            self.stats.io_errors["read"].inc()
            self.stats.gets["error"].inc()
            self.misses.inc(MissReason.ERROR)
            self._read_failed(key, entry, exc)
            return None
        # The header buffer is this I/O thread's, reused by its next read: the check,
        # on another thread, gets a copy (4 KiB).
        return _Landed(key, entry, obj, memoryview(hdr.tobytes()), payload, n, t0, renaming)

    def _miss_absent(self, key: ChunkKey) -> None:
        self.stats.gets["miss"].inc()
        self.misses.count_absent(key)

    def _removed_since(self, key: ChunkKey, entry: _Entry) -> bool:
        with self._lock:
            return self._index.get(key) is not entry or entry.state is not _State.READY

    def _read_error(self, key: ChunkKey, exc: Exception) -> None:
        """A read that failed unexpectedly: a miss, whatever went wrong."""
        self.stats.gets["error"].inc()
        self.misses.inc(MissReason.ERROR)
        log.warning("disk read failed", key=key.to_str(), error=repr(exc))

    def _check(self, landed: _Landed) -> MemoryObj | None:
        """Landed bytes verified and decoded into their buffer: the chunk, or None (a
        miss, counted; a corrupt file is deleted). Takes over landed's buffer."""
        key, entry, obj = landed.key, landed.entry, landed.obj
        try:
            _, checksum = self._verify(key, entry, landed.hdr, landed.payload, landed.n, obj)
        except CorruptChunk as exc:
            obj.ref_down()
            self._corrupt(key, entry, str(exc), landed.renaming)
            return None
        except Exception as exc:
            obj.ref_down()
            self._read_error(key, exc)
            return None
        except BaseException:
            obj.ref_down()
            raise
        obj.key = key
        obj.checksum = checksum
        self.stats.io_seconds["read"].observe(time.perf_counter() - landed.t0)
        self.stats.bytes_read.inc(landed.n)
        self.stats.gets["hit"].inc()
        return obj

    def _verify(
        self,
        key: ChunkKey,
        entry: _Entry,
        hdr: memoryview,
        payload: memoryview,
        n: int,
        obj: MemoryObj,
    ) -> tuple[ChunkHeader, int | None]:
        """The file's header (and obj's checksum) once it and the payload pass every
        check, the payload decoded into obj; CorruptChunk saying which failed
        otherwise."""
        if n != entry.size:
            raise CorruptChunk(f"file holds {n} bytes, expected {entry.size}")
        try:
            header = FILE_LAYOUT.parse(hdr)
        except CorruptChunk as exc:
            raise CorruptChunk(f"bad header: {exc}") from None
        check_key(header, key)
        if (header.shape, header.dtype, header.fmt, header.nbytes) != (
            entry.shape,
            entry.dtype,
            entry.fmt,
            entry.nbytes,
        ):
            raise CorruptChunk("header does not match the index (shape, dtype, format or length)")
        return header, decode_chunk(header, payload, obj)

    def _corrupt(self, key: ChunkKey, entry: _Entry, problem: str, renaming: bool = False) -> None:
        """A read whose bytes failed their checks: the file is deleted, unless the file
        read may not be the entry's (renaming: opened while a rewrite renamed the new
        file into place; or the entry replaced or removed since), which is a plain miss,
        not corruption."""
        self.stats.gets["miss"].inc()
        with self._lock:
            current = (
                self._index.get(key) is entry
                and entry.state is _State.READY
                and not entry.replacing
                and not renaming
            )
            if current:
                self._mark_deleting_locked([key])
        if not current:
            self.misses.inc(MissReason.ERROR)
            log.debug("disk read of a file being replaced missed", key=key.to_str())
            return
        self.misses.inc(MissReason.CHECKSUM)
        self.stats.corrupt.inc()
        log.warning("corrupt disk chunk deleted", key=key.to_str(), problem=problem)
        self._delete(key, entry)

    def _read_failed(self, key: ChunkKey, entry: _Entry, exc: OSError) -> None:
        reason = self._describe(exc, "read")
        if reason == "directory vanished":
            self._degrade(reason)
            return
        if exc.errno in TRANSIENT_ERRNOS:
            log.warning("disk read failed: chunk kept", key=key.to_str(), error=reason)
            return
        log.warning("disk read failed: chunk dropped", key=key.to_str(), error=reason)
        with self._lock:
            if self._index.get(key) is not entry or entry.state is not _State.READY:
                return
            if entry.replacing:
                return  # the rewrite deletes it if need be
            self._mark_deleting_locked([key])
        self._delete(key, entry)

    # -- rewrite (compress / decompress) -----------------------------------------------------
    def rewrite(self, key: ChunkKey, codec: Codec | None, allocator: Allocator) -> str:
        """Store the chunk again through codec (None: raw): "rewritten", "unchanged"
        (already stored so, or the codec does not pay off), "absent", or "failed".

        Atomic for readers: the new file is written beside the old and renamed over it,
        so a reader gets the old file or the new one, whole. The index gets a new entry
        (the new size) just before the rename, which runs outside the lock (never held
        across I/O): lookups go on, and the entry is `replacing` until the rename ended,
        so a delete meanwhile is left to the rewrite (a chunk removed meanwhile stays
        removed, and no put of the key overlaps the rename). A read whose entry and file
        do not match (one that began on the old entry, or opened the file during the
        rename) misses once, never deletes a file nor counts as corruption."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.state is not _State.READY or self._closed:
                return "absent"
            entry.readers += 1
        tmp = os.path.join(self.path, temp_file_name(key, self._run_id))
        obj: MemoryObj | None = None
        try:
            obj = allocator.allocate(torch.Size(entry.shape), entry.dtype, entry.fmt)
            if obj is None:
                return "failed"
            hdr = header_buffer()
            payload = memoryview(bytearray(entry.size - FILE_LAYOUT.size))
            n = read_file(self._file(key), [hdr, payload], self.o_direct)
            old, checksum = self._verify(key, entry, hdr, payload, n, obj)
            target = CodecId.NONE if codec is None else codec.id
            if old.codec == target:
                return "unchanged"
            header, stored, _ = encode_chunk(key, obj, codec, checksum=checksum)
            if header.codec == old.codec:
                return "unchanged"  # the codec did not pay off: the file stays as it is
            header = replace(header, written_ns=old.written_ns or time.time_ns())
            out = header_buffer()
            FILE_LAYOUT.pack_into(header, out)
            write_file(tmp, [out, memoryview(stored)], self.o_direct)
            size = FILE_LAYOUT.total_size(header)
            fresh = _Entry(_State.READY, size, entry.shape, entry.dtype, entry.fmt)
            with self._lock:
                gone = self._index.get(key) is not entry or entry.state is not _State.READY
                if not gone:
                    # In place before the rename, so a read that starts once the new file
                    # is there finds the entry that matches it.
                    fresh.pins, fresh.replacing = entry.pins, True
                    self._index[key] = fresh  # keeps entry's place in the eviction order
                    self._used += size - entry.size
            if gone:
                os.unlink(tmp)
                return "absent"  # removed or evicted meanwhile: it stays so
            try:
                os.rename(tmp, self._file(key))
            except BaseException:
                self._end_replacing(key, fresh, entry)
                raise
            if not self._end_replacing(key, fresh):
                return "absent"  # removed during the rename: deleted
        except CorruptChunk as exc:
            self._corrupt(key, entry, str(exc))
            return "failed"
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("disk rewrite failed", key=key.to_str(), error=repr(exc))
            return "failed"
        finally:
            self._end_read(entry)
            if obj is not None:
                obj.ref_down()
        self.stats.bytes_written.inc(size)
        self._update_gauges()
        return "rewritten"

    def _end_replacing(self, key: ChunkKey, fresh: _Entry, old: _Entry | None = None) -> bool:
        """A rewrite's rename ended; with old, it failed: old (its file is still there)
        takes fresh's place back. False when the chunk was removed meanwhile: its file
        is deleted now."""
        with self._lock:
            fresh.replacing = False
            removed = fresh.state is _State.DELETING
            if old is not None and not removed and self._index.get(key) is fresh:
                old.pins = fresh.pins
                self._index[key] = old
                self._used += old.size - fresh.size
        if removed:
            self._delete(key, fresh)
        return not removed

    # -- lookups, pins, management ----------------------------------------------------------
    def contains(self, key: ChunkKey, pin: bool = False) -> bool:
        with self._lock:
            e = self._index.get(key)
            if e is None or e.state is not _State.READY:
                return False
            if pin:
                e.pins += 1
            return True

    def batched_contains(self, keys: Sequence[ChunkKey], pin: bool = False) -> int:
        n = 0
        with self._lock:
            index = self._index
            for key in keys:
                e = index.get(key)
                if e is None or e.state is not _State.READY:
                    break
                if pin:
                    e.pins += 1
                n += 1
        return n

    def pin(self, key: ChunkKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: ChunkKey) -> bool:
        with self._lock:
            e = self._index.get(key)
            if e is None or e.pins == 0:
                return False
            e.pins -= 1
            return True

    def touch(self, key: ChunkKey) -> None:
        with self._lock:
            e = self._index.get(key)
            if e is not None and e.state is _State.READY:
                self._policy.on_access(key)

    def remove(self, key: ChunkKey, force: bool = False) -> bool:
        """Delete the chunk unless it is pinned (or force); True if it was here."""
        with self._lock:
            e = self._index.get(key)
            if e is None or e.state is _State.DELETING or (e.pins and not force):
                return False
            deferred = e.state is _State.WRITING or e.replacing
            self._mark_deleting_locked([key])
        if not deferred:  # a write or rename in flight deletes the file when it ends
            self._delete_async([(key, e)], evicted=False)
        return True

    def clear(self) -> int:
        with self._lock:
            keys = [
                k for k, e in self._index.items() if e.state is not _State.DELETING and not e.pins
            ]
        return sum(self.remove(k) for k in keys)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return [k for k, e in self._index.items() if e.state is _State.READY]

    def __len__(self) -> int:
        return self._ready

    @property
    def used_bytes(self) -> int:
        return self._used

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put and delete has ended (tests, benchmarks, close)."""
        return self._exec.wait_idle(timeout)

    def _file(self, key: ChunkKey) -> str:
        return os.path.join(self.path, chunk_file_name(key))

    def _update_gauges(self) -> None:
        s = self.stats
        s.usage.set(self._used)
        s.chunks.set(self._ready)
        s.pending_puts.set(self._pending_puts)

    def close(self) -> None:
        """Stop the re-index, drop queued reads and puts, finish deletes, let go of the
        directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._reindex_thread is not None:
            self._reindex_thread.join(30)
        self._exec.shutdown(cancel=(Priority.PREFETCH, Priority.PUT))
        self._checks.shutdown(wait=True)  # checks are short: each gives its buffer back
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        with self._lock:
            self._index.clear()
            self._stuck.clear()
            self._policy = make_policy(self._policy_name)
            self._used = self._ready = 0
        log.info("disk tier closed", path=self.path)


@dataclass(slots=True)
class _Landed:
    """A read's bytes, in place but not yet checked."""

    key: ChunkKey
    entry: _Entry
    obj: MemoryObj
    hdr: memoryview
    payload: memoryview
    n: int
    t0: float
    renaming: bool  # opened while a rewrite renamed the entry's file into place


def _found_entry(f: ScannedFile) -> _Entry:
    """The entry of a chunk file the re-index checked (its header is known good)."""
    h = f.header
    assert h is not None
    return _Entry(_State.READY, f.size, h.shape, h.dtype, h.fmt, found=True)


def _cancelled_by_pool(fut: concurrent.futures.Future) -> bool:
    """Whether the CancelledError awaiting fut raised comes from fut's pool shutting
    down (a miss), not from the awaiting task being cancelled (passed on)."""
    task = asyncio.current_task()
    return fut.cancelled() and (task is None or not task.cancelling())


def _drop_landed(landed: _Landed | None) -> None:
    if landed is not None:
        landed.obj.ref_down()


def _drop_landed_result(fut: concurrent.futures.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        _drop_landed(fut.result())


def _drop_result(fut: concurrent.futures.Future) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    obj = fut.result()
    if obj is not None:
        obj.ref_down()
