"""The bridge as a real process (`kvmesh serve bridge --config F`, or the same command
through `python -m kvmesh.services.bridge`), and the small HTTP
client calls its tests make (standard library only: no event loop in the test).

    bridge = BridgeProcess(tmp, prefillers=[p.url], decoders=[(d.url, ["tcp://..."])])
    bridge.launch(); bridge.wait_ready()
    status, body = bridge.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
"""

from __future__ import annotations

import http.client
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvtest.service_process import QUIET_LOGS, ServiceProcess, free_port


def kvmesh_command() -> list[str]:
    """The installed `kvmesh` console script next to this Python, else the module."""
    script = Path(sys.executable).parent / "kvmesh"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kvmesh.services.cli.main"]


class BridgeProcess(ServiceProcess):
    """`kvmesh serve bridge` with a config file written from the arguments, ready once
    it writes its ready file (wait_ready waits 60 s unless told); `bridge` holds more
    `bridge:` keys (timeouts, max_body_bytes...)."""

    def __init__(
        self,
        workdir: Path,
        *,
        prefillers: Sequence[str],
        decoders: Sequence[tuple[str, Sequence[str]]],
        name: str = "bridge",
        console_script: bool = False,
        **bridge: Any,
    ) -> None:
        self.workdir = workdir
        # The console script loads the whole CLI (torch included): ~4 s of CPU more
        # than `python -m kvmesh.services.bridge`, which serves the same command.
        self.command = (
            [*kvmesh_command(), "serve", "bridge"]
            if console_script
            else [sys.executable, "-m", "kvmesh.services.bridge"]
        )
        self.port = free_port()
        self.config = workdir / f"{name}.yaml"
        self.ready = workdir / f"{name}.ready.json"
        section = {
            "port": self.port,
            "prefillers": [{"url": u} for u in prefillers],
            "decoders": [{"url": u, "kv_endpoints": list(e)} for u, e in decoders],
            **bridge,
        }
        self.config.write_text(yaml.safe_dump({"bridge": section}))
        super().__init__(
            name,
            [*self.command, "--config", str(self.config), "--ready-file", str(self.ready)],
            log=workdir / f"{name}.log",
            cwd=workdir,
            env=QUIET_LOGS,
            ready_file=self.ready,
            ready_timeout_s=60.0,
            stop_grace_s=15.0,
            tail_chars=3000,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
        return request(self.url + path, timeout_s=timeout_s)

    def post(self, path: str, body: Any, timeout_s: float = 60.0) -> tuple[int, Any]:
        """POST a JSON value (bytes go as they are); (status, decoded JSON answer)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, raw = request(self.url + path, data, timeout_s=timeout_s)
        return status, json.loads(raw)

    def stream(self, path: str, body: Mapping[str, Any], timeout_s: float = 60.0) -> list[Any]:
        """POST a streaming request; the SSE events' JSON payloads, [DONE] excluded."""
        status, raw = request(self.url + path, json.dumps(dict(body)).encode(), timeout_s)
        assert status == 200, raw
        return sse_events(raw)

    def metrics(self) -> dict[str, float]:
        status, raw = self.get("/metrics")
        assert status == 200
        return parse_metrics(raw.decode())


def request(url: str, data: bytes | None = None, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of a GET (no data) or a JSON POST, error statuses included."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_chunked(url: str, chunks: Iterable[bytes], timeout_s: float = 30.0) -> tuple[int, bytes]:
    """POST a body with chunked transfer encoding (no Content-Length)."""
    host, _, rest = url.removeprefix("http://").partition("/")
    name, _, port = host.partition(":")
    conn = http.client.HTTPConnection(name, int(port), timeout=timeout_s)
    try:
        conn.request(
            "POST",
            "/" + rest,
            body=iter(chunks),
            headers={"Content-Type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="v",...}': value}, labels as printed."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
