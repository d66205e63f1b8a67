"""Disaggregated prefill: how fast a prompt's KV moves from prefiller to decoder, and
how long after the prefill ends the decoder can start.

    python -m benchmarks.pd [--json] [--runs N] [--layer-ms MS]

A decoder engine (PD receiver) runs in a second process (this module with `--serve`);
in this process a prefiller engine (PD sender) holds a 4096-token prompt of random KV
in its paged cache, in two model shapes (fp16, 256-token chunks): a small one (2 MiB
chunks) and an 8B-class one (32 layers x 8 KV heads x 128: 32 MiB chunks).

1. **Transfer GB/s**, interleaved in the same run:
   - *pd push*: `push_layers` of chunks already in the prefiller's L1 (no copy out of
     the paged cache): the AllocChunks round trip, one NIXL WRITE per layer into the
     decoder's buffers, the commit with every chunk's xxh3, which the decoder verifies
     before the chunks enter its L1;
   - *bare NIXL*: one WRITE of the same bytes from the same pages into preallocated
     decoder pages, same agents, already connected: the limit of the data path.
   Goal: pd push >= 0.8 x bare NIXL. Also printed: *xxh3 GB/s*, the rate of hashing
   the same bytes on parallel threads, what the decoder's verification costs alone.
2. **Prefill end -> KV on the decoder** for the 4096-token prompt: the prefill is
   simulated as `--layer-ms` of compute per layer (time.sleep: on a GPU the CPU is
   free meanwhile), the chunks are copied out of the paged cache layer by layer, and
   the figure is the time from the end of the last layer's compute to the decoder's
   commit reply (then the decode can start), for the layer-by-layer push and for a
   push of everything after the prefill (the baseline).

Figures are medians of RUNS passes after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import torch

from kvmesh.common.chunk_codec import chunk_checksums
from kvmesh.common.config import EngineConfig, L1Config, P2PConfig, PDConfig
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.pd_receiver import hold_id
from kvmesh.services.worker.pd_sender import PdTarget, push_layers

GOAL = 0.8
CHUNK = 256
PROMPT = 4096
BLOCK = 16
# (label, layers, kv heads, head dim)
SHAPES = [("2 MiB", 4, 8, 64), ("32 MiB", 32, 8, 128)]


def make_engine(role: str, layers: int, heads: int, head_dim: int, pages: int) -> KVEngine:
    blocks = PROMPT // BLOCK + 1
    kv = [torch.randn(blocks, heads, BLOCK, 2 * head_dim).to(torch.float16) for _ in range(layers)]
    chunk = layers * CHUNK * heads * 2 * head_dim * 2
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="bench-pd",
        l1=L1Config(max_size=pages * chunk + (1 << 20), reserve=0),
        p2p=P2PConfig(channel="nixl", timeout_s=30.0),
        pd=PDConfig(role=role, timeout_s=30.0, max_receive_fraction=1.0),
        close_flush_s=0,
    )
    return KVEngine(f"bench-{role}", 0, cfg, kv)


def serve(spec: list[int]) -> None:
    """The decoder: a PD receiver; also preallocated pages for the bare baseline.
    stdin: a transfer id per line to release (its chunks leave L1); EOF ends it."""
    layers, heads, head_dim, n = spec
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # logs to stderr; stdout carries JSON lines
    eng = make_engine("receiver", layers, heads, head_dim, 2 * n + 1)
    shape, dtype, fmt = eng.layout.chunk_shape(CHUNK), eng.layout.dtype, eng.chunk_format
    bare = [eng.pool.allocate(shape, dtype, fmt) for _ in range(n)]
    info = {"endpoint": eng.p2p_endpoint, "addrs": [o.data_ptr for o in bare]}
    print(json.dumps(info), file=out, flush=True)
    for line in sys.stdin:
        eng.release_lookup(hold_id(line.strip()))
        deadline = time.monotonic() + 10
        while len(eng.storage.l1) and time.monotonic() < deadline:
            time.sleep(0.001)
        print(json.dumps({"released": len(eng.storage.l1) == 0}), file=out, flush=True)
    eng.close()


def _drain(gen, layer_s: float = 0.0) -> tuple[int, float]:
    """Step a push generator, sleeping layer_s per layer before each step; (result,
    seconds from the end of the last layer's compute to the result)."""
    end = time.perf_counter()
    while True:
        if layer_s:
            time.sleep(layer_s)
        end = time.perf_counter()
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value, time.perf_counter() - end


def measure(label: str, layers: int, heads: int, head_dim: int, runs: int, layer_ms: float):
    n = PROMPT // CHUNK
    decoder = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.pd", "--serve", f"{layers},{heads},{head_dim},{n}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    info = json.loads(decoder.stdout.readline())
    eng = make_engine("sender", layers, heads, head_dim, 2 * n + 2)
    try:
        tokens = list(range(1, PROMPT + 1))
        slots = torch.arange(PROMPT)

        def release(tid: str) -> None:
            decoder.stdin.write(tid + "\n")
            decoder.stdin.flush()
            assert json.loads(decoder.stdout.readline())["released"]

        def push(layerwise: bool, layer_s: float = 0.0) -> tuple[float, float]:
            tid = uuid.uuid4().hex
            t0 = time.perf_counter()
            gen = push_layers(
                eng, tokens, slots, None, PdTarget(tid, info["endpoint"]), layerwise=layerwise
            )
            pushed, tail = _drain(gen, layer_s)
            took = time.perf_counter() - t0
            assert pushed == PROMPT, pushed
            release(tid)
            return took, tail

        push(True)  # warm-up: hello, add_remote_agent; the chunks are now in our L1
        objs = [eng.storage.l1.get(k) for _, _, k in eng.chunks(tokens)]
        nbytes = objs[0].nbytes
        channel = eng.pd_sender.channel
        peer = channel._agents[info["endpoint"]]
        local = [(o.data_ptr, nbytes, 0) for o in objs]
        remote = [(a, nbytes, 0) for a in info["addrs"]]

        def bare() -> float:
            t0 = time.perf_counter()
            channel._transfer(peer, local, remote, time.monotonic() + 30, "WRITE")
            return time.perf_counter() - t0

        hash_loop = asyncio.new_event_loop()

        def hashed() -> float:
            # What verification alone costs: the decoder hashes every byte it received.
            t0 = time.perf_counter()
            hash_loop.run_until_complete(chunk_checksums(objs))
            return time.perf_counter() - t0

        bare()
        push_t, bare_t, hash_t = [], [], []
        for _ in range(runs):
            # A push keeps each chunk's checksum on it; a chunk fresh from a prefill has
            # none, so every timed push hashes as the first one did.
            for o in objs:
                o.checksum = None
            push_t.append(push(False)[0])  # chunks in L1: alloc, write, hash, commit
            bare_t.append(bare())
            hash_t.append(hashed())
        # Prefill end -> KV landed: fresh chunks copied out of the paged cache.
        tails = {"layerwise": [], "whole": []}
        for _ in range(max(3, runs // 3)):
            for mode in tails:
                eng.clear()
                tails[mode].append(push(mode == "layerwise", layer_ms / 1e3)[1])
        hash_loop.close()
        for o in objs:
            o.ref_down()
        total = n * nbytes
        push_gbs = total / statistics.median(push_t) / 1e9
        bare_gbs = total / statistics.median(bare_t) / 1e9
        return {
            "size": label,
            "chunk_bytes": nbytes,
            "chunks": n,
            "push_gbs": round(push_gbs, 2),
            "bare_nixl_gbs": round(bare_gbs, 2),
            "ratio": round(push_gbs / bare_gbs, 3),
            "xxh3_gbs": round(total / statistics.median(hash_t) / 1e9, 2),
            "tail_layerwise_ms": round(statistics.median(tails["layerwise"]) * 1e3, 2),
            "tail_whole_ms": round(statistics.median(tails["whole"]) * 1e3, 2),
        }
    finally:
        eng.close()
        decoder.stdin.close()
        decoder.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--layer-ms", type=float, default=5.0, help="simulated compute/layer")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve([int(x) for x in args.serve.split(",")])
        return 0
    rows = [measure(*shape, args.runs, args.layer_ms) for shape in SHAPES]
    goals = [
        {
            "goal": f"pd push >= {GOAL} x bare NIXL ({r['size']} chunks)",
            "value": r["ratio"],
            "pass": r["ratio"] >= GOAL,
        }
        for r in rows
    ]
    if args.json:
        print(json.dumps({"rows": rows, "goals": goals, "layer_ms": args.layer_ms}))
    else:
        print(
            f"{'chunk':>7} {'push GB/s':>10} {'bare GB/s':>10} {'ratio':>6} {'xxh3 GB/s':>10} "
            f"{'end->KV layerwise ms':>21} {'end->KV whole ms':>17}"
        )
        for r in rows:
            print(
                f"{r['size']:>7} {r['push_gbs']:>10} {r['bare_nixl_gbs']:>10} {r['ratio']:>6} "
                f"{r['xxh3_gbs']:>10} "
                f"{r['tail_layerwise_ms']:>21} {r['tail_whole_ms']:>17}"
            )
        for g in goals:
            print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")
    return 0 if all(g["pass"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
