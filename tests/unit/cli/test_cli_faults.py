"""The CLI on bad input or a failing start: one `error:` line and an exit status, never
a traceback or a hang (a malformed controller URL once hung admin, status and doctor)."""

from __future__ import annotations

import asyncio
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from click.testing import CliRunner, Result
from kvtest.service_process import free_port

from kvmesh.common.config import ControllerConfig, load_config
from kvmesh.services.cli import serving, status_cmd
from kvmesh.services.cli.doctor_cmd import check_reach
from kvmesh.services.cli.main import cli
from kvmesh.services.cli.probe import probe

ENV = {"KVMESH_CONFIG": ""}


def _in_time(fn: Callable[[], Any], seconds: float = 20.0) -> Any:
    """fn()'s value; fails the test if fn is still running after `seconds`."""
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(seconds)
    assert out, f"still running after {seconds}s"
    return out[0]


def _invoke(*args: str) -> Result:
    return _in_time(lambda: CliRunner().invoke(cli, list(args), env=ENV))


@pytest.mark.parametrize(
    "args",
    [
        ("admin", "--url", "foo", "--timeout", "1", "workers"),
        ("admin", "--url", "tcp://bad host:7600", "--timeout", "1", "health"),
        ("admin", "--timeout", "1", "lookup", "0:10", "--lookup-url", "foo"),
    ],
)
def test_a_url_zmq_refuses_exits_2_at_once(args: tuple[str, ...]) -> None:
    res = _invoke(*args)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "expected tcp://host:port" in res.output


def test_events_with_a_bad_host_exits_2() -> None:
    res = _invoke("events", "--controller", "bad host", "--events-port", "7650", "--duration", "1")
    assert res.exit_code == 2, res.output
    assert "bad host" in res.output and "Traceback" not in res.output


def test_negative_seconds_are_refused() -> None:
    res = _invoke(
        "status", "--watch", "-1", "--timeout", "0.2", "--controller", "tcp://127.0.0.1:1"
    )
    assert res.exit_code == 2 and "--watch" in res.output


class _NotJson(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "11")
        self.end_headers()
        self.wfile.write(b"hello world")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def not_json() -> Iterator[str]:
    srv = http.server.HTTPServer(("127.0.0.1", 0), _NotJson)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_transfers_from_a_server_that_is_not_a_bridge(not_json: str) -> None:
    res = _invoke("admin", "--timeout", "2", "transfers", "--bridge", not_json)
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit)
    assert "did not answer with a transfer list" in res.output


def test_status_reports_a_malformed_controller_url_as_down() -> None:
    ep = status_cmd.Endpoints("foo", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1")
    view = _in_time(lambda: asyncio.run(status_cmd.gather(ep, 0.5, None)))
    ctl = view["services"]["controller"]
    assert ctl["up"] is False and "ZMQError" in ctl["error"]


@pytest.mark.parametrize(
    "url", ["redis://cachehost", "redis://user:pw@cachehost", "redis-cluster://a,b:7001"]
)
def test_doctor_takes_the_default_port_of_a_remote_url(url: str) -> None:
    cfg = load_config(env={}, overrides={"engine.remote.enabled": True, "engine.remote.url": url})
    checks = asyncio.run(check_reach(cfg, 0.2, None))
    remote = [c for c in checks if "engine.remote.url" in c.why]
    assert len(remote) == 1 and remote[0].level == "fail"
    assert "ValueError" not in remote[0].why


def test_a_port_in_use_is_one_line_and_stops_what_started(capsys) -> None:
    from kvmesh.services.controller.server import ControllerServer

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    router = free_port()
    cfg = ControllerConfig(port=router, http_port=busy.getsockname()[1])
    servers: list[ControllerServer] = []

    def make() -> ControllerServer:
        servers.append(ControllerServer(cfg))
        return servers[0]

    with pytest.raises(SystemExit) as info:
        asyncio.run(serving._serve("controller", make, None, lambda s: {}))
    busy.close()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot start controller: ") and "\n" not in err
    assert "in use" in err
    # The ROUTER it had bound before the HTTP port failed is closed again.
    with socket.socket() as s:
        s.bind(("127.0.0.1", router))


@pytest.mark.parametrize("module", ["controller", "lookup", "cacheserver"])
def test_a_zmq_port_in_use_is_one_line_not_a_hang(module: str, tmp_path) -> None:
    """The ROUTER's own port taken: the bind fails with the socket not kept, and a
    stop that waited for every socket of the context would never return. Also: the
    controller that never served leaves the snapshot at its path alone (most likely the
    running controller's)."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    snapshot = tmp_path / "snap"
    snapshot.write_bytes(b"not ours")
    env = {**os.environ, "KVMESH_CONTROLLER__SNAPSHOT_PATH": str(snapshot)}
    try:
        cmd = [sys.executable, "-m", f"kvmesh.services.{module}"]
        cmd += ["--port", str(busy.getsockname()[1])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    finally:
        busy.close()
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert err[-1].startswith(f"error: cannot start {module}: ") and "in use" in err[-1]
    assert "Traceback" not in done.stderr
    assert snapshot.read_bytes() == b"not ours"


def test_probe_is_bounded_by_its_timeout_as_a_whole() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()
    threading.Timer(4.0, stop.set).start()  # without the bound, the probe ends here

    def drip() -> None:
        c, _ = srv.accept()
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(0.2):
            try:
                c.sendall(b"x")
            except OSError:
                break
        c.close()

    threading.Thread(target=drip, daemon=True).start()
    t0 = time.monotonic()
    why = probe(f"http://127.0.0.1:{srv.getsockname()[1]}/health", 1.0)
    took = time.monotonic() - t0
    stop.set()
    srv.close()
    assert why is not None and "no complete answer in 1s" in why
    assert took < 2.0


@pytest.mark.parametrize("module", ["controller", "lookup", "cacheserver"])
def test_a_bind_host_that_does_not_resolve_is_a_config_error(module: str) -> None:
    """Exit 2 (fix the config), one line naming the host, as for an address in use."""
    cmd = [sys.executable, "-m", f"kvmesh.services.{module}", "--host", "kvmesh.nowhere.invalid"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert err[-1].startswith(f"error: cannot start {module}: ") and "does not resolve" in err[-1]
    assert "kvmesh.nowhere.invalid" in err[-1] and "Traceback" not in done.stderr


def test_the_lookup_server_refuses_a_chunk_size_other_than_the_engines(tmp_path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("engine:\n  chunk_size: 512\nlookup:\n  chunk_size: 256\n")
    cmd = [sys.executable, "-m", "kvmesh.services.lookup", "--config", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "lookup.chunk_size: must equal engine.chunk_size (512" in done.stderr
