"""Many clients at once against the lookup-server and the cache-server, with answers checked.

    python -m benchmarks.load [--seconds 60] [--clients 200] [--json]

Starts the services' real processes on loopback (`python -m kvmesh.services.<name>`): a
controller, a lookup-server following it, and a cache-server. Preloads:

- the cache-server with VALUES values of 16 KiB (`load:<i>`);
- the controller with INSTANCES fake workers (one rank each) holding PROMPTS prompts of
  CHUNKS chunks, one instance per prompt, through the workers' own protocol (Register,
  KVEventBatch); they heartbeat through the run so the controller keeps them.

Then `--clients` asyncio clients, each with its own connection to each service, loop
for `--seconds`: a `BestInstances` lookup of a random prompt (a miss one time in eight)
and a get of a random key (a miss one time in eight). Every answer is checked: the
prompt's instance first with all its tokens (none for a miss), the value's bytes (None
for a miss). A timeout, an error reply or a wrong answer is an error.

Prints ops/s, errors and p50/p99/max per op; exits 1 on any error (goal, issue 10:
200 clients for 60 s with no error, p99 reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.common.protocol import controller as cproto
from kvmesh.common.transport.cacheserver_client import CacheServerClient
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.common.transport.lookup_service_client import LookupServiceClient

NS = "0123456789abcdef"
CHUNK_SIZE = 256  # the lookup-server's default: hit_tokens = chunks * CHUNK_SIZE
INSTANCES = 4
PROMPTS = 200
CHUNKS = 16
VALUES = 2000
VALUE_BYTES = 16 * 1024
MISS_EVERY = 8
REQUEST_TIMEOUT_S = 5.0
OPS = ("lookup", "get")


# -- processes ----------------------------------------------------------------------------


def start_service(module: str, workdir: Path, args: Sequence[str]) -> tuple[subprocess.Popen, dict]:
    """`python -m kvmesh.services.<module> --port 0 ARGS`, once it wrote its ready file."""
    ready = workdir / f"{module}.ready.json"
    env = {**os.environ, "KVMESH_LOGGING__LEVEL": "warning", "KVMESH_LOGGING__JSON": "false"}
    cmd = [sys.executable, "-m", f"kvmesh.services.{module}", "--port", "0"]
    cmd += ["--ready-file", str(ready), *args]
    log = open(workdir / f"{module}.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = (workdir / f"{module}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{module} did not start:\n{tail}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


# -- data ---------------------------------------------------------------------------------


def prompt_hashes(i: int) -> list[bytes]:
    """Chunk hashes of prompt i (i >= PROMPTS: a prompt nobody holds)."""
    return [(i * 1_000_003 + c + 1).to_bytes(16, "big") for c in range(CHUNKS)]


def owner(i: int) -> str:
    return f"inst-{i % INSTANCES}"


def value(i: int) -> bytes:
    return i.to_bytes(8, "big") * (VALUE_BYTES // 8)


async def register_workers(url: str) -> list[tuple[ControllerConnection, str, int]]:
    """One connection per fake worker, registered and holding its prompts' chunks."""
    workers = []
    for n in range(INSTANCES):
        conn = ControllerConnection(url, timeout_s=REQUEST_TIMEOUT_S, client="load")
        await conn.connect()
        inst = f"inst-{n}"
        reg = await conn.request(
            cproto.Register(conn.next_rid(), inst, 0, 1, [NS], "", 60.0), cproto.RegisterReply
        )
        events = [
            (1, f"{NS}-{h.hex()}", "l1")
            for i in range(PROMPTS)
            if owner(i) == inst
            for h in prompt_hashes(i)
        ]
        conn.send(cproto.KVEventBatch(0, reg.worker_id, 1, events))
        await conn.request(
            cproto.Heartbeat(conn.next_rid(), reg.worker_id, 1), cproto.HeartbeatReply
        )
        workers.append((conn, reg.worker_id, 1))
    return workers


