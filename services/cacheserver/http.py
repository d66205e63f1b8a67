"""A minimal HTTP endpoint on the server's event loop: `/metrics` and `/healthz`.

`/metrics` is the Prometheus text format; `/healthz` (also `/health`) answers 200 with
a JSON summary while the server runs. Requests are one GET per connection
(`Connection: close`); anything else gets 404 or 405. Kept to the standard library
so probes work without any web framework.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from kvmesh.common.observability import Metrics

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0


class HttpEndpoint:
    def __init__(self, metrics: Metrics, health: Callable[[], dict[str, Any]], host: str) -> None:
        self.metrics = metrics
        self.health = health
        self.host = host
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        parts = head[:MAX_REQUEST_BYTES].split(b"\r\n", 1)[0].split()
        method, path = (parts[0], parts[1].split(b"?", 1)[0]) if len(parts) >= 2 else (b"", b"")
        if method not in (b"GET", b"HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
        elif path == b"/metrics":
            status, ctype = "200 OK", "text/plain; version=0.0.4; charset=utf-8"
            body = self.metrics.render()
        elif path in (b"/healthz", b"/health"):
            status, ctype = "200 OK", "application/json"
            body = json.dumps(self.health()).encode() + b"\n"
        else:
            status, ctype, body = "404 Not Found", "text/plain", b"try /metrics or /healthz\n"
        head_out = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.write(head_out if method == b"HEAD" else head_out + body)
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()
