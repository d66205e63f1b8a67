"""One engine of the mesh fault tests, in its own process, with L1, P2P (located
through the controller) and the remote tier (the cache-server):

    python -m kvtest.mesh_node CONFIG.json

It answers JSON commands, one per stdin line, with one JSON line each on stdout (the
first line: its "info"). Traffic runs on a thread of its own between "start" and
"stop", so that a test can inject faults while it runs; every call is timed, and every
loaded chunk is checked against the bytes its tokens imply (`expected_kv`), so a
wrong chunk can never pass for a hit.

The KV of token t at position p is a hash of (t, p) spread over every layer, head and
channel: a chunk's bytes follow from its prefix alone, which is what its key names, so
any process can check any chunk it loads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.common.config import (
    EngineConfig,
    EngineControllerConfig,
    L1Config,
    P2PConfig,
    RemoteConfig,
)
from kvmesh.services.worker.engine import KVEngine
from kvtest.p2p import serve_commands

CHUNK = 16
LAYERS, HEADS, HEAD_DIM = 4, 4, 64  # 4 KiB a token, 64 KiB a chunk (a tracked ZMQ send)
BLOCKS, BLOCK = 32, 16
SLOTS = BLOCKS * BLOCK
PROMPT = 64  # tokens: 4 chunks
SENTINEL = -21846  # 0xAAAA: what a slot holds before a load writes it
TIERS = ("l1", "p2p", "remote")


def prompt_tokens(seed: int, n: int = PROMPT) -> list[int]:
    """Distinct seeds give distinct first tokens, so no two prompts share a chunk."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 30_000, (n,), generator=gen)
    toks[0] = 30_000 + seed  # never equal across seeds
    return toks.tolist()


def expected_kv(tokens: list[int]) -> torch.Tensor:
    """[layers, tokens, heads, 2*head_dim] int16: the KV bit patterns of tokens."""
    t = torch.tensor(tokens, dtype=torch.int64)
    p = torch.arange(len(tokens), dtype=torch.int64)
    base = (t * 2_654_435_761 + p * 40_503 + 12_345) % (1 << 31)
    idx = torch.arange(LAYERS * HEADS * 2 * HEAD_DIM, dtype=torch.int64)
    x = base[:, None] * 69_069 + idx[None, :] * 1_103_515_245
    x = x ^ (x >> 13)
    x = (x * 2_246_822_519) % (1 << 31)
    x = (x ^ (x >> 16)) & 0xFFFF
    x = torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)
    return x.view(len(tokens), LAYERS, HEADS, 2 * HEAD_DIM).permute(1, 0, 2, 3)


def new_cache() -> list[torch.Tensor]:
    shape = (BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)]


def write_slots(cache: list[torch.Tensor], slots: torch.Tensor, kv: torch.Tensor) -> None:
    blocks, offs = slots // BLOCK, slots % BLOCK
    for layer, t in enumerate(cache):
        t.view(torch.int16)[blocks, :, offs, :] = kv[layer]


def read_slots(cache: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    blocks, offs = slots // BLOCK, slots % BLOCK
    return torch.stack([t.view(torch.int16)[blocks, :, offs, :] for t in cache])


def engine_config(cfg: dict[str, Any]) -> EngineConfig:
    deadline = cfg.get("timeout_s", 0.5)
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="mesh-faults",
        l1=L1Config(max_size=cfg.get("l1_bytes", 6 << 20), reserve=0, alloc_timeout_s=0.2),
        remote=RemoteConfig(
            enabled=True,
            url=cfg["remote"],
            timeout_s=deadline,
            lookup_timeout_s=0.05,
            health_interval_s=0.1,
            failures_to_down=2,
            # Never expired within a test: what is asserted of the keys remembered as
            # present must come from the tier forgetting them, not from their age.
            presence_ttl_s=600.0,
        ),
        p2p=P2PConfig(enabled=True, channel="zmq", timeout_s=deadline, lookup_timeout_s=0.05),
        controller=EngineControllerConfig(
            enabled=True,
            url=cfg["controller"],
            heartbeat_s=0.2,
            timeout_s=0.5,
            event_flush_s=0.02,
        ),
        close_flush_s=0,
    )


