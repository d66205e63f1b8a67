"""common/observability/http.py: the probe server closes a connection whose request
head never completes (and an idle one) after KEEPALIVE_S, and does not inflate a
compressed request body on its event loop."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest

from kvmesh.common.observability import Metrics
from kvmesh.common.observability import http as probe_http
from kvmesh.common.observability.http import ProbeServer


async def read_until_closed(port: int, data: bytes, timeout_s: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def test_half_sent_and_idle_connections_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_http, "KEEPALIVE_S", 0.5)

    async def main() -> None:
        server = ProbeServer(Metrics(), lambda: {"status": "ok"})
        await server.start(0)
        try:
            half = b"GET /health HTTP/1.1\r\nHost: x\r\n"
            idle = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            t0 = time.monotonic()
            answers = await asyncio.gather(
                *(read_until_closed(server.port, half, 5) for _ in range(10)),
                read_until_closed(server.port, idle, 5),
            )
            assert time.monotonic() - t0 < 5
            assert answers[:-1] == [b""] * 10 and answers[-1].startswith(b"HTTP/1.1 200")
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_compressed_body_is_not_inflated() -> None:
    # 512 MiB in 0.5 MB: each MiB flushes to the same bytes (the checksum at the end
    # is then wrong, which an inflater finds only after the work).
    c = zlib.compressobj(9)
    start = c.compress(b"a") + c.flush(zlib.Z_FULL_FLUSH)
    mebibyte = c.compress(b"a" * (1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    bomb = start + mebibyte * 512 + c.flush()
    head = (
        f"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n"
        f"Content-Length: {len(bomb)}\r\nConnection: close\r\n\r\n"
    ).encode()

    async def main() -> None:
        server = ProbeServer(Metrics(), lambda: {"status": "ok"})
        await server.start(0)
        try:
            cpu0 = time.process_time()
            answer = await read_until_closed(server.port, head + bomb, 30)
            assert answer.startswith(b"HTTP/1.1 405"), answer[:200]
            assert time.process_time() - cpu0 < 0.5
        finally:
            await server.stop()

    asyncio.run(main())
