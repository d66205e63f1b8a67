"""Token hashing throughput against raw xxh3-128 over the same bytes.

    python -m benchmarks.hashing [--json]

For prompts of 8k, 32k and 128k tokens, given as int64 and int32 tensors and as a list,
measures ChunkedTokenDatabase's key path (`list(process_tokens(...))`) and hash-only
path (`chunk_hashes(...)`), and in the same run the raw xxh3-128 figures over the same
bytes: one digest per 256-token chunk of a pre-made bytes object (the floor any chunked
scheme pays) and one digest of the whole buffer (memory speed, for scale).

Goals: >= 0.5 of the raw per-chunk rate (reported for both paths and every input; a
list pays a per-token conversion the raw figure does not), and keying a 128k-token
prompt in < 5 ms, whatever the input. Exit status 1 if any goal is missed.
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

import torch  # noqa: E402
import xxhash  # noqa: E402

from kvmesh.common.keys import KeyNamespace  # noqa: E402
from kvmesh.common.tokendb import ChunkedTokenDatabase, tokens_to_bytes  # noqa: E402

SIZES = (8 * 1024, 32 * 1024, 128 * 1024)
CHUNK = 256
RATIO_GOAL = 0.5
LATENCY_GOAL_MS = 5.0
# Every measurement runs in ROUNDS rounds, interleaved with the others so that a burst
# of load from another process hits one round, not one measurement; each round times
# for about ROUND_NS (and at least MIN_REPS calls) after WARMUP untimed calls. The
# figure kept is the lowest of the rounds' medians.
ROUNDS = 7  # the VM flips between a fast and a slow state every few seconds
ROUND_NS = 50_000_000
MIN_REPS = 10
WARMUP = 3


def round_median_ns(fn: Callable[[], object]) -> float:
    for _ in range(WARMUP):
        fn()
    samples: list[int] = []
    deadline = time.perf_counter_ns() + ROUND_NS
    while len(samples) < MIN_REPS or time.perf_counter_ns() < deadline:
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples)


def make_inputs(n: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(n)
    # Ids spread over a large vocabulary, some above 2**16, like real tokenizers.
    t64 = torch.randint(0, 152_064, (n,), generator=gen, dtype=torch.int64)
    return {"tensor-i64": t64, "tensor-i32": t64.to(torch.int32), "list": t64.tolist()}


def measure() -> list[dict[str, Any]]:
    ns = KeyNamespace(model="bench", kv_layout="LBHNC", dtype="float16", world_size=1, rank=0)
    db = ChunkedTokenDatabase(ns, chunk_size=CHUNK)
    digest = xxhash.xxh3_128_digest
    step = CHUNK * 4
    tasks: dict[tuple[int, str], Callable[[], object]] = {}
    for n in SIZES:
        inputs = make_inputs(n)
        raw = tokens_to_bytes(inputs["tensor-i64"])
        view = memoryview(raw)
        tasks[n, "raw_chunk"] = lambda v=view: [
            digest(v[o : o + step]) for o in range(0, len(v), step)
        ]
        tasks[n, "raw_whole"] = lambda raw=raw: digest(raw)
        for name, tokens in inputs.items():
            tasks[n, f"{name}/keys"] = lambda t=tokens: list(db.process_tokens(t))
            tasks[n, f"{name}/hashes"] = lambda t=tokens: db.chunk_hashes(t)
    best = dict.fromkeys(tasks, float("inf"))
    for _ in range(ROUNDS):
        for task, fn in tasks.items():
            best[task] = min(best[task], round_median_ns(fn))

    rows = []
    for n in SIZES:
        raw_chunk_ns, raw_whole_ns = best[n, "raw_chunk"], best[n, "raw_whole"]
        for name in ("tensor-i64", "tensor-i32", "list"):
            keys_ns, hashes_ns = best[n, f"{name}/keys"], best[n, f"{name}/hashes"]
            rows.append(
                {
                    "tokens": n,
                    "input": name,
                    "keys_us": keys_ns / 1e3,
                    "hashes_us": hashes_ns / 1e3,
                    "raw_chunk_us": raw_chunk_ns / 1e3,
                    "raw_whole_us": raw_whole_ns / 1e3,
                    "keys_mtok_s": n / keys_ns * 1e3,
                    "hashes_mtok_s": n / hashes_ns * 1e3,
                    "raw_chunk_mtok_s": n / raw_chunk_ns * 1e3,
                    "raw_whole_mtok_s": n / raw_whole_ns * 1e3,
                    "keys_ratio": raw_chunk_ns / keys_ns,
                    "hashes_ratio": raw_chunk_ns / hashes_ns,
                }
            )
    return rows


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for path in ("hashes", "keys"):
        for name in ("tensor-i64", "tensor-i32", "list"):
            ratios = [r[f"{path}_ratio"] for r in rows if r["input"] == name]
            out.append(
                {
                    "goal": f"{path}/raw-chunk >= {RATIO_GOAL} at "
                    + "/".join(f"{n // 1024}k" for n in SIZES)
                    + f" ({name})",
                    "value": "/".join(f"{x:.2f}" for x in ratios),
                    "pass": min(ratios) >= RATIO_GOAL,
                }
            )
    for r in rows:
        if r["tokens"] == max(SIZES):
            ms = r["keys_us"] / 1e3
            out.append(
                {
                    "goal": f"keys for {r['tokens'] // 1024}k tokens < {LATENCY_GOAL_MS} ms "
                    f"({r['input']})",
                    "value": f"{ms:.3f} ms",
                    "pass": ms < LATENCY_GOAL_MS,
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
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "xxhash": xxhash.VERSION,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu,
    }


def print_table(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    env = environment()
    print(
        f"# python {env['python']}, torch {env['torch']} ({env['torch_threads']} threads), "
        f"xxhash {env['xxhash']}, {env['cpu']}"
    )
    print(
        f"{'tokens':>7} {'input':<11}"
        f" {'keys µs':>8} {'Mtok/s':>7} {'hashes µs':>9} {'Mtok/s':>7}"
        f" {'raw/chunk':>9} {'raw/whole':>9}  {'keys/raw':>8} {'hash/raw':>8}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['input']:<11}"
            f" {r['keys_us']:>8.1f} {r['keys_mtok_s']:>7.0f}"
            f" {r['hashes_us']:>9.1f} {r['hashes_mtok_s']:>7.0f}"
            f" {r['raw_chunk_mtok_s']:>9.0f} {r['raw_whole_mtok_s']:>9.0f}"
            f"  {r['keys_ratio']:>8.2f} {r['hashes_ratio']:>8.2f}"
        )
    print("(raw columns in Mtok/s: xxh3-128 per 256-token chunk, and over the whole buffer)")
    for g in results:
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hashing", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    rows = measure()
    results = goals(rows)
    if args.json:
        print(json.dumps({"env": environment(), "rows": rows, "goals": results}, indent=2))
    else:
        print_table(rows, results)
    return 0 if all(g["pass"] for g in results) else 1


if __name__ == "__main__":
    sys.exit(main())
