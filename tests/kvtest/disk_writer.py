"""A process that writes (and evicts, removes, reads) disk-tier chunks until it is killed.

`write_forever(path, first, ready)` opens a DiskTier on path, sets ready, then stores
chunk after chunk (chunk i holds `kvtest.disk.expected_bytes(i, size_of(i))`), removes
one now and then, and reads some back, forever. The crash test kills it with SIGKILL at
a random moment, then checks what a restarted tier serves.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvmesh.common.memory import HostMemoryPool
from kvmesh.services.worker.tiers.disk import DiskTier

from .disk import MiB, key_of, make_chunk, size_of

MAX_SIZE = 24 * MiB  # about 23 chunks: the writer evicts all the time


def write_forever(path: str, first: int, ready: Any) -> None:
    pool = HostMemoryPool(32 * MiB, MiB, pin_memory=False)
    tier = DiskTier(path, MAX_SIZE, io_threads=2, max_pending_puts=8)
    ready.set()
    for i in itertools.count(max(first, 3)):
        obj = make_chunk(pool, i, size_of(i))
        tier.submit_put(key_of(i), obj)
        obj.ref_down()
        if i % 7 == 0:
            tier.remove(key_of(i - 3))
        if i % 5 == 0:
            got = tier.get(key_of(i - 2), pool)
            if got is not None:
                got.ref_down()
