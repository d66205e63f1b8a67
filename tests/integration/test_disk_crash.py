"""Kill -9 a process that is writing disk-tier chunks, 20 times at random moments; after
each restart every chunk served is bitwise correct and no temporary file is left.

The writer is a real process (forked from a forkserver that has imported torch once,
so each of the 20 starts costs milliseconds, not seconds). It writes 1 MiB chunks,
half through O_DIRECT and half buffered, evicts all the time (its tier holds about 23)
and removes and reads some, so a kill lands in a write, a rename, a delete, a read or
the re-index of the previous crash's leftovers.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import torch
from kvtest.disk import MiB, chunk_files, expected_bytes, index_of, size_of, temp_files
from kvtest.disk_writer import MAX_SIZE, write_forever

from kvmesh.common.memory import HostMemoryPool
from kvmesh.services.worker.tiers.disk import DiskTier

ROUNDS = 20


def test_kill_9_while_writing_never_serves_wrong_bytes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    # Python 3.11's forkserver ignores sys.path when preloading, so preload what is
    # installed (torch comes with it); the child then imports kvtest cheaply.
    ctx.set_forkserver_preload(["kvmesh.services.worker.tiers.disk"])
    path = tmp_path / "disk"
    rng = random.Random(20261122)
    pool = HostMemoryPool(8 * MiB, MiB, pin_memory=False)
    served = temps_found = 0
    try:
        for round_no in range(ROUNDS):
            ready = ctx.Event()
            writer = ctx.Process(
                target=write_forever,
                args=(str(path), round_no * 1_000_000 + 10, ready),
                daemon=True,
            )
            writer.start()
            assert ready.wait(60), "the writer did not open its tier"
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(writer.pid, signal.SIGKILL)
            writer.join(10)
            assert writer.exitcode == -signal.SIGKILL
            left = len(temp_files(path))
            temps_found += left

            tier = DiskTier(path, MAX_SIZE, io_threads=2)
            try:
                assert tier.wait_indexed(30)
                assert temp_files(path) == [], f"round {round_no}: temporary files survived"
                indexed = tier.keys()
                for key in indexed:
                    obj = tier.get(key, pool)
                    if obj is None:
                        continue
                    i = index_of(key)
                    try:
                        assert obj.nbytes == size_of(i)
                        assert torch.equal(obj.tensor, expected_bytes(i, obj.nbytes)), (
                            f"round {round_no}: chunk {i} served wrong bytes"
                        )
                    finally:
                        obj.ref_down()
                    served += 1
                # A file under a real name is always whole: the re-index deleted only the
                # temporary files, and no read failed verification.
                deleted = tier.stats.metrics.value(
                    "disk_reindex_files_total", {"result": "deleted"}
                )
                assert deleted == left
                assert tier.stats.metrics.value("disk_corrupt_total") == 0
                assert len(chunk_files(path)) == len(tier)
            finally:
                tier.close()
    finally:
        pool.close()
    print(f"{served} chunks served over {ROUNDS} restarts; kills left {temps_found} temp files")
    assert served >= ROUNDS * 5, f"only {served} chunks served: the test checked too little"
    assert temps_found > 0, "no kill landed in a write: the crash moments are too easy"
