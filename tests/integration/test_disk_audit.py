"""Disk tier audit (H15) on a real tmpfs: read-only, deleted and full, in turn and
twice over, under one running tier. Every get is a hit with the right bytes
or a miss, the tier recovers by itself each time, and no descriptor or thread is left
behind (a descriptor of a deleted lock file would also keep the filesystem from being
remounted read-only). Needs root to mount the tmpfs, like test_disk_faults.py."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtest.disk import MiB, chunk_files, expected_bytes, key_of, make_chunk, mount, tmpfs

from kvmesh.common.memory import HostMemoryPool
from kvmesh.services.worker.tiers.disk import DiskTier

SIZE = 64 * 1024
RETRY_S = 0.3


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", "4m") as where:
        yield where


def test_read_only_deleted_and_full_directory_recover_without_leaks(fs: Path) -> None:
    d = fs / "tier"
    pool = HostMemoryPool(8 * MiB, SIZE, pin_memory=False)
    tier = DiskTier(d, 2 * MiB, io_threads=2, retry_s=RETRY_S)
    n = 0
    wrong = 0

    def work(rounds: int) -> None:
        nonlocal n, wrong
        for _ in range(rounds):
            obj = make_chunk(pool, n, SIZE)
            tier.submit_put(key_of(n), obj)  # never raises
            obj.ref_down()
            n += 1
            assert tier.flush(10)
            for i in range(max(0, n - 12), n, 3):
                got = tier.get(key_of(i), pool)
                if got is not None:
                    wrong += not torch.equal(got.tensor, expected_bytes(i, SIZE))
                    got.ref_down()

    def recovered() -> None:
        deadline = time.monotonic() + 10
        while tier.degraded is not None:
            assert time.monotonic() < deadline, tier.degraded
            time.sleep(RETRY_S / 2)
            work(1)

    try:
        assert tier.wait_indexed(10)
        work(10)
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        for _ in range(2):
            mount("-o", "remount,ro", str(fs))
            work(5)
            assert tier.degraded is not None and "EROFS" in tier.degraded
            mount("-o", "remount,rw", str(fs))
            recovered()

            shutil.rmtree(d)
            work(3)
            assert tier.degraded == "directory vanished"
            recovered()

            filler = fs / "filler"
            with open(filler, "wb") as f, pytest.raises(OSError):
                f.write(b"\0" * (4 * MiB))
            work(5)
            assert tier.degraded is not None and "ENOSPC" in tier.degraded
            filler.unlink()
            recovered()
        work(5)
        assert wrong == 0
        assert tier.used_bytes == sum(os.path.getsize(d / x) for x in chunk_files(d))
        assert len(tier) == len(chunk_files(d)) > 0
        assert len(os.listdir("/proc/self/fd")) == fds
        assert threading.active_count() == threads
        assert pool.used_bytes == 0
    finally:
        tier.close()
        pool.close()