async def heartbeat(workers: list[tuple[ControllerConnection, str, int]]) -> None:
    while True:
        await asyncio.sleep(5.0)
        for conn, wid, seq in workers:
            await conn.request(cproto.Heartbeat(conn.next_rid(), wid, seq), cproto.HeartbeatReply)


# -- the clients --------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {op: [] for op in OPS}
        self.errors: dict[str, int] = dict.fromkeys(OPS, 0)
        self.first_errors: list[str] = []

    def error(self, op: str, what: str) -> None:
        self.errors[op] += 1
        if len(self.first_errors) < 10:
            self.first_errors.append(f"{op}: {what}"[:300])


class Go:
    """The start line: clients count themselves connected, then wait for the clock."""

    def __init__(self) -> None:
        self.connected = 0
        self.until = 0.0
        self.event = asyncio.Event()

    def start(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds
        self.event.set()


async def one_client(n: int, lookup_url: str, cache_url: str, tally: Tally, go: Go) -> None:
    rng = random.Random(n)
    cache = CacheServerClient(cache_url, timeout_s=REQUEST_TIMEOUT_S, name=f"load-{n}")
    await cache.connect()
    try:
        async with LookupServiceClient(lookup_url, timeout_s=REQUEST_TIMEOUT_S, name="load") as lk:
            await lk.hello()
            go.connected += 1
            await go.event.wait()
            while time.monotonic() < go.until:
                await _lookup(lk, rng, tally)
                await _get(cache, rng, tally)
    finally:
        await cache.close()


async def _lookup(lk: LookupServiceClient, rng: random.Random, tally: Tally) -> None:
    miss = rng.randrange(MISS_EVERY) == 0
    i = PROMPTS + rng.randrange(PROMPTS) if miss else rng.randrange(PROMPTS)
    t0 = time.perf_counter()
    try:
        hits = await lk.best_instances(hashes=prompt_hashes(i))
    except Exception as exc:  # every failure is counted, whatever its kind
        tally.error("lookup", f"{type(exc).__name__}: {exc}")
        return
    tally.lat["lookup"].append(time.perf_counter() - t0)
    top = [(h.instance_id, h.hit_tokens) for h in hits if h.hit_tokens]
    want = [] if miss else [(owner(i), CHUNKS * CHUNK_SIZE)]
    if top[:1] != want:
        tally.error("lookup", f"prompt {i}: got {top[:2]}, want {want}")


async def _get(cache: CacheServerClient, rng: random.Random, tally: Tally) -> None:
    miss = rng.randrange(MISS_EVERY) == 0
    i = rng.randrange(VALUES)
    key = f"absent:{i}" if miss else f"load:{i}"
    t0 = time.perf_counter()
    try:
        got = await cache.get(key)
    except Exception as exc:  # every failure is counted, whatever its kind
        tally.error("get", f"{type(exc).__name__}: {exc}")
        return
    tally.lat["get"].append(time.perf_counter() - t0)
    if miss:
        if got is not None:
            tally.error("get", f"{key}: a value for an absent key")
    elif got is None or bytes(got.data) != value(i):
        tally.error("get", f"{key}: {'missing' if got is None else 'wrong bytes'}")


async def preload(cache_url: str) -> None:
    cache = CacheServerClient(cache_url, timeout_s=30.0, name="load-preload")
    await cache.connect()
    try:
        for start in range(0, VALUES, 100):
            items = [(f"load:{i}", value(i), b"") for i in range(start, min(start + 100, VALUES))]
            errors = await cache.put_many(items)
            if any(errors):
                raise RuntimeError(f"preload refused: error codes {sorted(set(errors))}")
    finally:
        await cache.close()


async def wait_indexed(lookup_url: str) -> None:
    """Until the lookup-server answers for the last prompt (its copy of the registry
    has caught up with the preload)."""
    async with LookupServiceClient(lookup_url, timeout_s=REQUEST_TIMEOUT_S, name="load") as lk:
        deadline = time.monotonic() + 30
        while True:
            hits = await lk.best_instances(hashes=prompt_hashes(PROMPTS - 1))
            if hits and hits[0].hit_tokens == CHUNKS * CHUNK_SIZE:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the lookup-server never saw the preload: {hits}")
            await asyncio.sleep(0.1)


def _pct_ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 3)