class Report:
    """What a run of calls saw: counts, worst times, and every broken promise."""

    def __init__(self, bounds: dict[str, float]) -> None:
        self.bounds = bounds
        self.calls: dict[str, int] = {}
        self.worst: dict[str, float] = {}
        self.late: list[str] = []
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self.loaded_chunks = 0
        self.asked_chunks = 0

    def timed(self, op: str, fn: Callable[[], Any], what: str) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            self.errors.append(f"{op} {what}: {exc!r}")
            return None
        finally:
            took = time.perf_counter() - t0
            self.calls[op] = self.calls.get(op, 0) + 1
            self.worst[op] = max(self.worst.get(op, 0.0), took)
            if took > self.bounds[op]:
                self.late.append(f"{op} {what}: {took:.3f}s > {self.bounds[op]:.3f}s")

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "worst": self.worst,
            "late": self.late[:20],
            "n_late": len(self.late),
            "wrong": self.wrong[:20],
            "n_wrong": len(self.wrong),
            "errors": self.errors[:20],
            "n_errors": len(self.errors),
            "loaded_chunks": self.loaded_chunks,
            "asked_chunks": self.asked_chunks,
        }


class MeshNode:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.name = cfg["name"]
        self.cache = new_cache()
        self.engine = KVEngine(self.name, 0, engine_config(cfg), self.cache)
        self.remote = self.engine.storage.tier("remote")
        self.free_at_start = self.engine.pool.free_pages
        deadline = cfg.get("timeout_s", 0.5)
        margin = cfg.get("margin_s", 0.3)
        # A store is L1 only: at worst one page wait per chunk. A lookup asks the
        # controller (P2P) and the remote, each with its own short deadline. A
        # retrieve may ask a peer (after locating it) and then the remote, each within
        # the tiers' deadline.
        self.bounds = {
            "store": 0.2 * (PROMPT // CHUNK) + margin,
            "lookup": 0.05 + 0.05 + margin,
            "retrieve": 0.05 + 2 * deadline + margin,
            "flush": 5.0 + margin,
        }
        self.rng = random.Random(cfg.get("rng", 0))
        self._lock = threading.Lock()  # one call at a time into this node's paged cache
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report: Report | None = None
        self._hits_at_start: dict[str, float] = {}
        self.stored: list[int] = []

    # -- one store / one checked retrieve ------------------------------------------------
    def _slots(self) -> torch.Tensor:
        return torch.tensor(self.rng.sample(range(SLOTS), PROMPT), dtype=torch.int64)

    def store(self, seed: int, report: Report) -> int:
        toks = prompt_tokens(seed)
        slots = self._slots()
        with self._lock:
            write_slots(self.cache, slots, expected_kv(toks))
            stored = report.timed("store", lambda: self.engine.store(toks, slots), f"seed {seed}")
        if stored:
            self.stored.append(seed)
        return stored or 0

    def retrieve(self, seed: int, report: Report) -> int:
        """Tokens loaded for seed's prompt, each checked; a miss is fine, wrong KV is not."""
        toks = prompt_tokens(seed)
        slots = self._slots()
        with self._lock:
            for t in self.cache:
                t.view(torch.int16)[slots // BLOCK, :, slots % BLOCK, :] = SENTINEL
            report.timed("lookup", lambda: self.engine.lookup(toks, pin=False), f"seed {seed}")
            loaded = report.timed(
                "retrieve", lambda: self.engine.retrieve(toks, slots), f"seed {seed}"
            )
            got = read_slots(self.cache, slots)
        report.asked_chunks += PROMPT // CHUNK
        if loaded is None:
            return 0
        n = int(loaded.sum())
        if not bool(loaded[:n].all()) or n % CHUNK:
            report.wrong.append(f"seed {seed}: loaded mask is not a chunk prefix: {loaded}")
            return n
        report.loaded_chunks += n // CHUNK
        want = expected_kv(toks)
        if n and not torch.equal(got[:, :n], want[:, :n]):
            bad = sorted(
                {
                    int(i) // CHUNK
                    for i in (got[:, :n] != want[:, :n]).any(-1).any(-1).any(0).nonzero()
                }
            )
            report.wrong.append(f"seed {seed}: chunks {bad} of {n // CHUNK} loaded hold wrong KV")
        if n < PROMPT and not bool((got[:, n:] == SENTINEL).all()):
            report.wrong.append(f"seed {seed}: slots past the loaded prefix were written")
        return n

    # -- background traffic --------------------------------------------------------------
    def _traffic(self, cfg: dict[str, Any], report: Report) -> None:
        base, peer_base = cfg["base"], cfg.get("peer_base")
        peers = list(cfg.get("peer_seeds", []))
        i = 0
        while not self._stop.is_set():
            seed = base + i
            i += 1
            self.store(seed, report)
            self.retrieve(seed, report)  # just stored: L1
            if len(self.stored) > 1:  # an older one: L1, or the remote once evicted
                self.retrieve(self.rng.choice(self.stored[:-1]), report)
            if peer_base is not None:  # maybe the peer's: its L1 over P2P, or the remote
                self.retrieve(peer_base + self.rng.randrange(max(1, i)), report)
            for seed in self.rng.sample(peers, min(len(peers), 2)):
                # Known to be the peer's: dropped here first, so the read goes to it.
                self.engine.clear(prompt_tokens(seed), tier="l1")
                self.retrieve(seed, report)
            if cfg.get("pause_s"):
                time.sleep(cfg["pause_s"])

    def start(self, cfg: dict[str, Any]) -> dict[str, Any]:
        assert self._thread is None, "traffic already running"
        self._stop.clear()
        self._report = Report(self.bounds)
        self._hits_at_start = self.hits()
        self._thread = threading.Thread(
            target=self._traffic, args=(cfg, self._report), name="traffic", daemon=True
        )
        self._thread.start()
        return {"ok": True}

    def stop(self) -> dict[str, Any]:
        assert self._thread is not None and self._report is not None
        self._stop.set()
        self._thread.join(30)
        alive = self._thread.is_alive()
        self._thread = None
        out = self._report.as_dict()
        out["hung"] = alive
        now = self.hits()
        out["hits"] = {t: now[t] - self._hits_at_start[t] for t in TIERS}
        out["node"] = self.name
        return out

    def close(self) -> None:
        if self._thread is not None:  # a test that failed mid-traffic: end it first
            self.stop()
        self.engine.close()

    # -- commands ------------------------------------------------------------------------
    def hits(self) -> dict[str, float]:
        m = self.engine.stats.metrics
        return {t: m.value("tokens_hit_total", {"tier": t}) for t in TIERS}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        e = self.engine
        if op == "info":
            return {
                "endpoint": e.p2p_endpoint,
                "tiers": [t.name for t in e.storage.tiers],
                "free_pages": e.pool.free_pages,
                "bounds": self.bounds,
            }
        if op == "start":
            return self.start(cmd)
        if op == "stop":
            return self.stop()
        if op == "store":
            report = Report(self.bounds)
            stored = [self.store(s, report) for s in cmd["seeds"]]
            if cmd.get("flush"):
                report.timed("flush", lambda: e.storage.flush(5.0), "")
            return {"stored": stored, **report.as_dict()}
        if op == "retrieve":
            report = Report(self.bounds)
            before = self.hits()
            if cmd.get("drop_l1"):
                for s in cmd["seeds"]:
                    e.clear(prompt_tokens(s), tier="l1")
            loaded = [self.retrieve(s, report) for s in cmd["seeds"]]
            after = self.hits()
            hits = {t: after[t] - before[t] for t in TIERS}
            return {"loaded": loaded, "hits": hits, **report.as_dict()}
        if op == "remote":
            return {
                "up": self.remote.up,
                "pending": self.remote.pending_puts,
                "reason": self.remote.health.reason,
            }
        if op == "registered":
            client = getattr(e, "controller_client", None)
            return {"registered": bool(client is not None and client.registered)}
        if op == "release":
            # Everything this node holds goes: puts in flight finish (they hold pages),
            # L1 is emptied, and every page must be back in the free list.
            flushed = e.storage.flush(cmd.get("timeout_s", 10.0))
            e.clear(tier="l1")
            deadline = time.monotonic() + cmd.get("timeout_s", 10.0)
            while e.pool.free_pages != self.free_at_start and time.monotonic() < deadline:
                time.sleep(0.05)
            return {
                "flushed": flushed,
                "free_pages": e.pool.free_pages,
                "free_at_start": self.free_at_start,
                "l1_chunks": len(e.storage.l1),
                "pending": self.remote.pending_puts,
            }
        raise ValueError(f"unknown op {op}")


def main() -> None:
    serve_commands(MeshNode)


if __name__ == "__main__":
    main()
