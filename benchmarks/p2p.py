"""P2P tier transfer speed: chunks read from a peer's L1 through the tier vs bare NIXL.

    python -m benchmarks.p2p [--json] [--runs N]

Starts a peer engine in a second process (this module with `--serve`) that puts N
chunks of random bytes into its L1 and serves them over NIXL (UCX, DRAM to DRAM). In
this process an engine with the P2P tier then, for chunks of 2 MiB and 32 MiB, times
in the same run, interleaved:

- **p2p tier**: `storage.get_prefix(keys)` with L1 empty: what a retrieve pays for a
  prefix held by a peer: the batched pin request, NIXL READs of every chunk into
  fresh L1 pages (~2 MiB ranges, each hashed as it lands), the xxh3 check of each
  chunk, promotion to L1, the release;
- **bare NIXL**: one READ of the same peer buffers into preallocated pages of the same
  pool with the same agent (already connected): the limit of the data path.

The peer hashes a chunk at its first pin and keeps the sum for later readers, so the
p2p passes read chunks already hashed there. A third column, **first read**, times the
same read after the peer has forgotten its sums: what the first reader of fresh KV pays
(the peer hashes every chunk before it answers the pin). For context, not a goal.

Figures are GB/s (bytes / median time of RUNS passes after a warm-up). Goal: p2p tier
≥ 0.8 × bare NIXL for both sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from kvmesh.common.config import EngineConfig, L1Config, P2PConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.peer_locator import PeerLocation

GOAL = 0.8
CHUNK_TOKENS = 256
# (label, layers, kv heads, head dim, chunks per pass): fp16, 256 tokens a chunk.
SIZES = [("2 MiB", 4, 8, 64, 16), ("32 MiB", 32, 8, 128, 4)]


def make_engine(name: str, layers: int, heads: int, head_dim: int, pages: int) -> KVEngine:
    kv = [torch.zeros(2, heads, 16, 2 * head_dim, dtype=torch.float16) for _ in range(layers)]
    chunk = layers * CHUNK_TOKENS * heads * 2 * head_dim * 2
    cfg = EngineConfig(
        chunk_size=CHUNK_TOKENS,
        model_name="bench-p2p",
        l1=L1Config(max_size=pages * chunk + (1 << 20), reserve=0),
        p2p=P2PConfig(enabled=True, channel="nixl", timeout_s=5.0),
        close_flush_s=0,
    )
    return KVEngine(name, 0, cfg, kv)


def serve(spec: list[int]) -> None:
    """The peer: N random chunks in L1, their keys and addresses on stdout."""
    layers, heads, head_dim, n = spec
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # logs to stderr; stdout carries one JSON line
    eng = make_engine("peer", layers, heads, head_dim, n + 1)
    keys, addrs, objs = [], [], []
    for i in range(n):
        obj = eng.storage.l1.allocate(
            eng.layout.chunk_shape(CHUNK_TOKENS), eng.layout.dtype, eng.chunk_format
        )
        obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8))
        key = eng.namespace.key(i.to_bytes(16, "little"))
        obj.key = key
        eng.storage.put(key, obj)
        keys.append(key.to_str())
        addrs.append(obj.data_ptr)
        objs.append(obj)
    info = {"endpoint": eng.p2p_endpoint, "keys": keys, "addrs": addrs, "nbytes": obj.nbytes}
    print(json.dumps(info), file=out, flush=True)
    for line in sys.stdin:  # until the reader closes our stdin
        if line.strip() == "forget-sums":
            # The next read pins chunks never hashed, as the first read of fresh KV does.
            for obj in objs:
                obj.checksum = None
            print("ok", file=out, flush=True)
    eng.close()


class AllAt:
    """Locator: every key is at one endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def locate(self, keys, timeout: float) -> PeerLocation:
        return PeerLocation("peer", 0, self.endpoint, len(keys))


