"""Disk tier (L3) throughput against raw file I/O of the same bytes, and restart time.

    python -m benchmarks.disk [--json] [--dir DIR] [--total-mib N] [--drop-caches]

For chunks of 2 MiB and 32 MiB, O_DIRECT on and off, measures in GB/s:

- tier write: `DiskTier.submit_put` of every chunk, until `flush()` says all are on
  disk (checksum, header, temporary file, rename included);
- tier read: `DiskTier.aget` of every chunk from one asyncio loop (allocation from a
  host pool, header and checksum verification included);
- raw write / raw read: `os.pwrite` / `os.preadv` of the same payload bytes, one file
  per chunk in the same directory, from a pool of as many threads as the tier has
  (`IO_THREADS`), with the same open flags (O_DIRECT or not);
- with O_DIRECT off, also `write+sync`: the same writes until a following `sync`
  returns, i.e. until the bytes are on the disk rather than in the page cache (for
  context; not a goal).

After one untimed warm-up round, tier and raw runs alternate, RUNS times (which goes
first alternates too); the table shows the median rates and the median of the per-run
tier/raw ratios. Before every run the
previous files are deleted and `sync` is called; before every read the files' pages
are dropped from the page cache (`posix_fadvise(DONTNEED)`), so buffered reads come
from the device as O_DIRECT ones do.

Then the time a new tier takes to re-index REINDEX_FILES chunk files (small payloads:
the re-index reads headers only) until `wait_indexed()`, with the files' pages
dropped first (cold) and again right after (warm). `--drop-caches` also drops the
kernel's dentry and inode caches (`/proc/sys/vm/drop_caches`, root; it slows the whole
machine for a moment) for a restart as cold as after a reboot.

Goals: tier / raw >= 0.8 on every row, and a 10,000-file re-index (cold) < 2 s.
Exit status 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

# torch warns on import when numpy is absent; kvmesh does not need numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from kvmesh.common.chunk_codec import (  # noqa: E402
    FILE_LAYOUT,
    ChunkHeader,
    chunk_bytes,
    payload_checksum,
)
from kvmesh.common.keys import KeyNamespace  # noqa: E402
from kvmesh.common.memory import HostMemoryPool, MemoryFormat  # noqa: E402
from kvmesh.common.observability import configure_logging  # noqa: E402
from kvmesh.services.worker.tiers.disk import DiskTier  # noqa: E402
from kvmesh.services.worker.tiers.disk_format import chunk_file_name  # noqa: E402
from kvmesh.services.worker.tiers.disk_io import open_file, read_all, write_all  # noqa: E402

MiB = 1 << 20
CHUNKS = {"2MiB": 2 * MiB, "32MiB": 32 * MiB}
IO_THREADS = 4
RUNS = 9
RATIO_GOAL = 0.8
REINDEX_FILES = 10_000
REINDEX_PAYLOAD = 16 * 1024
REINDEX_GOAL_S = 2.0
SYNCED = "write+sync"
NS = KeyNamespace(model="bench", kv_layout="bytes", dtype="uint8", world_size=1, rank=0)


def key(i: int):
    return NS.key(i.to_bytes(16, "little"))


def drop_pages(path: str) -> None:
    """Write back and drop the page cache of every file in path."""
    os.sync()
    for name in os.listdir(path):
        try:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def clean(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    os.sync()


class Case:
    """One chunk size and O_DIRECT setting: its source chunks and both measurements."""

    def __init__(self, root: str, nbytes: int, direct: bool, total: int) -> None:
        self.root = root
        self.nbytes = nbytes
        self.direct = direct
        self.count = max(total // nbytes, IO_THREADS)
        self.bytes = self.count * nbytes
        self.src = HostMemoryPool(self.bytes, nbytes, pin_memory=False)
        self.dst = HostMemoryPool(self.bytes, nbytes, pin_memory=False)
        gen = torch.Generator().manual_seed(nbytes)
        self.objs = []
        for _ in range(self.count):
            obj = self.src.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
            assert obj is not None
            obj.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
            self.objs.append(obj)
        self.pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS)

    def close(self) -> None:
        self.pool.shutdown()
        self.src.close()
        self.dst.close()

    # -- the tier -------------------------------------------------------------------------
    def tier_write(self) -> tuple[float, float, DiskTier]:
        path = os.path.join(self.root, "tier")
        clean(path)
        tier = DiskTier(path, 2 * self.bytes + MiB, io_threads=IO_THREADS, o_direct=self.direct)
        tier.wait_indexed(10)
        # A put keeps the checksum it computed on the chunk (so another tier need not
        # hash it again); without this reset every run after the first would skip it.
        for obj in self.objs:
            obj.checksum = None
        t0 = time.perf_counter()
        for i, obj in enumerate(self.objs):
            tier.submit_put(key(i), obj)
        tier.flush()
        elapsed = time.perf_counter() - t0
        os.sync()
        synced = time.perf_counter() - t0
        assert len(tier) == self.count, f"only {len(tier)} of {self.count} chunks written"
        return self.bytes / elapsed / 1e9, self.bytes / synced / 1e9, tier

    def tier_read(self, tier: DiskTier) -> float:
        drop_pages(tier.path)

        async def read_all_chunks() -> list:
            return await asyncio.gather(*(tier.aget(key(i), self.dst) for i in range(self.count)))

        t0 = time.perf_counter()
        objs = asyncio.run(read_all_chunks())
        elapsed = time.perf_counter() - t0
        assert all(o is not None for o in objs), "a chunk was missed"
        assert torch.equal(objs[-1].tensor, self.objs[-1].tensor)
        for o in objs:
            o.ref_down()
        tier.close()
        return self.bytes / elapsed / 1e9

    # -- raw I/O --------------------------------------------------------------------------
    def raw_write(self) -> tuple[float, float]:
        path = os.path.join(self.root, "raw")
        clean(path)

        def write(i: int) -> None:
            fd, _ = open_file(
                os.path.join(path, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.direct
            )
            try:
                write_all(fd, [chunk_bytes(self.objs[i])])
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        list(self.pool.map(write, range(self.count)))
        elapsed = time.perf_counter() - t0
        os.sync()
        synced = time.perf_counter() - t0
        return self.bytes / elapsed / 1e9, self.bytes / synced / 1e9

    def raw_read(self) -> float:
        path = os.path.join(self.root, "raw")
        drop_pages(path)
        bufs = [
            self.dst.allocate((self.nbytes,), torch.uint8, MemoryFormat.BINARY)
            for _ in range(self.count)
        ]

        def read(i: int) -> None:
            fd, _ = open_file(os.path.join(path, f"{i}.bin"), os.O_RDONLY, self.direct)
            try:
                assert read_all(fd, [chunk_bytes(bufs[i])]) == self.nbytes
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        list(self.pool.map(read, range(self.count)))
        elapsed = time.perf_counter() - t0
        for b in bufs:
            b.ref_down()
        return self.bytes / elapsed / 1e9


def measure_io(root: str, total: int) -> list[dict[str, Any]]:
    rows = []
    for name, nbytes in CHUNKS.items():
        for direct in (True, False):
            case = Case(root, nbytes, direct, total)
            samples: dict[str, list[float]] = {
                k: [] for k in ("tw", "tws", "tr", "rw", "rws", "rr")
            }
            try:
                case.tier_read(case.tier_write()[2])  # warm-up: the first round is an outlier
                case.raw_write()
                case.raw_read()
                for run in range(RUNS):
                    # Alternate which goes first, so neither always inherits the other's
                    # writeback or cache state.
                    for side in ("tier", "raw") if run % 2 == 0 else ("raw", "tier"):
                        if side == "tier":
                            w, ws, tier = case.tier_write()
                            samples["tw"].append(w)
                            samples["tws"].append(ws)
                            samples["tr"].append(case.tier_read(tier))
                        else:
                            w, ws = case.raw_write()
                            samples["rw"].append(w)
                            samples["rws"].append(ws)
                            samples["rr"].append(case.raw_read())
            finally:
                case.close()
            med = {k: statistics.median(v) for k, v in samples.items()}
            ops = [("write", "tw", "rw"), ("read", "tr", "rr")]
            if not direct:  # buffered writes land in the page cache; this adds the disk
                ops.insert(1, (SYNCED, "tws", "rws"))
            for op, tier_k, raw_k in ops:
                rows.append(
                    {
                        "chunk": name,
                        "o_direct": direct,
                        "op": op,
                        "chunks": case.count,
                        "tier_gbps": med[tier_k],
                        "raw_gbps": med[raw_k],
                        # Each run's tier and raw ran back to back: the median of the
                        # per-run ratios cancels the disk's slow swings between runs.
                        "ratio": statistics.median(
                            t / r for t, r in zip(samples[tier_k], samples[raw_k], strict=True)
                        ),
                        "tier_runs": samples[tier_k],
                        "raw_runs": samples[raw_k],
                    }
                )
    return rows


def make_files(path: str, n: int) -> None:
    clean(path)
    payload = os.urandom(REINDEX_PAYLOAD)
    checksum = payload_checksum(payload)
    now = time.time_ns()
    for i in range(n):
        k = key(i)
        header = ChunkHeader(
            k,
            (REINDEX_PAYLOAD,),
            torch.uint8,
            MemoryFormat.BINARY,
            len(payload),
            checksum,
            written_ns=now,
        )
        with open(os.path.join(path, chunk_file_name(k)), "wb") as f:
            f.write(FILE_LAYOUT.pack(header) + payload)


def drop_kernel_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def time_reindex(path: str, n: int) -> float:
    t0 = time.perf_counter()
    tier = DiskTier(path, 1 << 40, io_threads=IO_THREADS)
    assert tier.wait_indexed(120)
    elapsed = time.perf_counter() - t0
    assert len(tier) == n, f"re-indexed {len(tier)} of {n}"
    tier.close()
    return elapsed


def measure_reindex(root: str, drop_caches: bool) -> dict[str, Any]:
    path = os.path.join(root, "reindex")
    make_files(path, REINDEX_FILES)
    drop_pages(path)
    if drop_caches:
        drop_kernel_caches()
    cold = time_reindex(path, REINDEX_FILES)
    warm = time_reindex(path, REINDEX_FILES)
    shutil.rmtree(path, ignore_errors=True)
    return {
        "files": REINDEX_FILES,
        "cold_s": cold,
        "warm_s": warm,
        "kernel_caches_dropped": drop_caches,
    }


def goals(rows: list[dict[str, Any]], reindex: dict[str, Any]) -> list[dict[str, Any]]:
    out = [
        {
            "goal": f"tier/raw >= {RATIO_GOAL} ({r['chunk']} {r['op']}, "
            f"O_DIRECT {'on' if r['o_direct'] else 'off'})",
            "value": round(r["ratio"], 2),
            "pass": r["ratio"] >= RATIO_GOAL,
        }
        for r in rows
        if r["op"] != SYNCED  # shown for context, not a goal
    ]
    out.append(
        {
            "goal": f"re-index of {reindex['files']:,} files < {REINDEX_GOAL_S} s (cold)",
            "value": f"{reindex['cold_s']:.2f} s",
            "pass": reindex["cold_s"] < REINDEX_GOAL_S,
        }
    )
    return out


def environment(root: str) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    fs = ""
    with contextlib.suppress(OSError, subprocess.CalledProcessError, IndexError):
        df = ["df", "--output=fstype,source", root]
        fs = subprocess.run(df, capture_output=True, text=True, check=True).stdout
        fs = fs.split("\n")[1].strip()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "dir": root,
        "filesystem": fs,
    }


def print_table(env: dict[str, Any], total: int, rows: list, reindex: dict, results: list) -> None:
    print(f"# python {env['python']}, torch {env['torch']}, {env['cpu']} ({env['cores']} cores)")
    print(
        f"# {env['dir']} on {env['filesystem'] or '?'}; {IO_THREADS} I/O threads; "
        f"{total // MiB} MiB per run; median of {RUNS} runs; page cache dropped before reads"
    )
    print(
        f"{'chunk':<6} {'O_DIRECT':<8} {'op':<10} {'chunks':>6} "
        f"{'tier GB/s':>9} {'raw GB/s':>8} {'tier/raw':>8}"
    )
    for r in rows:
        print(
            f"{r['chunk']:<6} {'on' if r['o_direct'] else 'off':<8} {r['op']:<10} "
            f"{r['chunks']:>6} {r['tier_gbps']:>9.2f} {r['raw_gbps']:>8.2f} {r['ratio']:>8.2f}"
        )
    print(
        f"re-index {reindex['files']:,} files: cold {reindex['cold_s']:.2f} s, "
        f"warm {reindex['warm_s']:.2f} s"
        + ("" if reindex["kernel_caches_dropped"] else " (page cache dropped, dentries kept)")
    )
    for g in results:
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--dir", default="/var/tmp", help="where to make the scratch directory (default /var/tmp)"
    )
    parser.add_argument("--total-mib", type=int, default=512, help="MiB written per run")
    parser.add_argument(
        "--drop-caches", action="store_true", help="drop dentry/inode caches before the re-index"
    )
    args = parser.parse_args(argv)
    configure_logging("warning")
    root = tempfile.mkdtemp(prefix="kvmesh-bench-disk-", dir=args.dir)
    total = args.total_mib * MiB
    try:
        env = environment(root)
        rows = measure_io(root, total)
        reindex = measure_reindex(root, args.drop_caches)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = goals(rows, reindex)
    if args.json:
        out = {"env": env, "rows": rows, "reindex": reindex, "goals": results}
        print(json.dumps(out, indent=2))
    else:
        print_table(env, total, rows, reindex, results)
    return 0 if all(g["pass"] for g in results) else 1


if __name__ == "__main__":
    sys.exit(main())
