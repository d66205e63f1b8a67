"""Fuzz the bridge (services/bridge): its client-facing HTTP port (the OpenAI paths,
/v1/models, /health, /metrics, /transfers behind a bearer token) and its separate
metrics port, on a real `kvmesh serve bridge` process in front of stand-in engines (an
aiohttp app in a thread of this process that answers every completion the same). After
each batch the bridge is alive, logged no traceback, kept its RSS bounded, and still
proxies a completion to its answer and serves /health and /transfers in time."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from fuzzkit import (
    FUZZ_SECONDS,
    REPLY_S,
    Watched,
    fuzz_for,
    fuzz_probe_http,
    http_get,
    http_requests,
    send_http,
    slow_client,
)
from hypothesis import strategies as st
from kvtest.bridge import BridgeProcess
from kvtest.service_process import free_port

TOKEN = "fuzz-token"
ANSWER = {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "fuzz"}]}
PATHS = [
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
    "/transfers",
]  # fmt: skip
SHAPES = [
    {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": False},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": {}},
]


class StandInEngine:
    """A vLLM stand-in on a loopback port: /health 200, /v1/models, and every POST
    answered with ANSWER."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StandInEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/{tail:.*}", self._complete)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BridgeProcess]:
    work: Path = tmp_path_factory.mktemp("fuzz-bridge")
    (work / "token").write_text(TOKEN)
    with StandInEngine() as prefiller, StandInEngine() as decoder:
        proc = BridgeProcess(
            work,
            prefillers=[prefiller.url],
            decoders=[(decoder.url, ["tcp://127.0.0.1:1"])],
            metrics_port=free_port(),
            max_body_bytes="256KiB",
            prefill_timeout_s=5,
            decode_timeout_s=5,
        )
        proc.env["KVMESH_SECURITY__HTTP_TOKEN_FILE"] = str(work / "token")
        with proc:
            yield proc


def completion(port: int) -> tuple[int, dict]:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", port), timeout=REPLY_S) as sock:
        sock.sendall(req)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_bridge_answers_every_fuzzed_request(bridge: BridgeProcess) -> None:
    watched = Watched(bridge)
    host, port = "127.0.0.1", bridge.port
    statuses: dict[int | None, int] = {}

    def run_batch(batch: list) -> None:
        for req in batch:
            status = send_http(host, port, req)
            statuses[status] = statuses.get(status, 0) + 1
        with slow_client(host, port):
            assert completion(port) == (200, ANSWER)
            status, body = http_get(host, port, "/health")
            assert status == 200 and json.loads(body)["status"] == "ok", body
            status, body = http_get(host, port, "/transfers", TOKEN)
            assert status == 200, body
        watched.check()

    requests = st.lists(http_requests(PATHS, SHAPES, TOKEN), min_size=1, max_size=8)
    fuzz_for("bridge http", requests, run_batch, FUZZ_SECONDS * 3 / 4)
    assert statuses.get(200) and statuses.get(400) and statuses.get(401), statuses


def test_bridge_metrics_port_answers_every_fuzzed_request(bridge: BridgeProcess) -> None:
    metrics_port = bridge.ready_info["metrics_port"]

    def healthy(status: int, body: bytes) -> bool:
        return status == 200 and json.loads(body)["status"] == "ok"

    statuses = fuzz_probe_http(
        "bridge metrics", Watched(bridge), metrics_port, FUZZ_SECONDS / 4, healthy=healthy
    )
    assert statuses.get(200) and statuses.get(404), statuses
