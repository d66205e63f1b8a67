"""The bridge: an OpenAI-compatible HTTP proxy for disaggregated prefill (aiohttp).

    POST /v1/completions, /v1/chat/completions   prefill on a prefiller, decode on a
                                                 decoder (proxy.py)
    GET  /v1/models      a healthy decoder's answer
    GET  /health         200 with each backend's state while a decoder answers its
                         /health, else 503
    GET  /metrics        Prometheus text (kvmesh_bridge_*)
    GET  /transfers      the requests in flight (transfers.py)

One process, one event loop, one aiohttp ClientSession (a connection pool shared by
every outgoing call, each with its own deadline). A background task checks every
backend's /health each `health_interval_s`. With `metrics_port` set, /metrics and
/health are also served on that port (for a scraper kept off the client-facing one).
With `lookup_url` set, one lookup-server client (a ZMQ DEALER on the same loop) tells
where each prompt is cached (proxy.py, prefix_lookup.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvmesh.common.config.schema import BridgeConfig
from kvmesh.common.observability import get_logger
from kvmesh.common.observability.http import start_app
from kvmesh.common.observability.http_auth import BearerAuth
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.services.bridge.backends import (
    Backend,
    BackendPool,
    describe,
    pool_trace,
    probe_all,
    read_limited,
)
from kvmesh.services.bridge.openai import error_json
from kvmesh.services.bridge.prefix_lookup import PrefixLookup
from kvmesh.services.bridge.proxy import Proxy, error_response
from kvmesh.services.bridge.stats import BridgeStats
from kvmesh.services.bridge.transfers import TransferTable

log = get_logger(__name__)

# Outgoing connections, all backends together: beyond it calls wait for a free one.
POOL_CONNECTIONS = 1024
# On stop, requests in flight get this long to finish before they are cancelled.
STOP_GRACE_S = 5.0
# A decoder's /v1/models answer is read whole: past this it is a 502 (a model list
# is kilobytes, even with many LoRA adapters).
MODELS_ANSWER_BYTES = 16 << 20


class BridgeServer:
    """Build with a config, `await start()`, then `await wait_closed()` or `stop()`."""

    def __init__(
        self, config: BridgeConfig, *, curve: CurveKeys | None = None, http_token: str = ""
    ) -> None:
        self.config = config
        self.curve = curve
        # Guards /transfers only: the OpenAI paths pass the client's own Authorization
        # through to the backends, and /metrics, /health stay open for probes.
        self.http_token = http_token
        self.stats = BridgeStats()
        self.auth = BearerAuth(http_token, self.stats.metrics, "bridge")
        self.prefillers = BackendPool(
            [
                Backend("prefiller", b.url, stats=self.stats, instance_id=b.instance_id)
                for b in config.prefillers
            ]
        )
        self.decoders = BackendPool(
            [
                Backend("decoder", d.url, d.kv_endpoints, self.stats, d.instance_id)
                for d in config.decoders
            ]
        )
        self.transfers = TransferTable()
        self.started = time.monotonic()
        self.port = 0
        self.metrics_port = 0
        self._session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        self._health_task: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self._closed = asyncio.Event()
        self.proxy: Proxy | None = None
        self.lookup: PrefixLookup | None = None

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=POOL_CONNECTIONS, limit_per_host=0),
            # Nothing is inflated: a decoder's answer goes to the client as encoded,
            # with its Content-Encoding (the decode and /v1/models calls carry the
            # client's Accept-Encoding); every other call asks for it plain.
            auto_decompress=False,
            headers={"Accept-Encoding": "identity"},
            # Tells a decode that timed out waiting for a pooled connection (proxy.py).
            trace_configs=[pool_trace()],
            # No HTTP proxy from the environment: backends are addressed directly.
            trust_env=False,
        )
        if cfg.lookup_url:
            # Connecting does not wait for the lookup-server: until it answers, requests
            # go to the least loaded backend.
            self.lookup = await PrefixLookup(cfg, self._session, self.curve).__aenter__()
        self.proxy = Proxy(
            cfg,
            self._session,
            self.prefillers,
            self.decoders,
            self.transfers,
            self.stats,
            self.lookup,
        )
        app = web.Application(client_max_size=int(cfg.max_body_bytes), middlewares=[_errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._add_probes(app)
        app.router.add_get("/transfers", self._transfers)
        self.port = await self._listen(app, cfg.port)
        if cfg.metrics_port:
            probes = web.Application(middlewares=[_errors])
            self._add_probes(probes)
            self.metrics_port = await self._listen(probes, cfg.metrics_port)
        self._health_task = asyncio.create_task(self._health_loop(), name="bridge-health")
        log.info(
            "bridge ready",
            port=self.port,
            metrics_port=self.metrics_port or None,
            prefillers=[b.url for b in self.prefillers.backends],
            decoders=[b.url for b in self.decoders.backends],
            lookup_url=cfg.lookup_url or None,
        )

    async def _listen(self, app: web.Application, port: int) -> int:
        # handler_cancellation: a lost client's handler is cancelled, which closes the
        # backend connection and so aborts the request there too. Compressed bodies
        # are not inflated (start_app); the proxy refuses them (415).
        runner, port = await start_app(
            app,
            self.config.host,
            port,
            keepalive_s=self.config.request_timeout_s,
            shutdown_s=STOP_GRACE_S,
            handler_cancellation=True,
        )
        self._runners.append(runner)
        return port

    def _add_probes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)

    async def stop(self) -> None:
        """Stop listening, let requests in flight finish (up to a grace period), then
        close the client session."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for task in (self._health_task, self._probe):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for runner in self._runners:
            await runner.cleanup()
        if self.lookup is not None:
            await self.lookup.__aexit__(None, None, None)
        if self._session is not None:
            await self._session.close()
        log.info("bridge stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # -- health -------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            try:
                # Cooldowns end on time, requests or not (the ejected gauge with them).
                self.prefillers.refresh()
                self.decoders.refresh()
                await self.refresh_health()
            except Exception:  # a bug here must not end the checks for good
                log.exception("health check failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def refresh_health(self) -> None:
        """Check every backend now; callers arriving while a check runs share it."""
        if self._probe is None or self._probe.done():
            assert self._session is not None
            backends = [*self.prefillers.backends, *self.decoders.backends]
            timeout = min(self.config.request_timeout_s, self.config.health_interval_s)
            self._probe = asyncio.create_task(probe_all(self._session, backends, timeout))
        # shield: one caller going away must not cancel the check the others wait on.
        await asyncio.shield(self._probe)

    def health_report(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.decoders.any_up() else "unavailable",
            "uptime_s": round(time.monotonic() - self.started, 3),
            "inflight": len(self.transfers),
            "decoders": [b.report() for b in self.decoders.backends],
            "prefillers": [b.report() for b in self.prefillers.backends],
            "lookup_url": self.config.lookup_url or None,
        }

    # -- handlers -----------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None
        return await self.proxy.serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None
        return await self.proxy.serve(request, "chat")

    async def _health(self, request: web.Request) -> web.Response:
        await self.refresh_health()
        report = self.health_report()
        return web.json_response(report, status=200 if report["status"] == "ok" else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.prefillers.refresh()
        self.decoders.refresh()
        return web.Response(
            body=self.stats.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _transfers(self, request: web.Request) -> web.Response:
        if not self.auth.allows(request.headers.get("Authorization")):
            return error_response(401, "missing or wrong bearer token")
        return web.Response(
            body=msgspec.json.encode(self.transfers.snapshot()), content_type="application/json"
        )

    async def _models(self, request: web.Request) -> web.Response:
        """The first decoder (healthy ones first) that answers; its answer as it is."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        headers = {h: request.headers[h] for h in ("Authorization",) if h in request.headers}
        # Passed on as encoded (the session inflates nothing): what the client reads.
        headers["Accept-Encoding"] = request.headers.get("Accept-Encoding", "identity")
        errors = []
        for decoder in self.decoders.by_preference():
            try:
                async with self._session.get(
                    decoder.url + "/v1/models", headers=headers, timeout=timeout
                ) as resp:
                    body = await read_limited(resp, MODELS_ANSWER_BYTES)
                    decoder.mark(True)
                    content_type = resp.headers.get("Content-Type", "application/json")
                    self.stats.request("models", "ok" if resp.status == 200 else "decoder_status")
                    # Asked with the client's Accept-Encoding: caches must tell them apart.
                    out = {"Content-Type": content_type, "Vary": "Accept-Encoding"}
                    encoding = resp.headers.get("Content-Encoding", "identity")
                    if encoding.strip().lower() != "identity":
                        out["Content-Encoding"] = encoding
                    return web.Response(status=resp.status, body=body, headers=out)
            except TimeoutError:
                errors.append(f"{decoder.url}: no answer in {self.config.request_timeout_s}s")
            except aiohttp.ClientError as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    decoder.mark(False, describe(exc))
                errors.append(f"{decoder.url}: {describe(exc)}")
        self.stats.request("models", "decoder_failed" if errors else "no_decoder")
        message = "no decoder answered: " + "; ".join(errors) if errors else "no decoder configured"
        return error_response(502 if errors else 503, message)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error the bridge itself answers has the OpenAI shape, unknown paths and
    its own bugs included."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.Response(
            status=exc.status,
            body=error_json(exc.status, f"{request.method} {request.path}: {exc.reason}"),
            content_type="application/json",
            headers={k: v for k, v in exc.headers.items() if k == "Allow"},
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug: answer, log, keep serving
        log.exception("handler failed", path=request.path)
        return error_response(500, f"internal error in the bridge: {describe(exc)}")
