"""A stand-in backend for the bridge's tests, on a loopback port, served from a thread
of the test process: it records every request it gets, then acts as `mode` says.

- "forward": pass the request to `upstream` (a real vLLM) and its answer back, SSE
  included: the bridge's real traffic, recorded on the way;
- "hang": accept and never answer (a deadline must fire);
- "fail": answer 500 with an OpenAI-style error;
- "drop": close the connection without an answer;
- "down": answer 503, GET /health included;
- "ok": answer by itself, no upstream: an SSE stream of two events and [DONE] when
  the request asks for `stream`, else one JSON completion; with `encoding` set, the
  body is gzip-compressed and sent with `Content-Encoding: <encoding>` (whatever the
  request's Accept-Encoding: a backend that ignores it, or an encoding nobody knows);
- "truncate": a 200 SSE answer cut after its first event (the connection dropped);
- "trickle": a 200 SSE answer of one event every 0.2 s for `trickle_s` seconds, then
  [DONE]: a connection kept busy, never silent for long.

GET /health answers 200 in every other mode, so the bridge keeps the stand-in "up"
and a test decides what each call meets by switching `mode`.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvtest.vllm_server import free_port


@dataclass
class Recorded:
    path: str
    headers: CIMultiDict[str]  # case-insensitive, as HTTP header names are
    body: dict[str, Any]


class HttpBackend:
    def __init__(self, mode: str = "forward", upstream: str = "") -> None:
        self.mode = mode
        self.upstream = upstream
        self.port = free_port()
        self.requests: list[Recorded] = []
        # Mode "ok": the Content-Encoding of its answers ("" = plain).
        self.encoding = ""
        # Mode "trickle": how long each answer lasts.
        self.trickle_s = 5.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=120), auto_decompress=False
        )
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._any)
        # handler_cancellation: a hung handler ends when the bridge hangs up.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=503 if self.mode == "down" else 200)

    async def _any(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = await request.json() if raw else {}
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body))
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode in ("fail", "down"):
            status = 500 if self.mode == "fail" else 503
            error = {"message": f"stand-in {self.mode}", "type": "Error", "code": status}
            return web.json_response({"error": error}, status=status)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.mode == "ok":
            return await self._ok(request, bool(body.get("stream")))
        if self.mode == "trickle":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for _ in range(max(1, round(self.trickle_s / 0.2))):
                await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
                await asyncio.sleep(0.2)
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        if self.mode == "truncate":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            assert request.transport is not None
            request.transport.abort()
            return out
        assert self._session is not None
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=raw,
            headers={"Content-Type": "application/json"},
        ) as up:  # fmt: skip
            out = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
            )
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _ok(self, request: web.Request, stream: bool) -> web.StreamResponse:
        if stream:
            events = [{"choices": [{"text": t, "index": 0}]} for t in ("a", "b")]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            body, content_type = text.encode(), "text/event-stream"
        else:
            answer = {"object": "text_completion", "choices": [{"text": "ab", "index": 0}]}
            body, content_type = json.dumps(answer).encode(), "application/json"
        headers = {"Content-Type": content_type}
        if self.encoding:
            body = gzip.compress(body)
            headers["Content-Encoding"] = self.encoding
        return web.Response(body=body, headers=headers)
