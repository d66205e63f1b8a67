"""Host pool allocation rate, and whether it depends on the pool size.

    python -m benchmarks.allocator [--json]

For a 1 GiB and an 8 GiB HostMemoryPool (256 KiB pages, unpinned), each kept half
full by live objects during the runs, measures allocate+free pairs per second:
single (`allocate` then `ref_down`, the engine's path) and batched (`allocate_batch`
of 32 then `release_batch`, counted per object). Each figure is the median of RUNS
timed runs after a warm-up, with the two pools' runs interleaved so that machine
noise hits both alike. Allocation never touches a page, so the 8 GiB pool costs a
few MiB of RSS; the pool is capped by available memory, which the table shows.

Goals: >= 500k single pairs/s on every pool size, and the cost does not grow with
the pool: 8 GiB rate / 1 GiB rate >= 0.8 (1.0 ideally; the slack is timing noise).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

# torch warns on import when numpy is absent; kvmesh does not need numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import psutil  # noqa: E402
import torch  # noqa: E402

from kvmesh.common.memory import HostMemoryPool, MemoryFormat  # noqa: E402

GiB = 1024**3
PAGE = 256 * 1024
POOLS = {"1GiB": 1 * GiB, "8GiB": 8 * GiB}
# A 256-token chunk of 2 layers × 128 hidden in fp16: exactly one 256 KiB page.
SHAPE = torch.Size([2, 2, 256, 128])
DTYPE = torch.float16
FMT = MemoryFormat.KV_2LTD
BATCH = 32
PAIRS = 200_000  # per timed run
RUNS = 7
PAIRS_GOAL = 500_000
RATIO_GOAL = 0.8


def single(pool: HostMemoryPool) -> Callable[[], float]:
    allocate = pool.allocate

    def run() -> float:
        start = time.perf_counter_ns()
        for _ in range(PAIRS):
            allocate(SHAPE, DTYPE, FMT).ref_down()  # type: ignore[union-attr]
        return PAIRS / (time.perf_counter_ns() - start) * 1e9

    return run


def batched(pool: HostMemoryPool) -> Callable[[], float]:
    allocate_batch, release_batch = pool.allocate_batch, pool.release_batch
    rounds = PAIRS // BATCH

    def run() -> float:
        start = time.perf_counter_ns()
        for _ in range(rounds):
            release_batch(allocate_batch(BATCH, SHAPE, DTYPE, FMT))  # type: ignore[arg-type]
        return rounds * BATCH / (time.perf_counter_ns() - start) * 1e9

    return run


def measure() -> dict[str, Any]:
    proc = psutil.Process()
    pools: dict[str, HostMemoryPool] = {}
    info: dict[str, dict[str, Any]] = {}
    for name, size in POOLS.items():
        rss = proc.memory_info().rss
        start = time.perf_counter()
        # Unpinned on purpose: pinning would map and lock all 8 GiB.
        pool = HostMemoryPool(size, PAGE, pin_memory=False)
        build_ms = (time.perf_counter() - start) * 1e3
        pools[name] = pool
        info[name] = {
            "capacity_bytes": pool.capacity_bytes,
            "pages": pool.num_pages,
            "build_ms": build_ms,
            "rss_growth_mib": (proc.memory_info().rss - rss) / 2**20,
        }
    held = {n: p.allocate_batch(p.num_pages // 2, SHAPE, DTYPE, FMT) for n, p in pools.items()}
    samples: dict[tuple[str, str], list[float]] = {}
    runners = {
        (n, m): fn(p)
        for n, p in pools.items()
        for m, fn in (("single", single), ("batched", batched))
    }
    for runner in runners.values():  # warm-up
        runner()
    for _ in range(RUNS):
        for key, runner in runners.items():
            samples.setdefault(key, []).append(runner())
    for name, pool in pools.items():
        pool.release_batch(held[name] or [])
        assert pool.free_pages == pool.num_pages
        pool.close()
    rows = []
    for (name, mode), rates in samples.items():
        rows.append(
            {
                "pool": name,
                "mode": mode,
                "pairs_per_s": statistics.median(rates),
                "ns_per_pair": 1e9 / statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
                **info[name],
            }
        )
    return {"rows": rows}


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rate = {(r["pool"], r["mode"]): r["pairs_per_s"] for r in rows}
    out = []
    for name in POOLS:
        value = rate[(name, "single")]
        out.append(
            {
                "goal": f"single allocate+free >= {PAIRS_GOAL:,} pairs/s ({name})",
                "value": round(value),
                "pass": value >= PAIRS_GOAL,
            }
        )
    for mode in ("single", "batched"):
        ratio = rate[("8GiB", mode)] / rate[("1GiB", mode)]
        out.append(
            {
                "goal": f"8GiB/1GiB rate >= {RATIO_GOAL} ({mode}): cost not growing with size",
                "value": round(ratio, 3),
                "pass": ratio >= RATIO_GOAL,
            }
        )
    return out


def environment() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu}


def print_table(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    env = environment()
    print(f"# python {env['python']}, torch {env['torch']}, {env['cpu']}")
    print(
        f"# page {PAGE // 1024} KiB, object {tuple(SHAPE)} {DTYPE}, pools half full, "
        f"median of {RUNS} runs of {PAIRS:,} pairs"
    )
    print(
        f"{'pool':<5} {'capacity':>9} {'pages':>6} {'build ms':>8} {'RSS MiB':>7}  "
        f"{'mode':<7} {'pairs/s':>10} {'ns/pair':>7} {'min':>10} {'max':>10}"
    )
    for r in rows:
        print(
            f"{r['pool']:<5} {r['capacity_bytes'] / GiB:>7.2f}Gi {r['pages']:>6} "
            f"{r['build_ms']:>8.1f} {r['rss_growth_mib']:>7.1f}  {r['mode']:<7} "
            f"{r['pairs_per_s']:>10,.0f} {r['ns_per_pair']:>7.0f} {r['min']:>10,.0f} "
            f"{r['max']:>10,.0f}"
        )
    for r in rows:
        if r["capacity_bytes"] < POOLS[r["pool"]] and r["mode"] == "single":
            print(f"note: the {r['pool']} pool was capped by available memory")
    for g in results:
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allocator", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    rows = measure()["rows"]
    results = goals(rows)
    if args.json:
        print(json.dumps({"env": environment(), "rows": rows, "goals": results}, indent=2))
    else:
        print_table(rows, results)
    return 0 if all(g["pass"] for g in results) else 1


if __name__ == "__main__":
    sys.exit(main())
