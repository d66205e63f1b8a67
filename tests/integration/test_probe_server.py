"""common/observability/http.py: the probe server every service shares answers
/metrics, /health and /healthz (GET and HEAD), 405 for other methods, 404 elsewhere,
and frees its port on stop."""

from __future__ import annotations

import asyncio
import socket

import aiohttp

from kvmesh.common.observability import Metrics
from kvmesh.common.observability.http import ProbeServer


def test_probe_server_paths_methods_and_stop() -> None:
    async def main() -> None:
        metrics = Metrics({"service": "t"})
        metrics.counter("probe_test_total", "A counter").inc(3)
        server = ProbeServer(metrics, lambda: {"status": "ok", "n": 1})
        await server.start(0)
        base = f"http://127.0.0.1:{server.port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{base}/metrics") as r:
                    text = await r.text()
                    assert r.status == 200 and r.content_type == "text/plain"
                    assert 'kvmesh_probe_test_total{service="t"} 3.0' in text
                for path in ("/health", "/healthz"):
                    async with s.get(base + path) as r:
                        assert r.status == 200 and await r.json() == {"status": "ok", "n": 1}
                async with s.head(f"{base}/health") as r:
                    assert r.status == 200
                async with s.post(f"{base}/metrics", data=b"x") as r:
                    assert r.status == 405
                async with s.get(f"{base}/nope") as r:
                    assert r.status == 404
        finally:
            await server.stop()
        with socket.socket() as sock:  # the port is free again
            sock.bind(("127.0.0.1", server.port))

    asyncio.run(main())


def test_unparseable_requests_are_answered_and_logged_without_a_traceback(caplog) -> None:
    """aiohttp logs a request it cannot parse with a traceback at ERROR: one per port
    scan or broken client, burying real errors. They are answered 400 and logged at
    debug on one line (found by tests/fuzz)."""

    async def raw(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return answer

    async def main() -> None:
        server = ProbeServer(Metrics(), lambda: {"status": "ok"})
        await server.start(0)
        try:
            for bad in (
                b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",  # no Host
                b"GET /health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",
                b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
            ):
                assert (await raw(server.port, bad)).split(b" ", 2)[1] == b"400", bad
            ok = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            assert (await raw(server.port, ok)).startswith(b"HTTP/1.1 200")
        finally:
            await server.stop()

    with caplog.at_level("DEBUG", logger="aiohttp.server"):
        asyncio.run(main())
    served = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(served) == 3 and all(r.levelname == "DEBUG" for r in served), served
    assert not any(r.exc_info for r in served)
