"""Remote tier transfer speed: the cache-server against Redis and a raw TCP socket.

    python -m benchmarks.remote [--json] [--quick] [--tuned-malloc]

Starts a cache-server (`python -m kvmesh.services.cacheserver`), a redis-server and a
raw TCP echo process on loopback, then for values of 256 KiB, 2 MiB and 32 MiB
measures one request at a time, in the same run:

- **kvmesh**: the worker's `kvmesh://` connector (the cache-server's asyncio client)
  fetching over the server's data connection into a page-aligned buffer it reuses, as
  the raw socket does (`get_into`; common/protocol/cacheserver_data.py);
- **kvmesh+L1**: what the remote tier's retrieve pays: the same fetch received straight
  into an L1 buffer, then its checksum verified;
- **zmq** and **zmq+L1**: the same over ZMQ (the path before data connections, and
  the fallback): the payload arrives as ZMQ frames (one, or 8 MiB parts for larger
  values), which zmq+L1 copies into an L1 buffer while verifying;
- **redis-py**: `redis.asyncio` GET/SET against redis-server (the hiredis parser when
  installed, as the Redis connector uses it);
- **raw TCP**: a blocking socket asking another process for the same bytes (an 8-byte
  request, the payload back with `recv_into` a preallocated page-aligned buffer; put is
  the payload out and a 1-byte ack): the limit of one request over one loopback
  connection.

Puts go over ZMQ on every kvmesh path (the four kvmesh columns' puts are the same
operation, measured four times).

Every cell is GB/s (bytes / median time per request) with the p50/p99 latency.
Figures are medians of RUNS timed passes interleaved across the four paths, after a
warm-up. Also: the p99 of 16 KiB gets through the kvmesh connector and the time of an
exists for 1000 keys in one batch (measured first, on a quiet machine), and 2 MiB gets
with 8 in flight, as the engine issues them for a prefix (not a goal: the raw socket
has no such mode).

Goals: cache-server get ≥ 0.8 × raw TCP and ≥ 2 × redis-py for values ≥ 2 MiB;
16 KiB get p99 < 1 ms; exists of 1000 keys in one batch < 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import platform
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvmesh.common.chunk_codec import chunk_bytes, payload_nbytes
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.services.worker.tiers.remote_codec import (
    decode_into,
    encode,
    finish_placed,
    placement,
)
from kvmesh.services.worker.tiers.remote_kvmesh import KvmeshConnector

KiB, MiB = 1024, 1024 * 1024
SIZES = {"256KiB": 256 * KiB, "2MiB": 2 * MiB, "32MiB": 32 * MiB}
OPS = {"256KiB": 100, "2MiB": 40, "32MiB": 4}  # requests per timed pass
RUNS = 5
SMALL = 16 * KiB
SMALL_GETS = 2000
EXISTS_KEYS = 1000
EXISTS_RUNS = 50
PIPELINE_DEPTH = 8
PATHS = ("kvmesh", "kvmesh+L1", "zmq", "zmq+L1", "redis-py", "raw TCP")
GET_RATIO_RAW = 0.8
GET_RATIO_REDIS = 2.0
SMALL_P99_MS = 1.0
EXISTS_MS = 5.0
_REQ = struct.Struct("<BQ")  # op (1 get, 2 put), length
# Large values arrive in buffers libzmq mallocs per message; above glibc's mmap threshold
# each is a fresh mapping whose pages fault in on first touch. Raising the thresholds
# lets freed buffers be reused (docs/operations.md).
TUNED_MALLOC_ENV = (
    ("MALLOC_MMAP_THRESHOLD_", str(256 * 1024 * 1024)),
    ("MALLOC_TRIM_THRESHOLD_", str(1024 * 1024 * 1024)),
)


# -- the raw TCP peer (run as its own process) ------------------------------------------------


def _aligned(n: int) -> memoryview:
    """A page-aligned buffer. Where a receive buffer starts matters on some CPUs: on
    the AMD EPYC of 2026-11-26 a 2 MiB loopback receive into a bytearray (its bytes
    start 16 bytes into a page) took 1.5-1.6 ms against 0.4-0.5 ms page-aligned; the
    limit is measured with the fast layout, as the L1 pages are."""
    return memoryview(mmap.mmap(-1, n))


def raw_server(port_file: str) -> None:
    """Serve one connection: a get sends `length` bytes, a put reads them and acks."""
    srv = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(srv.getsockname()[1]))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = _aligned(max(SIZES.values()))
    data[:] = os.urandom(data.nbytes)
    sink = _aligned(max(SIZES.values()))
    head = bytearray(_REQ.size)
    while True:
        if conn.recv_into(head, _REQ.size, socket.MSG_WAITALL) != _REQ.size:
            return
        op, n = _REQ.unpack(head)
        if op == 1:
            conn.sendall(data[:n])
        else:
            got = 0
            while got < n:
                got += conn.recv_into(sink[got:n])
            conn.sendall(b"k")


class RawClient:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = _aligned(max(SIZES.values()))

    def get(self, n: int) -> None:
        self.sock.sendall(_REQ.pack(1, n))
        got = 0
        while got < n:
            got += self.sock.recv_into(self.buf[got:n])

    def put(self, payload: memoryview) -> None:
        self.sock.sendall(_REQ.pack(2, len(payload)))
        self.sock.sendall(payload)
        self.sock.recv(1)


# -- processes --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start")
        time.sleep(0.02)


class Processes:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def start(self) -> dict[str, int]:
        ready = self.workdir / "cs.json"
        cs = [
            sys.executable, "-m", "kvmesh.services.cacheserver", "--port", "0",
            "--max-memory", "2GiB", "--max-value-size", "64MiB", "--ready-file", str(ready),
        ]  # fmt: skip
        env = {**os.environ, "KVMESH_LOGGING__LEVEL": "warning"}
        self.procs.append(subprocess.Popen(cs, env=env, stderr=subprocess.DEVNULL))
        redis_port = _free_port()
        redis = shutil.which("redis-server")
        if redis is None:
            raise SystemExit("redis-server is not installed (scripts/setup.sh installs it)")
        redis_cmd = [
            redis, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir),
        ]  # fmt: skip
        self.procs.append(subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL))
        raw_file = self.workdir / "raw.port"
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.remote", "--raw-server", str(raw_file)]
            )
        )
        _wait(ready.exists, "cache-server")
        _wait(raw_file.exists, "raw TCP peer")
        _wait(lambda: _connects(redis_port), "redis-server")
        return {
            "cacheserver": json.loads(ready.read_text())["port"],
            "redis": redis_port,
            "raw": int(raw_file.read_text()),
        }

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


# -- measurement ------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Bench:
    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.pool = HostMemoryPool(256 * MiB, 32 * MiB, pin_memory=False)
        # An engine's L1 pages are touched once warm; an untouched page would charge a
        # receive its first-touch faults (~1.5 ms per 2 MiB here).
        self.pool.buffer.fill_(0)
        self.key = ChunkKey("0123456789abcdef", bytes(16))

    async def setup(self) -> None:
        import redis.asyncio as aioredis

        self.kv = KvmeshConnector(f"kvmesh://127.0.0.1:{self.ports['cacheserver']}", timeout_s=30.0)
        await self.kv.reconnect()
        self.redis = aioredis.Redis(port=self.ports["redis"], socket_timeout=30)
        await self.redis.ping()
        self.raw = RawClient(self.ports["raw"])
        self.objs: dict[str, Any] = {}
        for name, n in SIZES.items():
            obj = self.pool.allocate(torch.Size([n // 2]), torch.float16, MemoryFormat.BINARY)
            obj.raw.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))  # touch it
            self.objs[name] = obj
        # What the kvmesh column receives into, reused as the raw socket's buffer is.
        self.sinks = {
            name: self.pool.allocate(o.shape, o.dtype, o.fmt) for name, o in self.objs.items()
        }

    async def put(self, path: str, name: str) -> float:
        obj = self.objs[name]
        key = ChunkKey(self.key.namespace_id, name.encode().ljust(16, b"\0"))
        t0 = time.perf_counter()
        if path in ("kvmesh", "kvmesh+L1", "zmq", "zmq+L1"):  # puts always go over ZMQ
            header, packed, payload = encode(key, obj)
            await self.kv.put(key, header, packed, payload)
        elif path == "redis-py":
            header, packed, payload = encode(key, obj)
            await self.redis.set(f"bench:{name}", b"".join((packed, payload)))
        else:
            self.raw.put(memoryview(obj.raw.numpy()))
        return time.perf_counter() - t0

    async def get(self, path: str, name: str) -> float:
        key = ChunkKey(self.key.namespace_id, name.encode().ljust(16, b"\0"))
        t0 = time.perf_counter()
        if path == "kvmesh":
            sink = chunk_bytes(self.sinks[name])
            fetched = await self.kv.get_into(key, lambda header, n: sink)
            assert fetched is not None and payload_nbytes(fetched.payload) == SIZES[name]
        elif path == "kvmesh+L1":
            placed: list = []
            fetched = await self.kv.get_into(key, placement(key, self.pool, placed))
            assert fetched is not None and placed
            finish_placed(key, fetched.header, placed[0]).ref_down()
        elif path == "zmq":
            fetched = await self.kv.get(key)
            assert fetched is not None and payload_nbytes(fetched.payload) == SIZES[name]
        elif path == "zmq+L1":
            fetched = await self.kv.get(key)
            assert fetched is not None
            obj = decode_into(key, fetched.header, fetched.payload, self.pool)
            assert obj is not None
            obj.ref_down()
        elif path == "redis-py":
            data = await self.redis.get(f"bench:{name}")
            assert data is not None and len(data) > SIZES[name]
        else:
            self.raw.get(SIZES[name])
        return time.perf_counter() - t0

    async def measure(self, runs: int, scale: float) -> list[dict[str, Any]]:
        samples: dict[tuple[str, str, str], list[float]] = {}
        for name in SIZES:  # warm-up, and the values gets will read
            for path in PATHS:
                await self.put(path, name)
                await self.get(path, name)
        for name in SIZES:  # one size at a time; the paths interleaved within each pass
            ops = max(2, int(OPS[name] * scale))
            for _ in range(runs):
                for path in PATHS:
                    for op in ("put", "get"):
                        fn = self.put if op == "put" else self.get
                        for _ in range(ops):
                            samples.setdefault((path, name, op), []).append(await fn(path, name))
        rows = []
        for (path, name, op), times in samples.items():
            p50 = statistics.median(times)
            rows.append(
                {
                    "path": path,
                    "size": name,
                    "op": op,
                    "gb_s": SIZES[name] / p50 / 1e9,
                    "p50_ms": p50 * 1e3,
                    "p99_ms": _pct(times, 0.99) * 1e3,
                    "n": len(times),
                }
            )
        return rows

    async def small_gets(self, n: int) -> dict[str, float]:
        obj = self.pool.allocate(torch.Size([SMALL // 2]), torch.float16, MemoryFormat.BINARY)
        key = ChunkKey(self.key.namespace_id, b"small".ljust(16, b"\0"))
        header, packed, payload = encode(key, obj)
        await self.kv.put(key, header, packed, payload)
        obj.ref_down()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await self.kv.get_into(key, lambda header, n: None)
            times.append(time.perf_counter() - t0)
        times = times[n // 10 :]  # drop the warm-up
        return {"p50_ms": _pct(times, 0.5) * 1e3, "p99_ms": _pct(times, 0.99) * 1e3}

    async def exists(self, runs: int) -> dict[str, float]:
        keys = [
            ChunkKey(self.key.namespace_id, i.to_bytes(16, "little")) for i in range(EXISTS_KEYS)
        ]
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            found = await self.kv.exists(keys)
            times.append(time.perf_counter() - t0)
            assert len(found) == EXISTS_KEYS
        times = times[2:]
        return {"p50_ms": _pct(times, 0.5) * 1e3, "p99_ms": _pct(times, 0.99) * 1e3}

    async def pipelined(self, name: str, depth: int, rounds: int) -> float:
        """GB/s of `depth` concurrent gets of one value through the kvmesh connector, as
        a retrieve issues them (one get per chunk of the prefix, all in flight)."""
        key = ChunkKey(self.key.namespace_id, name.encode().ljust(16, b"\0"))

        async def one() -> None:
            placed: list = []
            fetched = await self.kv.get_into(key, placement(key, self.pool, placed))
            assert fetched is not None and placed
            finish_placed(key, fetched.header, placed[0]).ref_down()

        await asyncio.gather(*(one() for _ in range(depth)))  # warm-up
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(depth)))
            times.append(time.perf_counter() - t0)
        return depth * SIZES[name] / statistics.median(times) / 1e9

    async def close(self) -> None:
        await self.kv.close()
        await self.redis.aclose()
        for obj in self.objs.values():
            obj.ref_down()
        self.pool.close()


def goals(rows: list[dict[str, Any]], small: dict, exists: dict) -> list[dict[str, Any]]:
    rate = {(r["path"], r["size"], r["op"]): r["gb_s"] for r in rows}
    out = []
    for name in ("2MiB", "32MiB"):
        kv, raw, red = (rate[(p, name, "get")] for p in ("kvmesh", "raw TCP", "redis-py"))
        out.append(
            {
                "goal": f"cache-server get >= {GET_RATIO_RAW} x raw TCP ({name})",
                "value": round(kv / raw, 2),
                "pass": kv / raw >= GET_RATIO_RAW,
            }
        )
        out.append(
            {
                "goal": f"cache-server get >= {GET_RATIO_REDIS} x redis-py ({name})",
                "value": round(kv / red, 2),
                "pass": kv / red >= GET_RATIO_REDIS,
            }
        )
    out.append(
        {
            "goal": f"16 KiB get p99 < {SMALL_P99_MS} ms",
            "value": round(small["p99_ms"], 3),
            "pass": small["p99_ms"] < SMALL_P99_MS,
        }
    )
    out.append(
        {
            "goal": f"exists of {EXISTS_KEYS} keys in one batch < {EXISTS_MS} ms (p50)",
            "value": round(exists["p50_ms"], 3),
            "pass": exists["p50_ms"] < EXISTS_MS,
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
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python"
    import redis
    import zmq

    return {
        "malloc": "tuned" if TUNED_MALLOC_ENV[0][0] in os.environ else "default",
        "python": platform.python_version(),
        "cpu": cpu,
        "redis_py": f"{redis.__version__} ({parser} parser)",
        "pyzmq": f"{zmq.__version__} (libzmq {zmq.zmq_version()})",
    }


def print_table(rows: list[dict[str, Any]], small: dict, exists: dict, results: list) -> None:
    env = environment()
    print(
        f"# python {env['python']}, {env['cpu']}; redis-py {env['redis_py']}; pyzmq {env['pyzmq']}"
    )
    print(f"# glibc malloc thresholds: {env['malloc']} (--tuned-malloc raises them)")
    print("# one request at a time; GB/s from the median; p50/p99 in ms")
    print(f"{'size':<7} {'op':<4}" + "".join(f" {p:>22}" for p in PATHS))
    cell = {(r["path"], r["size"], r["op"]): r for r in rows}
    for name in SIZES:
        for op in ("get", "put"):
            line = f"{name:<7} {op:<4}"
            for p in PATHS:
                r = cell[(p, name, op)]
                line += f" {r['gb_s']:>5.2f} ({r['p50_ms']:>6.2f}/{r['p99_ms']:>5.1f})"
            print(line)
    print(f"16 KiB get via kvmesh: p50 {small['p50_ms']:.3f} ms, p99 {small['p99_ms']:.3f} ms")
    print(
        f"2 MiB gets via kvmesh, {PIPELINE_DEPTH} in flight (as a retrieve issues them): "
        f"{small['pipelined_2MiB_gb_s']:.2f} GB/s"
    )
    print(
        f"exists x{EXISTS_KEYS} in one batch: p50 {exists['p50_ms']:.3f} ms, "
        f"p99 {exists['p99_ms']:.3f} ms"
    )
    for g in results:
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")


async def run(quick: bool) -> tuple[list, dict, dict]:
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-remote-"))
    procs = Processes(workdir)
    try:
        bench = Bench(procs.start())
        await bench.setup()
        try:
            # Latency first, on a quiet machine; then the bulk transfers.
            small = await bench.small_gets(SMALL_GETS // (4 if quick else 1))
            exists = await bench.exists(EXISTS_RUNS // (5 if quick else 1))
            rows = await bench.measure(2 if quick else RUNS, 0.3 if quick else 1.0)
            small["pipelined_2MiB_gb_s"] = await bench.pipelined(
                "2MiB", PIPELINE_DEPTH, 5 if quick else 20
            )
        finally:
            await bench.close()
        return rows, small, exists
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remote", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (a smoke test)")
    parser.add_argument(
        "--tuned-malloc",
        action="store_true",
        help="rerun with glibc's mmap/trim thresholds raised (see docs/operations.md)",
    )
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        raw_server(args.raw_server)
        return 0
    if args.tuned_malloc and TUNED_MALLOC_ENV[0][0] not in os.environ:
        env = {**os.environ, **dict(TUNED_MALLOC_ENV)}
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--tuned-malloc"]
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.remote", *rest], env=env
        ).returncode
    rows, small, exists = asyncio.run(run(args.quick))
    results = goals(rows, small, exists)
    if args.json:
        out = {"env": environment(), "rows": rows, "small_get": small, "exists": exists}
        print(json.dumps({**out, "goals": results}, indent=2))
    else:
        print_table(rows, small, exists, results)
    return 0 if all(g["pass"] for g in results) else 1


if __name__ == "__main__":
    sys.exit(main())