def measure(label: str, layers: int, heads: int, head_dim: int, n: int, runs: int) -> dict:
    peer = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.p2p", "--serve", f"{layers},{heads},{head_dim},{n}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    info = json.loads(peer.stdout.readline())
    eng = make_engine("reader", layers, heads, head_dim, 2 * n + 1)
    try:
        eng.peer_locator = AllAt(info["endpoint"])
        keys = [ChunkKey.from_str(k) for k in info["keys"]]
        tier = eng.storage.tier("p2p")
        channel = tier.channel
        nbytes = info["nbytes"]
        shape, dtype, fmt = eng.layout.chunk_shape(CHUNK_TOKENS), eng.layout.dtype, eng.chunk_format
        bare_bufs = [eng.pool.allocate(shape, dtype, fmt) for _ in range(n)]
        local = [(o.data_ptr, nbytes, 0) for o in bare_bufs]
        remote = [(a, nbytes, 0) for a in info["addrs"]]

        def p2p_pass() -> float:
            eng.storage.l1.clear()
            t0 = time.perf_counter()
            objs, sources = eng.storage.get_prefix(keys)
            took = time.perf_counter() - t0
            assert len(objs) == n and set(sources) == {"p2p"}, (len(objs), sources)
            for o in objs:
                o.ref_down()
            return took

        def first_pass() -> float:
            peer.stdin.write("forget-sums\n")
            peer.stdin.flush()
            assert peer.stdout.readline().strip() == "ok"
            return p2p_pass()

        def bare_pass() -> float:
            t0 = time.perf_counter()
            channel._transfer(peer_agent, local, remote, time.monotonic() + 10)
            return time.perf_counter() - t0

        p2p_pass()  # warm-up: hello, add_remote_agent, first pages touched
        peer_agent = channel._agents[info["endpoint"]]
        bare_pass()
        p2p_t, bare_t, first_t = [], [], []
        for _ in range(runs):
            p2p_t.append(p2p_pass())
            bare_t.append(bare_pass())
            first_t.append(first_pass())
        # Same bytes landed both ways.
        objs, _ = eng.storage.get_prefix(keys)
        assert all(torch.equal(o.raw, b.raw) for o, b in zip(objs, bare_bufs, strict=True))
        for o in (*objs, *bare_bufs):
            o.ref_down()
        total = n * nbytes
        p2p_gbs = total / statistics.median(p2p_t) / 1e9
        bare_gbs = total / statistics.median(bare_t) / 1e9
        return {
            "size": label,
            "chunk_bytes": nbytes,
            "chunks_per_pass": n,
            "p2p_gbs": round(p2p_gbs, 2),
            "bare_nixl_gbs": round(bare_gbs, 2),
            "ratio": round(p2p_gbs / bare_gbs, 3),
            "first_read_gbs": round(total / statistics.median(first_t) / 1e9, 2),
            "p2p_ms": round(statistics.median(p2p_t) * 1e3, 3),
            "bare_ms": round(statistics.median(bare_t) * 1e3, 3),
        }
    finally:
        eng.close()
        peer.stdin.close()
        peer.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.p2p", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve([int(x) for x in args.serve.split(",")])
        return 0
    rows = [measure(*size, args.runs) for size in SIZES]
    goals = [
        {
            "goal": f"p2p tier >= {GOAL} x bare NIXL ({r['size']} chunks)",
            "value": r["ratio"],
            "pass": r["ratio"] >= GOAL,
        }
        for r in rows
    ]
    if args.json:
        print(json.dumps({"rows": rows, "goals": goals, "ucx_tls": os.environ.get("UCX_TLS")}))
    else:
        print(
            f"{'chunk':>7} {'x/pass':>6} {'p2p GB/s':>9} {'bare GB/s':>10} {'ratio':>6}"
            f" {'first read GB/s':>16}"
        )
        for r in rows:
            print(
                f"{r['size']:>7} {r['chunks_per_pass']:>6} {r['p2p_gbs']:>9} "
                f"{r['bare_nixl_gbs']:>10} {r['ratio']:>6} {r['first_read_gbs']:>16}"
            )
        for g in goals:
            print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")
    return 0 if all(g["pass"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
