"""The controller's HTTP JSON admin API, for orchestrators, beside the ZMQ one.

GET  /health            the controller's own health (200 while it serves)
GET  /metrics           Prometheus text
GET  /instances         {instance id: [worker, ...]}
GET  /workers           [worker, ...]
GET  /events/<id>       the result of an earlier admin command (CheckFinish)
POST /clear             {"instance_id"?, "tier"?, "event_id"?}  → per-worker results
POST /pin               {"keys": [...], "instance_id"?, "unpin"?, "event_id"?}
POST /health            {"instance_id"?, "event_id"?}  → each worker's health
POST /copy              {"src_instance", "dst_instance", "keys"?, "timeout_s"?, "event_id"?}
POST /move              the same; the source loses what the destination confirmed
POST /compress          {"method"?, "tier"?, "keys"?, "instance_id"?, "timeout_s"?, "event_id"?}

Served by aiohttp (as the probe endpoints, common/observability/http.py): it parses
HTTP, chunked bodies included, so a body is never misread as empty, which for /clear
would mean every instance. Bodies up to MAX_BODY_BYTES, read within READ_TIMEOUT_S;
an answer must be taken by the client within WRITE_TIMEOUT_S (plus its transfer time
at a slow rate) or the connection is cut, so a client that never reads holds nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvmesh.common.observability.http import start_app
from kvmesh.common.observability.http_auth import BearerAuth, needs_token
from kvmesh.common.protocol import controller as proto

if TYPE_CHECKING:
    from kvmesh.services.controller.server import ControllerServer

MAX_BODY_BYTES = 1 << 20
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 5.0
WRITE_MIN_RATE = 1 << 20  # bytes/s a client must at least take an answer at
KEEPALIVE_S = 5.0
SHUTDOWN_S = 1.0
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _BadRequest(Exception):
    pass


class AdminHttp:
    def __init__(self, server: ControllerServer, host: str, token: str = "") -> None:
        self.server = server
        self.host = host
        self.token = token
        self.auth = BearerAuth(token, server.stats.metrics, "controller")
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, port: int) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner, self.port = await start_app(
            app, self.host, port, keepalive_s=KEEPALIVE_S, shutdown_s=SHUTDOWN_S
        )

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        method, path = request.method, request.path
        if needs_token(method, path) and not self.auth.allows(request.headers.get("Authorization")):
            return await _respond(request, 401, {"error": "missing or wrong bearer token"})
        if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
            return await _respond(request, 415, {"error": "Content-Encoding: identity only"})
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                body = await request.read()
        except TimeoutError:
            return await _respond(request, 408, {"error": "body not sent in time"})
        except ConnectionResetError:
            # The client hung up mid-body: nobody to answer, and not our error (aiohttp
            # would log it with a traceback).
            return web.Response(status=400)
        except web.HTTPRequestEntityTooLarge:
            return await _respond(request, 400, {"error": f"body over {MAX_BODY_BYTES} bytes"})
        try:
            status, payload = await self._route(method, path, body)
        except _BadRequest as exc:
            status, payload = 400, {"error": str(exc)}
        return await _respond(request, status, payload)

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        srv = self.server
        if method in ("GET", "HEAD"):  # aiohttp sends no body with a HEAD answer
            if path in ("/health", "/healthz"):
                return 200, srv.health_report()
            if path == "/metrics":
                return 200, srv.stats.metrics.render()
            if path == "/workers":
                return 200, [_info(w) for w in srv.handlers.worker_infos()]
            if path == "/instances":
                out: dict[str, list[dict[str, Any]]] = {}
                for w in srv.handlers.worker_infos():
                    out.setdefault(w.instance_id, []).append(_info(w))
                return 200, out
            if path.startswith("/events/"):
                known = srv.fanout.events.get(path.removeprefix("/events/"))
                if known is None:
                    return 404, {"error": "unknown event id"}
                return 200, {"done": known[0], "results": [_result(r) for r in known[1]]}
            return 404, {"error": "not found"}
        if method != "POST":
            return 405, {"error": "GET or POST"}
        args = _json_object(body)
        event_id = str(args.get("event_id") or uuid.uuid4().hex)
        instance = str(args.get("instance_id") or "")
        msg: Any
        if path == "/clear":
            msg = proto.Clear(0, event_id, instance, str(args.get("tier") or ""))
        elif path == "/pin":
            keys = _keys(args, required=True)
            msg = proto.Pin(0, event_id, keys, instance, bool(args.get("unpin", False)))
        elif path == "/health":
            msg = proto.Health(0, event_id, instance)
        elif path in ("/copy", "/move"):
            msg = _move(args, event_id, copy=path == "/copy")
        elif path == "/compress":
            msg = proto.Compress(
                0,
                event_id,
                instance,
                str(args.get("method") or "zstd"),
                str(args.get("tier") or "disk"),
                _keys(args, required=False),
                _seconds(args),
            )
        else:
            return 404, {"error": "not found"}
        reply = await srv.handlers.async_table[type(msg)](b"", msg)
        if isinstance(reply, proto.ErrorReply):
            return 400, {"error": reply.message, "code": reply.code}
        return 200, {"event_id": event_id, "results": [_result(r) for r in reply.results]}


def _keys(args: dict[str, Any], *, required: bool) -> list[str]:
    keys = args.get("keys", None if required else [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _BadRequest("keys: a list of chunk key strings")
    return keys


def _move(args: dict[str, Any], event_id: str, *, copy: bool) -> proto.Move:
    src, dst = args.get("src_instance"), args.get("dst_instance")
    if not isinstance(src, str) or not isinstance(dst, str) or not src or not dst:
        raise _BadRequest("src_instance and dst_instance: instance ids")
    keys = _keys(args, required=False)
    return proto.Move(0, event_id, keys, src, dst, copy, _seconds(args))


def _seconds(args: dict[str, Any]) -> float:
    timeout_s = args.get("timeout_s", 0.0)
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool):
        raise _BadRequest("timeout_s: seconds")
    return float(timeout_s)


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise _BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _BadRequest("body must be a JSON object")
    return obj


def _info(w: proto.WorkerInfo) -> dict[str, Any]:
    return msgspec.structs.asdict(w)


def _result(r: proto.WorkerResult) -> dict[str, Any]:
    return msgspec.structs.asdict(r)


async def _respond(request: web.Request, status: int, payload: Any) -> web.StreamResponse:
    if isinstance(payload, bytes):
        ctype, body = PROMETHEUS_TYPE, payload
    else:
        ctype, body = "application/json", json.dumps(payload).encode() + b"\n"
    resp = web.Response(status=status, body=body, headers={"Content-Type": ctype})
    # Sent here rather than by aiohttp, which would wait as long as a client that does
    # not read stays connected.
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S + len(body) / WRITE_MIN_RATE):
            await resp.prepare(request)
            await resp.write_eof()
    except (TimeoutError, ConnectionError):
        if request.transport is not None:
            request.transport.abort()
    return resp
