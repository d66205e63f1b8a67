"""Worker engine: store/retrieve throughput against copy_, and per-request overhead.

    python -m benchmarks.engine [--json]

Throughput, on CPU tensors: a Llama-3-8B-like paged KV cache (32 layers, 8 KV heads,
head_dim 128, fp16: 128 KiB per token) in vLLM's CPU layout (a list of 32 per-layer
``[blocks, kv_heads, block_size, 2*head_dim]`` tensors), with block sizes 16 and 128.
`KVEngine.store` copies TOKENS tokens (256-token chunks) out of blocks taken in random
order into L1 (cleared, untimed, before each store); `KVEngine.retrieve` loads them
back into other blocks, also in random order. The same run times the copier alone
(`gather`/`scatter` of the same chunks into/from preallocated buffers) and the
baseline: `copy_` of the same bytes between two preallocated contiguous tensors, one
256-token chunk's bytes per call. Goals: engine store >= 0.7 and engine retrieve >= 0.8
of the baseline's GB/s, at every block size.

Overhead: a tiny KV (2 layers, 1 KV head, head_dim 32, block size 16) and a
2048-token request (8 chunks, an int64 tensor of ids), so that copying costs next to
nothing and the figure is the engine's own per-call cost. Median µs per call of
`lookup` (all hits, no pin), `store` (L1 cleared, untimed, before each call) and
`retrieve` (all hits), `store, L1 full` (an L1 holding exactly one request, two
prompts taking turns: every store evicts the other's chunks, the steady state of a
serving engine; same goal as store), and for scale the copier's `gather`/`scatter` of one 256-token
chunk. Inside store and retrieve it splits the
time between the copier's calls (each timed with perf_counter, in separate runs of the
same calls: the copier's median total per request) and the rest (the engine's
bookkeeping: the call's median less that). Goals: lookup < 40 µs, store < 150 µs,
retrieve < 250 µs. `--only overhead` runs this part alone.

Every measurement runs in ROUNDS rounds, interleaved with the others so that a burst
of load from another process hits one round, not one measurement; the figure kept is
the lowest of the rounds' medians. Peak memory is about 5 GiB (cache 2 GiB, L1 1 GiB,
baseline 2 GiB). Exit status 1 if any goal is missed.
"""

from __future__ import annotations

import argparse
import gc
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

from kvmesh.common.config import EngineConfig, L1Config  # noqa: E402
from kvmesh.common.observability import configure_logging  # noqa: E402
from kvmesh.services.worker.engine import KVEngine  # noqa: E402

GiB = 1024**3
DTYPE = torch.float16
CHUNK = 256
# Throughput: Llama-3-8B-like KV.
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS = 8192  # 1 GiB of KV per store or retrieve
BLOCK_SIZES = (16, 128)
# Overhead: a KV so small that the copies cost next to nothing.
TINY_LAYERS, TINY_HEADS, TINY_DIM, TINY_BLOCK = 2, 1, 32, 16
TINY_TOKENS = 2048
ROUNDS = 5
REPS = 3  # timed calls per round, throughput
TINY_REPS = 200  # timed calls per round, overhead
STORE_GOAL, RETRIEVE_GOAL = 0.7, 0.8
LOOKUP_GOAL_US, STORE_GOAL_US, RETRIEVE_GOAL_US = 40.0, 150.0, 250.0


def random_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill with random 16-bit patterns (NaNs and -0.0 included): copies must keep bits."""
    t.view(torch.int16).random_(-(2**15), 2**15, generator=gen)


def paged_cache(
    layers: int, blocks: int, heads: int, block_size: int, head_dim: int
) -> list[torch.Tensor]:
    """vLLM's CPU layout: one contiguous [blocks, heads, block_size, 2*head_dim] per layer."""
    return [
        torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=DTYPE) for _ in range(layers)
    ]