async def run(urls: dict[str, str], clients: int, seconds: float) -> dict[str, Any]:
    workers = await register_workers(urls["controller"])
    beats = asyncio.create_task(heartbeat(workers))
    try:
        await preload(urls["cacheserver"])
        await wait_indexed(urls["lookup"])
        tally, go = Tally(), Go()
        tasks = [
            asyncio.create_task(one_client(n, urls["lookup"], urls["cacheserver"], tally, go))
            for n in range(clients)
        ]
        # Connecting 200 clients is not load: the clock starts once every one is.
        async with asyncio.timeout(60):
            while go.connected < clients:
                done = [t for t in tasks if t.done()]
                if done:
                    await done[0]  # a client that failed to connect: say why
                await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        go.start(seconds)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        beats.cancel()
        for conn, _, _ in workers:
            await conn.close()
    if beats.done() and not beats.cancelled() and beats.exception() is not None:
        raise RuntimeError(f"heartbeats failed: {beats.exception()}")
    ops = {}
    for op in OPS:
        lat = tally.lat[op]
        ops[op] = {
            "ops": len(lat),
            "ops_per_s": round(len(lat) / wall),
            "errors": tally.errors[op],
            "p50_ms": _pct_ms(lat, 0.50),
            "p99_ms": _pct_ms(lat, 0.99),
            "max_ms": _pct_ms(lat, 1.0),
        }
    return {
        "clients": clients,
        "seconds": round(wall, 1),
        "ops": ops,
        "errors": sum(tally.errors.values()),
        "first_errors": tally.first_errors,
    }


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['clients']} clients for {result['seconds']} s ({environment()})")
    print(
        f"{'op':<8}{'ops':>10}{'ops/s':>10}{'errors':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"
    )
    for op, r in result["ops"].items():
        print(
            f"{op:<8}{r['ops']:>10}{r['ops_per_s']:>10}{r['errors']:>8}"
            f"{r['p50_ms']:>10}{r['p99_ms']:>10}{r['max_ms']:>10}"
        )
    for line in result["first_errors"]:
        print(f"error: {line}")
    print("PASS: no error" if result["errors"] == 0 else f"FAIL: {result['errors']} errors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="load duration")
    parser.add_argument("--clients", type=int, default=200, help="concurrent clients")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvmesh-load-") as tmp:
        workdir = Path(tmp)
        procs: list[subprocess.Popen] = []
        try:
            ctl, info = start_service("controller", workdir, [])
            procs.append(ctl)
            controller_url = f"tcp://127.0.0.1:{info['port']}"
            cs, info = start_service(
                "cacheserver", workdir, ["--max-memory", "1GiB", "--max-value-size", "1MiB"]
            )
            procs.append(cs)
            cache_url = f"tcp://127.0.0.1:{info['port']}"
            lk, info = start_service(
                "lookup", workdir, ["--controller-url", controller_url, "--chunk-size", "256"]
            )
            procs.append(lk)
            urls = {
                "controller": controller_url,
                "cacheserver": cache_url,
                "lookup": f"tcp://127.0.0.1:{info['port']}",
            }
            result = asyncio.run(run(urls, args.clients, args.seconds))
            dead = [p.args[2] for p in procs if p.poll() is not None]
            if dead:
                result["errors"] += len(dead)
                result["first_errors"].append(f"services exited during the run: {dead}")
        finally:
            stop(procs)
    result["environment"] = environment()
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
