"""Whole-file writes and reads of chunk files, with O_DIRECT where alignment allows.

O_DIRECT moves bytes between the device and the caller's buffer without the page
cache, which needs the buffer address, the length and the file offset all aligned to
the device's logical block size. kvmesh aligns to BLOCK (4096, a multiple of every
common block size): pool pages start 4 KiB aligned, the header is BLOCK long, and a
KV chunk's length is almost always a multiple of it. When any of the three is not
aligned, or the filesystem refuses O_DIRECT, the same call runs buffered.

Every call here releases the GIL while the kernel works (os.pwritev / os.preadv), so
I/O threads never stall the engine's event loop.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

from kvmesh.common.chunk_codec import FILE_LAYOUT

BLOCK = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned(ptr: int, length: int) -> bool:
    return ptr % BLOCK == 0 and length % BLOCK == 0


class _Buffers(threading.local):
    """One BLOCK-aligned header buffer per thread (an anonymous mmap is page aligned)."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, FILE_LAYOUT.size)
        self.view = memoryview(self.mm)


_buffers = _Buffers()


def header_buffer() -> memoryview:
    """This thread's aligned scratch buffer for a chunk file's header."""
    return _buffers.view


def _advance(bufs: list[memoryview], done: int) -> list[memoryview]:
    out: list[memoryview] = []
    for b in bufs:
        if done >= len(b):
            done -= len(b)
            continue
        out.append(b[done:])
        done = 0
    return out


def write_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """pwritev every byte of bufs at offset, looping over short writes."""
    total = 0
    while bufs:
        n = os.pwritev(fd, bufs, offset + total)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        total += n
        bufs = _advance(bufs, n)
    return total


def read_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """preadv into bufs at offset until they are full or the file ends; bytes read."""
    total = 0
    while bufs:
        n = os.preadv(fd, bufs, offset + total)
        if n == 0:
            break
        total += n
        bufs = _advance(bufs, n)
    return total


# Chunk files hold prompts' KV, of every tenant: readable by the engine's own user only.
FILE_MODE = 0o600
DIR_MODE = 0o700


def open_file(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """os.open with O_DIRECT when asked and supported; (fd, whether O_DIRECT is on).

    A filesystem without O_DIRECT answers EINVAL; the file is then opened buffered.
    A file it creates is FILE_MODE.
    """
    flags |= os.O_CLOEXEC
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, FILE_MODE), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, FILE_MODE), False


def write_file(path: str, bufs: list[memoryview], direct: bool) -> bool:
    """Create (or truncate) path holding bufs back to back; True if O_DIRECT was used.

    direct is a request: it is honoured only if every buffer is aligned.
    """
    direct = direct and all(aligned(_address(b), len(b)) for b in bufs)
    fd, used = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        write_all(fd, bufs)
    finally:
        os.close(fd)
    return used


def read_file(path: str, bufs: list[memoryview], direct: bool) -> int:
    """Fill bufs from the start of path; bytes read (fewer if the file is shorter)."""
    direct = direct and all(aligned(_address(b), len(b)) for b in bufs)
    fd, _ = open_file(path, os.O_RDONLY, direct)
    try:
        return read_all(fd, bufs)
    finally:
        os.close(fd)


def _address(buf: memoryview) -> int:
    if buf.readonly:
        # Read-only buffers (bytes) are never aligned on purpose: use buffered I/O.
        return 1
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
