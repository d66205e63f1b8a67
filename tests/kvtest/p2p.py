"""P2P test parts: a fixed-table PeerLocator, and the engines of the P2P tests.

`FixedLocator` answers from a table (chunk key → peer endpoint) instead of the
controller, so the P2P tests need no controller. `python -m kvtest.p2p CONFIG.json`
runs one engine in its own process and obeys JSON commands, one per stdin line,
answering one JSON line each on stdout (see `Node.handle`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence

import torch

from kvmesh.common.config import EngineConfig, L1Config, P2PConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.peer_locator import PeerLocation
from kvmesh.services.worker.tiers.misses import MissReason

CHUNK = 16
BLOCKS, BLOCK = 64, 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 16


class FixedLocator:
    """A PeerLocator over a table; `delay` simulates a slow controller."""

    def __init__(self, table: dict[ChunkKey, str] | None = None, delay: float = 0.0) -> None:
        self.table: dict[ChunkKey, str] = dict(table or {})
        self.delay = delay
        self._lock = threading.Lock()

    def set(self, keys: Sequence[ChunkKey], endpoint: str) -> None:
        with self._lock:
            for key in keys:
                self.table[key] = endpoint

    def locate(self, keys: Sequence[ChunkKey], timeout: float) -> PeerLocation | None:
        if self.delay:
            if self.delay > timeout:
                time.sleep(timeout)
                return None
            time.sleep(self.delay)
        with self._lock:
            first = self.table.get(keys[0]) if keys else None
            if first is None:
                return None
            n = 0
            for key in keys:
                if self.table.get(key) != first:
                    break
                n += 1
        return PeerLocation("peer", 0, first, n)


def engine_config(channel: str = "zmq", host: str = "127.0.0.1", **p2p) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="p2p-test",
        l1=L1Config(max_size=32 << 20, reserve=0, alloc_timeout_s=0.2),
        p2p=P2PConfig(enabled=True, host=host, channel=channel, **p2p),
        close_flush_s=0,
    )


def kv_cache(seed: int | None) -> list[torch.Tensor]:
    """CPU-layout paged KV; random (seeded) or zeros."""
    shape = (BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(LAYERS)]


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30_000, (n,), generator=gen).tolist()


def slot_bytes(cache: list[torch.Tensor], slots: torch.Tensor) -> bytes:
    """The KV of slots (token positions in the paged cache), as raw bytes."""
    out = []
    for layer in cache:
        flat = layer.permute(0, 2, 1, 3).reshape(BLOCKS * BLOCK, HEADS, 2 * HEAD_DIM)
        out.append(flat[slots].contiguous().view(torch.int16))
    return torch.stack(out).numpy().tobytes()


class Node:
    def __init__(self, cfg: dict) -> None:
        self.cache = kv_cache(cfg.get("seed"))
        config = engine_config(
            cfg.get("channel", "zmq"),
            cfg.get("host", "127.0.0.1"),
            timeout_s=cfg.get("timeout_s", 1.0),
            port=cfg.get("port", 0),
            peer_idle_s=cfg.get("peer_idle_s", 300.0),
        )
        self.engine = KVEngine(cfg.get("name", "node"), 0, config, self.cache)
        self.locator = FixedLocator()
        self.engine.peer_locator = self.locator

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        e = self.engine
        if op == "info":
            channel = e.storage.tier("p2p").channel
            return {
                "endpoint": e.p2p_endpoint,
                "channel": channel.name,
                "agent": channel.hello_fields()[0],
                "tiers": [t.name for t in e.storage.tiers],
            }
        if op == "agent_loaded":  # is the named peer agent's metadata loaded here?
            channel = e.storage.tier("p2p").channel
            check = channel.agent.check_remote_metadata
            return {"loaded": channel._pool.submit(check, cmd["agent"]).result(5)}
        if op == "store":
            tokens = prompt(cmd["seed"], cmd["n"])
            slots = torch.arange(cmd["n"])
            stored = e.store(tokens, slots)
            keys = [k.to_str() for _, _, k in e.chunks(tokens)]
            return {"stored": stored, "keys": keys, "kv": slot_bytes(self.cache, slots).hex()}
        if op == "locate":
            self.locator.set([ChunkKey.from_str(k) for k in cmd["keys"]], cmd["endpoint"])
            return {"ok": True}
        if op == "retrieve":
            tokens = prompt(cmd["seed"], cmd["n"])
            slots = torch.arange(cmd["n"])
            t0 = time.perf_counter()
            hit = e.lookup(tokens, pin=False)
            loaded = e.retrieve(tokens, slots)
            took = time.perf_counter() - t0
            m = e.stats.metrics
            return {
                "lookup": hit,
                "loaded": int(loaded.sum()),
                "seconds": took,
                "kv": slot_bytes(self.cache, slots[: int(loaded.sum())]).hex(),
                "p2p_tokens": m.value("tokens_hit_total", {"tier": "p2p"}),
                # Peers' NIXL agents unloaded, replaced or idle (NIXL only).
                "agents_retired": getattr(e.storage.tier("p2p").channel, "retired", 0),
                "gets": {
                    r: m.value("p2p_gets_total", {"result": r})
                    for r in ("hit", "error", "corrupt", "miss")
                },
                "misses": {
                    r: m.value("chunk_misses_total", {"tier": "p2p", "reason": r})
                    for r in [reason.value for reason in MissReason]
                },
            }
        if op == "corrupt":
            return {"corrupted": corrupt_l1(e)}
        if op == "clear":
            return {"cleared": e.clear(tier="l1")}
        if op == "leases":
            return {"leases": e.stats.metrics.value("p2p_server_leases")}
        raise ValueError(f"unknown op {op}")


def corrupt_l1(engine: KVEngine) -> int:
    """Flip one byte of each chunk in L1 after its checksum is known: what a bad DIMM or
    a stray write would do. A peer keeps serving the old checksum. Returns how many."""
    from kvmesh.common.chunk_codec import chunk_bytes, payload_checksum

    held = engine.storage.l1.keys()
    for key in held:
        obj = engine.storage.l1.get(key)
        if obj.checksum is None:
            obj.checksum = payload_checksum(chunk_bytes(obj))
        obj.raw[7] ^= 0xFF
        obj.ref_down()
    return len(held)


def serve_commands(node_type: type) -> None:
    """Run node_type(config from argv[1]) and answer its JSON commands, one per stdin
    line, with one JSON line each on stdout (the first: its "info"), until EOF."""
    cfg = json.loads(sys.argv[1])
    # Answers go to the original stdout; anything else printed (logs) to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    node = node_type(cfg)
    print(json.dumps(node.handle({"op": "info"})), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = node.handle(json.loads(line))
        except Exception as exc:
            answer = {"error": repr(exc)}
        print(json.dumps(answer), file=out, flush=True)
    # A node with more than its engine to end (a traffic thread) says so in close().
    getattr(node, "close", node.engine.close)()


if __name__ == "__main__":
    serve_commands(Node)
