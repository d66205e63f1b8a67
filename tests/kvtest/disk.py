"""Helpers for the disk tier tests: chunks whose bytes follow from their key, so a
checker (in this process or another) knows what every served chunk must hold."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.common.keys import ChunkKey, KeyNamespace
from kvmesh.common.memory import HostMemoryPool, MemoryFormat, MemoryObj

NS = KeyNamespace(model="disk-test", kv_layout="bytes", dtype="uint8", world_size=1, rank=0)
MiB = 1 << 20


def key_of(i: int) -> ChunkKey:
    return NS.key(struct.pack("<QQ", i, 0x6B766D657368))


def index_of(key: ChunkKey) -> int:
    return struct.unpack("<QQ", key.chunk_hash)[0]


_BASES: dict[tuple[int, int], torch.Tensor] = {}


def expected_bytes(i: int, nbytes: int) -> torch.Tensor:
    """The content chunk i must have: random bytes (one of 4 cached patterns, so making
    a chunk costs a copy) with i stamped in the first 8 bytes of every 4 KiB block, so
    no two chunks hold the same bytes and a torn or mixed-up block shows."""
    base = _BASES.get((i % 4, nbytes))
    if base is None:
        gen = torch.Generator().manual_seed(i % 4)
        base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        _BASES[(i % 4, nbytes)] = base
    out = base.clone()
    stamp = torch.frombuffer(bytearray(struct.pack("<Q", i)), dtype=torch.uint8)
    full = nbytes // 4096
    out[: full * 4096].view(full, 4096)[:, :8] = stamp
    if nbytes - full * 4096 >= 8:
        out[full * 4096 : full * 4096 + 8] = stamp
    return out


def size_of(i: int, aligned: int = MiB, unaligned: int = MiB - 100) -> int:
    """Even chunks are 4 KiB multiples (O_DIRECT path), odd ones are not (buffered)."""
    return aligned if i % 2 == 0 else unaligned


def make_chunk(pool: HostMemoryPool, i: int, nbytes: int, wait_s: float = 5.0) -> MemoryObj:
    obj = pool.allocate_wait((nbytes,), torch.uint8, MemoryFormat.BINARY, wait_s)
    obj.tensor.copy_(expected_bytes(i, nbytes))
    return obj


def temp_files(path: str | os.PathLike[str]) -> list[str]:
    return [n for n in os.listdir(path) if n.endswith(".tmp")]


def chunk_files(path: str | os.PathLike[str]) -> list[str]:
    return [n for n in os.listdir(path) if n.endswith(".kv")]


def mount(*args: str) -> None:
    """`mount ARGS`, failing the test (never skipping it) where that is refused."""
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(
            f"mount {' '.join(args)} failed ({done.stderr.strip()}): these tests need root "
            "to mount a size-limited tmpfs"
        )


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's notation: "1m") at where, unmounted afterwards."""
    where.mkdir()
    mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
