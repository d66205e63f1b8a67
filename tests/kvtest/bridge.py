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
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvtest.vllm_server import free_port

# Plain-text warnings and worse: a log tail in a failure message is read by a person.
QUIET_LOGS = {"KVMESH_LOGGING__JSON": "false", "KVMESH_LOGGING__LEVEL": "warning"}


def kvmesh_command() -> list[str]:
    """The installed `kvmesh` console script next to this Python, else the module."""
    script = Path(sys.executable).parent / "kvmesh"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kvmesh.services.cli.main"]


class BridgeProcess:
    """`kvmesh serve bridge` with a config file written from the arguments; `bridge`
    holds more `bridge:` keys (timeouts, max_body_bytes...)."""

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
        self.name = name
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
        self.log = workdir / f"{name}.log"
        section = {
            "port": self.port,
            "prefillers": [{"url": u} for u in prefillers],
            "decoders": [{"url": u, "kv_endpoints": list(e)} for u, e in decoders],
            **bridge,
        }
        self.config.write_text(yaml.safe_dump({"bridge": section}))
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_info: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        self.ready.unlink(missing_ok=True)
        cmd = [*self.command, "--config", str(self.config)]
        cmd += ["--ready-file", str(self.ready)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=out, env={**os.environ, **QUIET_LOGS}, cwd=self.workdir
            )

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(self.describe(f"exited ({self.proc.returncode})"))
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(self.describe(f"not ready after {timeout_s}s"))
            time.sleep(0.05)
        self.ready_info = json.loads(self.ready.read_text())
        return self.ready_info

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self, what: str) -> str:
        try:
            tail = self.log.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            tail = ""
        return f"{self.name} {what}; the end of {self.log}:\n{tail}"

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
