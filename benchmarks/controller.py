"""Controller speed and size: KV-event ingest, P2P-lookup latency, registry memory.

    python -m benchmarks.controller [--json] [--quick]

Starts a real controller (`python -m kvmesh.services.controller`) on loopback and
talks to it through the protocol's own client:

- **ingest**: one fake worker sends pre-encoded `KVEventBatch`es of 1024 admits (the
  worker's default `event_batch`) back to back, then a heartbeat; the controller
  answers that heartbeat only after applying every batch before it (one ordered
  connection), so events / (time to the heartbeat's reply) is the rate the controller
  applies them. Encoding on the sender is not counted (the worker encodes on its own
  core).
- **lookup**: with 1M chunks registered (the ingest's), P2P lookups of a 16-key prefix
  one at a time from a second client; p50/p99 of the whole round trip (client encode,
  loopback, controller decode + registry + reply). Half the lookups hit, half miss.
- **resync**: then the worker sends its whole state (`FullState` of every key, as after a
  sequence gap or a controller restart) while the second client goes on with lookups:
  the time to the state's reply, and the lookups' latency meanwhile (p99, max).
- **memory**: in this process, a `Registry` fed 1M admits of distinct keys, RSS
  before/after (keys already built): bytes per chunk and MiB per million chunks.

Goals (issue 7): ingest ≥ 200k events/s batched; lookup p99 < 1 ms with 1M chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.services.controller.registry import Registry

BATCH = 1024
NS = "0123456789abcdef"


def keys(n: int, salt: int = 0) -> list[str]:
    return [f"{NS}-{(i * 2654435761 + salt) & ((1 << 128) - 1):032x}" for i in range(n)]


def start_controller(workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / "ready.json"
    env = {**os.environ, "KVMESH_LOGGING__LEVEL": "warning", "KVMESH_LOGGING__JSON": "false"}
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.services.controller",
        "--port",
        "0",
        "--ready-file",
        str(ready),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("controller did not start")
        time.sleep(0.02)
    return proc, f"tcp://127.0.0.1:{json.loads(ready.read_text())['port']}"


async def ingest_and_lookup(url: str, chunks: int, lookups: int) -> dict:
    w = ControllerConnection(url, timeout_s=120.0)
    await w.connect()
    reg = await w.request(
        proto.Register(w.next_rid(), "bench", 0, 1, [NS], "tcp://127.0.0.1:1", 60.0),
        proto.RegisterReply,
    )
    ks = keys(chunks)
    frames = [
        proto.encode(
            proto.KVEventBatch(0, reg.worker_id, i + 1, [(1, k, "l1") for k in ks[i : i + BATCH]])
        )
        for i in range(0, chunks, BATCH)
    ]
    sock = w._sock
    assert sock is not None
    t0 = time.perf_counter()
    for f in frames:
        await sock.send(f)
    await w.request(proto.Heartbeat(w.next_rid(), reg.worker_id, chunks), proto.HeartbeatReply)
    ingest_s = time.perf_counter() - t0
    listed = await w.request(proto.ListWorkers(w.next_rid()), proto.ListWorkersReply)
    assert listed.workers[0].chunks == {"l1": chunks}, listed.workers[0].chunks

    del frames
    # Keep this process's collector off the million key strings while timing: the
    # figure is the controller's, not the benchmark client's.
    gc.collect()
    gc.freeze()
    q = ControllerConnection(url, timeout_s=5.0)
    await q.connect()
    misses = keys(16, salt=12345)
    lat = []
    hits = 0
    for i in range(lookups):
        start = (i * 7919) % (chunks - 16)
        ask = ks[start : start + 16] if i % 2 == 0 else misses
        t = time.perf_counter()
        r = await q.request(proto.P2PLookup(q.next_rid(), ask, "asker"), proto.P2PLookupReply)
        lat.append(time.perf_counter() - t)
        hits += r.count == 16
    assert hits == (lookups + 1) // 2, hits
    # Resync: the worker sends its whole state (after a sequence gap or a controller
    # restart) while the second client goes on looking up, one lookup at a time.
    full = proto.FullState(w.next_rid(), reg.worker_id, chunks, {"l1": ks})
    t0 = time.perf_counter()
    sent = asyncio.ensure_future(w.request(full, proto.FullStateReply, deadline_s=120.0))
    during = []
    while not sent.done():
        t = time.perf_counter()
        await q.request(proto.P2PLookup(q.next_rid(), ks[:16], "asker"), proto.P2PLookupReply)
        during.append(time.perf_counter() - t)
    full_s = time.perf_counter() - t0
    assert (await sent).chunks == chunks
    during.sort()
    await q.close()
    await w.close()
    gc.unfreeze()
    lat.sort()
    return {
        "events": chunks,
        "ingest_s": round(ingest_s, 3),
        "ingest_events_per_s": round(chunks / ingest_s),
        "lookup_p50_ms": round(statistics.median(lat) * 1e3, 3),
        "lookup_p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 3),
        "lookups": lookups,
        "full_state_s": round(full_s, 3),
        "lookups_during_full_state": len(during),
        "lookup_p99_during_full_state_ms": round(during[int(len(during) * 0.99) - 1] * 1e3, 3)
        if len(during) >= 100
        else None,
        "lookup_max_during_full_state_ms": round(during[-1] * 1e3, 3),
    }


def registry_memory(chunks: int) -> dict:
    ks = keys(chunks, salt=7)
    reg = Registry()
    entry = reg.register("mem", 0, 1, [NS], "tcp://x:1", 1.0, None)
    gc.collect()
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    for i in range(0, chunks, BATCH):
        reg.apply(entry, [(1, k, "l1") for k in ks[i : i + BATCH]])
    apply_s = time.perf_counter() - t0
    gc.collect()
    used = psutil.Process().memory_info().rss - before
    t0 = time.perf_counter()
    snap = reg.snapshot()
    snap_s = time.perf_counter() - t0
    return {
        "chunks": chunks,
        "bytes_per_chunk": round(used / chunks, 1),
        "mib_per_million": round(used / chunks * 1e6 / 2**20, 1),
        "in_process_apply_events_per_s": round(chunks / apply_s),
        "snapshot_bytes_per_chunk": round(len(snap) / chunks, 1),
        "snapshot_s": round(snap_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.controller", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--quick", action="store_true", help="200k events, 500 lookups")
    args = parser.parse_args(argv)
    chunks = 200_000 if args.quick else 1_000_000
    lookups = 500 if args.quick else 5000
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_controller(Path(tmp))
        try:
            wire = asyncio.run(ingest_and_lookup(url, chunks, lookups))
        finally:
            proc.terminate()
            proc.wait(10)
    mem = registry_memory(chunks)
    goals = [
        {"goal": "ingest >= 200k events/s", "value": wire["ingest_events_per_s"],
         "pass": wire["ingest_events_per_s"] >= 200_000},
        {"goal": f"lookup p99 < 1 ms with {chunks:,} chunks", "value": wire["lookup_p99_ms"],
         "pass": wire["lookup_p99_ms"] < 1.0},
    ]  # fmt: skip
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "wire": wire,
        "memory": mem,
        "goals": goals,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"controller benchmark ({chunks:,} chunks, {os.cpu_count()} CPUs)")
        print(
            f"ingest: {wire['ingest_events_per_s']:,} events/s "
            f"({wire['events']:,} events in {wire['ingest_s']} s; "
            f"{wire['ingest_events_per_s'] / 200_000:.2f}x the goal)"
        )
        print(
            f"lookup (16 keys, round trip): p50 {wire['lookup_p50_ms']} ms, "
            f"p99 {wire['lookup_p99_ms']} ms over {wire['lookups']} lookups"
        )
        print(
            f"full state of {chunks:,} keys applied in {wire['full_state_s']} s; "
            f"{wire['lookups_during_full_state']} lookups meanwhile, "
            f"p99 {wire['lookup_p99_during_full_state_ms']} ms, "
            f"max {wire['lookup_max_during_full_state_ms']} ms"
        )
        print(
            f"registry: {mem['bytes_per_chunk']} B/chunk = {mem['mib_per_million']} MiB per "
            f"million chunks; in-process apply {mem['in_process_apply_events_per_s']:,} events/s; "
            f"snapshot {mem['snapshot_bytes_per_chunk']} B/chunk in {mem['snapshot_s']} s"
        )
        for g in goals:
            print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