def block_slots(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slot mapping of tokens laid out over `blocks` in order: block*size + offset."""
    return (blocks.view(-1, 1) * block_size + torch.arange(block_size)).view(-1)


def engine_for(caches: list[torch.Tensor], l1_bytes: int) -> KVEngine:
    config = EngineConfig(
        chunk_size=CHUNK, model_name="bench", l1=L1Config(max_size=l1_bytes, reserve=0)
    )
    return KVEngine("bench", 0, config, caches)


def round_median(fn: Callable[[], float], reps: int) -> float:
    """Median of `reps` timings (each call returns its own seconds), after one warm-up."""
    fn()
    return statistics.median(fn() for _ in range(reps))


def measure_throughput(block_size: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(block_size)
    per_request = TOKENS // block_size
    caches = paged_cache(LAYERS, 2 * per_request, KV_HEADS, block_size, HEAD_DIM)
    for c in caches:  # the store source: the first half of the blocks
        random_bits(c[:per_request], gen)
    src_slots = block_slots(torch.randperm(per_request, generator=gen), block_size)
    dst_slots = block_slots(torch.randperm(per_request, generator=gen) + per_request, block_size)
    tokens = torch.randint(0, 128_000, (TOKENS,), generator=gen)
    bytes_per_chunk = CHUNK * LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    nbytes = TOKENS // CHUNK * bytes_per_chunk
    engine = engine_for(caches, nbytes + bytes_per_chunk)
    lay = engine.layout
    assert lay.chunk_nbytes(CHUNK) == bytes_per_chunk
    # Baseline buffers; `dst` doubles as the copier's chunk buffers.
    src = torch.empty(nbytes // DTYPE.itemsize, dtype=DTYPE)
    random_bits(src, gen)
    dst = torch.zeros_like(src)
    per_chunk = bytes_per_chunk // DTYPE.itemsize
    src_pieces, dst_pieces = src.view(-1, per_chunk), dst.view(-1, per_chunk)
    chunks = [p.view(lay.chunk_shape(CHUNK)) for p in dst_pieces]
    spans = [(i * CHUNK, (i + 1) * CHUNK) for i in range(TOKENS // CHUNK)]

    def baseline() -> float:
        t0 = time.perf_counter()
        for d, s in zip(dst_pieces, src_pieces, strict=True):
            d.copy_(s)
        return time.perf_counter() - t0

    def store() -> float:
        engine.clear()
        t0 = time.perf_counter()
        stored = engine.store(tokens, src_slots)
        elapsed = time.perf_counter() - t0
        assert stored == TOKENS, stored
        return elapsed

    def retrieve() -> float:
        t0 = time.perf_counter()
        loaded = engine.retrieve(tokens, dst_slots)
        elapsed = time.perf_counter() - t0
        assert bool(loaded.all())
        return elapsed

    def gather() -> float:
        t0 = time.perf_counter()
        for (a, b), chunk in zip(spans, chunks, strict=True):
            engine.copier.gather(src_slots[a:b], chunk)
        return time.perf_counter() - t0

    def scatter() -> float:
        t0 = time.perf_counter()
        for (a, b), chunk in zip(spans, chunks, strict=True):
            engine.copier.scatter(dst_slots[a:b], chunk)
        return time.perf_counter() - t0

    tasks = {
        "baseline": baseline,
        "store": store,
        "retrieve": retrieve,
        "gather": gather,
        "scatter": scatter,
    }
    try:
        best = dict.fromkeys(tasks, float("inf"))
        for _ in range(ROUNDS):
            for name, fn in tasks.items():
                best[name] = min(best[name], round_median(fn, REPS))
        # What the engine stored, retrieved into zeroed blocks, is the source bit for bit.
        for c in caches:
            c[per_request:].zero_()
        retrieve()
        src_blocks = src_slots[::block_size] // block_size
        dst_blocks = dst_slots[::block_size] // block_size
        for c in caches:
            bits = c.view(torch.int16)
            assert torch.equal(bits[dst_blocks], bits[src_blocks]), "retrieve changed the KV"
    finally:
        engine.close()
    base = best["baseline"]
    rows = []
    for name in ("store", "retrieve", "gather", "scatter"):
        rows.append(
            {
                "block_size": block_size,
                "op": name,
                "what": "engine" if name in ("store", "retrieve") else "copier",
                "tokens": TOKENS,
                "bytes": nbytes,
                "ms": best[name] * 1e3,
                "gb_s": nbytes / best[name] / 1e9,
                "baseline_ms": base * 1e3,
                "baseline_gb_s": nbytes / base / 1e9,
                "ratio": base / best[name],
            }
        )
    return rows


def measure_overhead() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    per_request = TINY_TOKENS // TINY_BLOCK
    caches = paged_cache(TINY_LAYERS, 2 * per_request, TINY_HEADS, TINY_BLOCK, TINY_DIM)
    for c in caches:
        random_bits(c, gen)
    src_slots = block_slots(torch.randperm(per_request, generator=gen), TINY_BLOCK)
    dst_slots = block_slots(torch.randperm(per_request, generator=gen) + per_request, TINY_BLOCK)
    tokens = torch.randint(0, 128_000, (TINY_TOKENS,), generator=gen)
    engine = engine_for(caches, 16 * 2**20)
    kv_bytes = engine.layout.chunk_nbytes(TINY_TOKENS)
    # The steady state of a serving engine: L1 full, so every store evicts. This one
    # holds exactly one request; two prompts take turns, each evicting the other.
    page = -(-engine.layout.chunk_nbytes(CHUNK) // 4096) * 4096  # pages are 4 KiB aligned
    full = engine_for(caches, TINY_TOKENS // CHUNK * page)
    turns = [tokens, torch.randint(0, 128_000, (TINY_TOKENS,), generator=gen)]
    full.store(turns[0], src_slots)

    def lookup() -> float:
        t0 = time.perf_counter()
        hit = engine.lookup(tokens, pin=False)
        elapsed = time.perf_counter() - t0
        assert hit == TINY_TOKENS
        return elapsed

    def store() -> float:
        engine.clear()
        t0 = time.perf_counter()
        stored = engine.store(tokens, src_slots)
        elapsed = time.perf_counter() - t0
        assert stored == TINY_TOKENS
        return elapsed

    def store_full() -> float:
        turns.reverse()
        t0 = time.perf_counter()
        stored = full.store(turns[0], src_slots)
        elapsed = time.perf_counter() - t0
        assert stored == TINY_TOKENS and full.pool.free_pages == 0
        return elapsed

    def retrieve() -> float:
        t0 = time.perf_counter()
        loaded = engine.retrieve(tokens, dst_slots)
        elapsed = time.perf_counter() - t0
        assert bool(loaded.all())
        return elapsed

    # For scale: the copier alone, one chunk per call (the engine makes one call per chunk).
    chunk = torch.empty(engine.layout.chunk_shape(CHUNK), dtype=DTYPE)

    def copy(method: Callable[..., None], slots: torch.Tensor) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            method(slots, chunk)
            return time.perf_counter() - t0

        return run

    copier = engine.copier
    timed = TimedCopier(copier)
    calls: dict[str, int] = {}

    def inside(op: str, call: Callable[[], float]) -> Callable[[], float]:
        """The copier's seconds within one engine call (each of its calls timed): how
        much of store/retrieve is copying; the rest is the engine's bookkeeping."""

        def run() -> float:
            engine.copier = timed  # type: ignore[assignment]
            timed.reset()
            try:
                call()
            finally:
                engine.copier = copier
            calls[op] = timed.calls
            return timed.seconds

        return run

    tasks = {
        "store": store,
        "store, L1 full": store_full,
        "lookup": lookup,
        "retrieve": retrieve,
        "gather": copy(copier.gather, src_slots[:CHUNK]),
        "scatter": copy(copier.scatter, dst_slots[:CHUNK]),
        "store copies": inside("store", store),
        "retrieve copies": inside("retrieve", retrieve),
    }
    try:
        best = dict.fromkeys(tasks, float("inf"))
        for _ in range(ROUNDS):
            for name, fn in tasks.items():
                best[name] = min(best[name], round_median(fn, TINY_REPS))
    finally:
        engine.close()
        full.close()
    rows = [
        {
            "op": name,
            "what": "copier" if name in ("gather", "scatter") else "engine",
            "tokens": CHUNK if name in ("gather", "scatter") else TINY_TOKENS,
            "kv_bytes": kv_bytes,
            "us": best[name] * 1e6,
        }
        for name in ("lookup", "store", "store, L1 full", "retrieve", "gather", "scatter")
    ]
    for op in ("store", "retrieve"):
        copies = best[f"{op} copies"]
        rows.append(
            {
                "op": f"{op}: copier calls",
                "what": "inside",
                "tokens": TINY_TOKENS,
                "kv_bytes": kv_bytes,
                "us": copies * 1e6,
                "calls": calls[op],
            }
        )
        rows.append(
            {
                "op": f"{op}: the rest",
                "what": "inside",
                "tokens": TINY_TOKENS,
                "kv_bytes": kv_bytes,
                "us": max(best[op] - copies, 0.0) * 1e6,
            }
        )
    return rows


class TimedCopier:
    """The engine's copier with each call timed (perf_counter around the call: its own
    checks and copies, not the engine's work to prepare its arguments)."""

    def __init__(self, copier: Any) -> None:
        self._copier = copier
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._copier, name)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def _timed(self, method: str, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            getattr(self._copier, method)(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def gather(self, *args: Any, **kwargs: Any) -> None:
        self._timed("gather", *args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> None:
        self._timed("scatter", *args, **kwargs)

    def gather_chunks(self, *args: Any, **kwargs: Any) -> None:
        self._timed("gather_chunks", *args, **kwargs)

    def scatter_chunks(self, *args: Any, **kwargs: Any) -> None:
        self._timed("scatter_chunks", *args, **kwargs)


def goals(rows: list[dict[str, Any]], overhead: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for op, goal in (("store", STORE_GOAL), ("retrieve", RETRIEVE_GOAL)):
        ratios = [r["ratio"] for r in rows if r["op"] == op]
        if not ratios:  # --only overhead
            continue
        out.append(
            {
                "goal": f"engine {op} / copy_ >= {goal} at block size "
                + "/".join(str(b) for b in BLOCK_SIZES),
                "value": "/".join(f"{x:.2f}" for x in ratios),
                "pass": min(ratios) >= goal,
            }
        )
    limits = {
        "lookup": LOOKUP_GOAL_US,
        "store": STORE_GOAL_US,
        "store, L1 full": STORE_GOAL_US,
        "retrieve": RETRIEVE_GOAL_US,
    }
    for r in overhead:
        if r["what"] != "engine":
            continue
        limit = limits[r["op"]]
        out.append(
            {
                "goal": f"{r['op']} of {r['tokens']} tokens (tiny KV) < {limit:.0f} µs",
                "value": f"{r['us']:.1f} µs",
                "pass": r["us"] < limit,
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
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu,
    }


def print_table(
    rows: list[dict[str, Any]], overhead: list[dict[str, Any]], results: list[dict[str, Any]]
) -> None:
    env = environment()
    print(
        f"# python {env['python']}, torch {env['torch']} ({env['torch_threads']} threads), "
        f"{env['cpu']}"
    )
    if rows:
        print(
            f"# KV {LAYERS} layers x {KV_HEADS} heads x {HEAD_DIM} {DTYPE} (vLLM CPU layout), "
            f"{TOKENS} tokens = {TOKENS * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / GiB:.0f} GiB "
            f"per request, {CHUNK}-token chunks, blocks in random order"
        )
        print(
            f"{'block':>5} {'op':<9} {'path':<6} {'ms':>7} {'GB/s':>6}"
            f"  {'copy_ ms':>8} {'GB/s':>6}  {'ratio':>5}"
        )
    for r in rows:
        print(
            f"{r['block_size']:>5} {r['op']:<9} {r['what']:<6} {r['ms']:>7.1f} {r['gb_s']:>6.2f}"
            f"  {r['baseline_ms']:>8.1f} {r['baseline_gb_s']:>6.2f}  {r['ratio']:>5.2f}"
        )
    if overhead:
        print(
            f"# overhead: KV {TINY_LAYERS} layers x {TINY_HEADS} head x {TINY_DIM} {DTYPE}, "
            f"block size {TINY_BLOCK}, {TINY_TOKENS}-token requests "
            f"({overhead[0]['kv_bytes'] // 1024} KiB of KV), median µs per call; inside "
            "store/retrieve: the copier's calls (each timed) and the rest"
        )
    for r in overhead:
        if r["what"] == "inside":
            calls = f" ({r['calls']} calls)" if "calls" in r else ""
            print(f"  {r['op']:<22} {r['us']:>7.1f} µs{calls}")
        else:
            print(f"{r['op']:<14} {r['what']:<6} {r['tokens']:>5} tokens {r['us']:>7.1f} µs")
    for g in results:
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--only",
        choices=("throughput", "overhead"),
        help="run one part (and check its goals) instead of both",
    )
    args = parser.parse_args(argv)
    configure_logging("warning")
    rows = []
    if args.only != "overhead":
        for block_size in BLOCK_SIZES:
            rows += measure_throughput(block_size)
            gc.collect()  # free this block size's 3 GiB before the next
    overhead = measure_overhead() if args.only != "throughput" else []
    results = goals(rows, overhead)
    if args.json:
        print(
            json.dumps(
                {"env": environment(), "rows": rows, "overhead": overhead, "goals": results},
                indent=2,
            )
        )
    else:
        print_table(rows, overhead, results)
    return 0 if all(g["pass"] for g in results) else 1


if __name__ == "__main__":
    sys.exit(main())
