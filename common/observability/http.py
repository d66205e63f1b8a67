"""One small HTTP endpoint for a service's probes, on the service's own event loop:

GET /metrics            the Prometheus text format of the service's `Metrics`
GET /health, /healthz   200 and a JSON summary (the service's `health()`) while it serves

HEAD works on each; any other method gets 405, any other path 404. aiohttp parses
HTTP (keep-alive, pipelining, size limits), so no service carries an HTTP parser of
its own; a slow client cannot hold the loop, aiohttp reads with its own timeouts (an
idle or half-sent connection is closed after KEEPALIVE_S).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvmesh.common.observability.metrics import Metrics
from kvmesh.common.transport.tcp_address import every_address_socket

PROMETHEUS_TYPE = "text/plain; version=0.0.4"
HEALTH_PATHS = ("/health", "/healthz")
SHUTDOWN_S = 1.0
# Closes an idle connection, and one whose request head never completes (aiohttp's
# default is an hour: enough such connections would use up the descriptors).
KEEPALIVE_S = 5.0


class ClientErrorLogger(logging.LoggerAdapter):
    """aiohttp's server logger without a traceback for a request it could not parse.

    aiohttp logs every unparseable request (no Host header, a bad header line, a body
    over the limit...) with a full traceback at ERROR: a port scanner or a broken
    client would fill the log with them and bury the real errors. Those are the
    client's fault and already answered (4xx), so they go at debug on one line; any
    other exception (a bug in a handler) keeps its traceback. Pass an instance as
    `logger=` to web.AppRunner."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.debug("%s: %s %s", msg % args, exc_info.code, exc_info.message)
            return
        super().exception(msg, *args, exc_info=exc_info, **kw)


async def start_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    keepalive_s: float,
    shutdown_s: float,
    handler_cancellation: bool = False,
) -> tuple[web.AppRunner, int]:
    """Serve app on host:port (0: any free port); the runner (`cleanup()` stops it) and
    the port. What every kvmesh HTTP server shares: no access log, unparseable requests
    logged on one line, bodies never inflated (a small compressed body could cost the
    loop seconds), and idle or half-sent connections closed after keepalive_s."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=shutdown_s,
        logger=ClientErrorLogger(),
        keepalive_timeout=keepalive_s,
        auto_decompress=False,
        handler_cancellation=handler_cancellation,
    )
    await runner.setup()
    try:
        sock = every_address_socket(host, port)
        site: web.BaseSite = (
            web.TCPSite(runner, host, port, reuse_address=True)
            if sock is None
            else web.SockSite(runner, sock)
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


class ProbeServer:
    """`/metrics` and `/health` on host:port; build, `await start(port)`, `await stop()`."""

    def __init__(
        self, metrics: Metrics, health: Callable[[], dict[str, Any]], host: str = "127.0.0.1"
    ) -> None:
        self.metrics = metrics
        self.health = health
        self.host = host
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, port: int) -> None:
        """Listen on port (0: any free one, then in `port`)."""
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner, self.port = await start_app(
            app, self.host, port, keepalive_s=KEEPALIVE_S, shutdown_s=SHUTDOWN_S
        )

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="GET only\n", headers={"Allow": "GET, HEAD"})
        if request.path == "/metrics":
            body = self.metrics.render()
            return web.Response(body=body, content_type=PROMETHEUS_TYPE, charset="utf-8")
        if request.path in HEALTH_PATHS:
            return web.json_response(self.health())
        return web.Response(status=404, text="try /metrics or /health\n")
