"""`fs:///path`: a filesystem every worker mounts (NFS, CephFS, Lustre...).

Files use the disk tier's format (disk_format.py: common/chunk_codec.py's
`FILE_LAYOUT`, a 4 KiB self-describing header with the key, shape, dtype, format and
checksums, then the raw chunk), laid out the same way:
`<path>/<namespace id>/<ns id>-<hash>.kv`. Writes go to a hidden temporary name and
are renamed into place, so readers on other hosts never see half a file. Values are
never compressed here (the connector says `compresses = False`; the format could carry a
codec since version 2, see common/chunk_codec.py).

Nothing here evicts: bound the directory with the filesystem's quota or a periodic
cleaner (oldest access first). A writer killed mid-write leaves its temporary file
behind; each start removes those older than `STALE_TEMP_S` (a live writer's are newer:
every write touches its file), in the background. A full or read-only filesystem
refuses puts (`StoreFull`) while its files still read. All I/O runs on a small thread
pool, so a slow mount delays only the requests that touch it, and the tier's deadlines
still apply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.common.chunk_codec import FILE_LAYOUT, ChunkHeader, CorruptChunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.observability import get_logger
from kvmesh.services.worker.tiers.disk_format import (
    chunk_file_name,
    is_temp_file_name,
    temp_file_name,
)
from kvmesh.services.worker.tiers.remote_connector import Fetched, StoreFull, ValueRefused

log = get_logger(__name__)

IO_THREADS = 4
# A temporary file untouched this long is a dead writer's, never a live one's.
STALE_TEMP_S = 3600.0
# Errors of a put that leave the files readable: the store refuses writes, not down.
_REFUSING = {errno.ENOSPC: "", errno.EDQUOT: "", errno.EROFS: "read-only: "}


class FsConnector:
    scheme = "fs"
    compresses = False

    def __init__(self, url: str) -> None:
        path = url.partition("://")[2]
        if not path.startswith("/"):
            raise ValueError(f"fs:// needs an absolute path (fs:///data/kv), got {url!r}")
        self.root = Path(path)
        self._url = url
        self._run = uuid.uuid4().hex[:12]
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._swept = False
        # Stale temporary files the start's sweep removed (None until it finished).
        self.stale_temps_removed: int | None = None

    @property
    def display(self) -> str:
        return self._url

    def connected(self) -> bool | None:
        return None

    def _path(self, key: ChunkKey) -> Path:
        return self.root / key.namespace_id / chunk_file_name(key)

    async def _io(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            raise ConnectionError("not open")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def reconnect(self) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, "kvmesh-remote-fs")
        await self._io(self._check_root)
        if not self._swept:
            self._swept = True
            # On a thread of its own: a large shared tree takes long to list, the
            # reconnect has a deadline, and gets need the pool meanwhile. A daemon, so
            # a sweep still listing never holds up the process's exit.
            threading.Thread(target=self._sweep_temps, name="kvmesh-fs-sweep", daemon=True).start()

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root} is not a directory")
        if not os.access(self.root, os.W_OK | os.X_OK) and not self._read_only_mount():
            raise PermissionError(f"{self.root} is not writable")

    def _read_only_mount(self) -> bool:
        """A readable root on a read-only mount (an ro export, a remount after disk
        errors): its files still serve gets, and puts are refused."""
        try:
            ro = bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)
        except OSError:
            return False
        return ro and os.access(self.root, os.R_OK | os.X_OK)

    def _fs_now(self) -> float | None:
        """The shared filesystem's own clock (a new file's mtime): the temporary files'
        mtimes come from it, and on NFS this host's clock may be hours off (a worker
        fast by more than STALE_TEMP_S removed other workers' live writes). None where
        nothing can be written: nothing could be removed either."""
        probe = self.root / f".clock.{self._run}.{threading.get_ident()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)

    def _sweep_temps(self) -> None:
        now = self._fs_now()
        if now is None:
            return
        cutoff = now - STALE_TEMP_S
        n = 0
        try:
            with os.scandir(self.root) as namespaces:
                dirs = [e.path for e in namespaces if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("fs remote: sweep of stale temporary files failed", error=repr(exc))
            dirs = []
        for d in dirs:
            if self._pool is None:  # closed
                break
            with contextlib.suppress(OSError), os.scandir(d) as it:
                for entry in it:
                    if not is_temp_file_name(entry.name):
                        continue
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        if entry.is_file(follow_symlinks=False) and st.st_mtime < cutoff:
                            os.unlink(entry.path)
                            n += 1
        self.stale_temps_removed = n
        if n:
            log.info("fs remote: removed stale temporary files", root=str(self.root), files=n)

    async def ping(self) -> None:
        await self._io(self._check_root)

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        # Packed here, not in the thread: a compressed header fails before any I/O.
        raw_header = FILE_LAYOUT.pack(dataclasses.replace(header, written_ns=time.time_ns()))
        try:
            await self._io(self._write, key, raw_header, payload)
        except OSError as exc:
            # Full: the files there still read, so the tier must not go down (three
            # puts in a row failing marked it so, and every get then missed).
            if exc.errno in _REFUSING:
                raise StoreFull(f"{_REFUSING[exc.errno]}{self.root}: {exc.strerror}") from None
            if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                # Something not a file holds the chunk's name (or a file the name of
                # its namespace directory): that chunk stays local, the store is fine
                # (three such puts in a row marked it down).
                raise ValueRefused(f"{exc.filename2 or exc.filename}: {exc.strerror}") from None
            raise

    def _write(self, key: ChunkKey, raw_header: bytes, payload: Any) -> None:
        final = self._path(key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / temp_file_name(key, self._run)
        try:
            with open(tmp, "wb") as f:
                f.write(raw_header)
                f.write(payload)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    async def get(self, key: ChunkKey) -> Fetched | None:
        data = await self._io(self._read, key)
        if data is None:
            return None
        header = FILE_LAYOUT.parse(data)
        if len(data) != FILE_LAYOUT.total_size(header):
            raise CorruptChunk(
                f"file of {len(data)} bytes, header says {FILE_LAYOUT.total_size(header)}"
            )
        return Fetched(header, memoryview(data)[FILE_LAYOUT.size :], data)

    def _read(self, key: ChunkKey) -> bytes | None:
        path = self._path(key)
        try:
            # Non-blocking: a FIFO under a chunk's name would hold a pool thread in
            # open() forever (four such gets wedged the tier down for good).
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None  # NotADirectory: a file where the namespace's directory goes
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        if not regular:
            # A directory, FIFO... under a chunk's name: one bad value, not a bad store
            # (as a failed request, three such gets marked it down).
            os.close(fd)
            raise CorruptChunk(f"{path} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            return f.read()

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self._io(lambda: [self._path(k).is_file() for k in keys])

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return await self._io(self._unlink_all, [self._path(k) for k in keys])

    @staticmethod
    def _unlink_all(paths: list[Path]) -> int:
        n = 0
        for p in paths:
            # A directory under a chunk's name is not ours to remove, nor a reason to
            # leave the rest of the batch.
            with contextlib.suppress(
                FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError
            ):
                os.unlink(p)
                n += 1
        return n

    async def clear(self, namespace_ids: Sequence[str]) -> int:
        def run() -> int:
            n = 0
            for ns in namespace_ids:
                d = self.root / ns
                if d.is_dir():
                    n += sum(1 for p in d.iterdir() if p.name.endswith(".kv"))
                    shutil.rmtree(d, ignore_errors=True)
            return n

        return await self._io(run)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
