"""The real `kvmesh` binary on bad input, hung services and secrets in the config.

- A malformed endpoint given to `kvmesh status` is a usage error (exit 2, one line),
  not a traceback out of the handshake probe.
- `kvmesh probe` with a URL that does not parse is exit 2 at once (the module form,
  exit 1 at once), not a thread's traceback followed by a wait for the whole timeout.
- `kvmesh keys generate` into a directory it cannot create is one `error:` line.
- `kvmesh doctor` asks every port at once: ports held by processes that accept but
  never answer (a service frozen, swapping) cost one deadline, not one each.
- A password in a remote URL never reaches the output of doctor or `config check`.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kvtest.service_process import free_port

from kvmesh.services.cli import status_cmd

KVMESH = str(Path(sys.executable).with_name("kvmesh"))
ENV = {**os.environ, "KVMESH_CONFIG": ""}


def run(*args: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [KVMESH, *args], capture_output=True, text=True, env=ENV, timeout=timeout, check=False
    )
    return proc, time.monotonic() - t0


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("option", ["--controller", "--lookup-url", "--cacheserver-url"])
def test_status_with_a_malformed_endpoint_is_a_usage_error(option: str) -> None:
    proc, _ = run("status", option, "tcp://bad host:1", "--timeout", "0.5")
    no_traceback(proc)
    assert proc.returncode == 2, proc.stderr
    assert "expected tcp://host:port" in proc.stderr and proc.stdout == ""


def test_status_shows_an_endpoint_zmq_refuses_as_down_without_raising() -> None:
    # What the options now refuse can still come from code (and did, from the
    # handshake probe that explains a failure): it is a down service, not an exception.
    ep = status_cmd.Endpoints("tcp://bad host:1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1")
    view = asyncio.run(status_cmd.gather(ep, 0.5, None))
    ctl = view["services"]["controller"]
    assert ctl["up"] is False and "ZMQError" in ctl["error"]
    assert view["all_up"] is False


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://[::1", "not a URL"),
        ("tcp://127.0.0.1:abc", "not a URL"),
        ("ftp://127.0.0.1:21", "scheme must be"),
        ("tcp://127.0.0.1", "expected tcp://host:port"),
    ],
)
def test_probe_with_a_url_that_does_not_parse(url: str, why: str) -> None:
    proc, _ = run("probe", url, "--timeout", "5")
    no_traceback(proc)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr
    # The stdlib-only module the containers' health checks run: unhealthy, at once.
    t0 = time.monotonic()
    mod = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli.probe", url, "5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - t0
    no_traceback(mod)
    assert mod.returncode == 1 and why in mod.stderr, mod.stderr
    assert took < 4.0, f"{took:.1f}s: waited for the timeout"


def test_keys_generate_where_no_directory_can_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc, _ = run("keys", "generate", str(blocker / "keys"))
    no_traceback(proc)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "a-file" in lines[0]


@pytest.fixture
def silent_ports() -> Iterator[list[int]]:
    """Six loopback ports that accept connections and never answer anything."""
    socks = []
    for _ in range(6):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        socks.append(s)
    yield [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()


def test_doctor_asks_hung_ports_at_once(silent_ports: list[int], tmp_path: Path) -> None:
    p = silent_ports
    cfg = {
        "controller": {"port": p[0], "http_port": p[1]},
        "lookup": {"port": p[2], "metrics_port": p[3]},
        "cacheserver": {"port": p[4], "metrics_port": p[5]},
        "bridge": {"port": free_port()},
    }
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc, took = run("doctor", "--config", str(path), "--json", "--timeout", "1")
    no_traceback(proc)
    assert proc.returncode == 1
    checks = json.loads(proc.stdout)["checks"]
    held = [c for c in checks if c["name"] == "port" and c["level"] == "fail"]
    assert len(held) == 6, checks
    # One after another: 6 x (1 s + up to 1 s of handshake probe) for the ports alone.
    assert took < 10.0, f"doctor took {took:.1f}s with --timeout 1"


def test_a_password_in_a_remote_url_is_never_printed(tmp_path: Path) -> None:
    port = free_port()  # nothing listens: the reach check fails and quotes the URL
    cfg = {
        "engine": {
            "remote": {"enabled": True, "url": f"redis://alice:s3cretPW@127.0.0.1:{port}/0"}
        },
        "bridge": {"lookup_url": ""},
    }
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for args in (
        ("doctor", "--config", str(path), "--timeout", "0.5"),
        ("doctor", "--config", str(path), "--timeout", "0.5", "--json"),
        ("config", "check", str(path)),
        ("config", "check", "--json", str(path)),
    ):
        proc, _ = run(*args)
        no_traceback(proc)
        assert "s3cretPW" not in proc.stdout + proc.stderr, args
        assert f"redis://alice:***@127.0.0.1:{port}/0" in proc.stdout, (args, proc.stdout)
    # No port: the doctor's own error message quotes the whole URL.
    path.write_text(
        yaml.safe_dump({"engine": {"remote": {"enabled": True, "url": "unix://:tok3n@somewhere"}}})
    )
    proc, _ = run("doctor", "--config", str(path), "--timeout", "0.5")
    no_traceback(proc)
    assert "tok3n" not in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--events-port", "70000"), "--events-port"),
        (("--events-port", "-3"), "--events-port"),
        (("--events-port", "7650", "--replay-port", "-1", "--since", "0"), "--replay-port"),
        (("--events-port", "7650", "--replay-port", "70000", "--since", "0"), "--replay-port"),
        (("--events-port", "7650", "--limit", "-1"), "--limit"),
    ],
)
def test_events_refuses_a_port_or_limit_out_of_range(args: tuple[str, ...], named: str) -> None:
    # Once: port 70000 followed nothing for --duration and exited 0; -1 blamed --controller.
    proc, _ = run("events", *args, "--duration", "2", "--replay-timeout", "0.5")
    no_traceback(proc)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert named in proc.stderr and "--controller" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--engine-only", "--tokens", "10"), "--tokens"),
        (("--engine-only", "--tokens", "0"), "--tokens"),
        (("--engine-only", "--layers", "0"), "--layers"),
        (("--tokens", "0"), "--tokens"),  # refused before vLLM starts
    ],
)
def test_demo_refuses_sizes_it_cannot_run(args: tuple[str, ...], named: str) -> None:
    proc, took = run("demo", *args)
    no_traceback(proc)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert took < 20.0, f"{took:.1f}s: started something first"


def test_events_duration_bounds_the_replay_of_a_frozen_controller(tmp_path: Path) -> None:
    from kvtest.service_process import KvmeshService

    events, replay = free_port(), free_port()
    ctl = KvmeshService(
        "controller",
        tmp_path,
        free_port(),
        {"events-port": events, "events-replay-port": replay, "snapshot-path": ""},
    ).start(60)
    try:
        assert ctl.proc is not None
        ctl.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            proc, took = run(
                "events", "--controller", "127.0.0.1",
                "--events-port", str(events), "--replay-port", str(replay),
                "--since", "0", "--duration", "1", "--replay-timeout", "10",
            )  # fmt: skip
        finally:
            ctl.proc.send_signal(signal.SIGCONT)
    finally:
        ctl.stop()
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    # The replay once ran outside --duration: 10 s of --replay-timeout, then 1 s more.
    assert took < 8.0, f"--duration 1 took {took:.1f}s"
    # Cut before the replay answered: said, not silence a script would take for "no
    # events after 0".
    assert "lost (replay cut by --duration)" in proc.stderr, (proc.stdout, proc.stderr)


@pytest.mark.parametrize("service", ["controller", "lookup", "cacheserver"])
def test_serve_with_a_ready_file_it_cannot_write(service: str, tmp_path: Path) -> None:
    # Once a traceback after the service had started, while a supervisor waited on it.
    where = tmp_path / "no-such-dir" / "ready.json"
    proc, _ = run("serve", service, "--port", "0", "--ready-file", str(where), timeout=30)
    no_traceback(proc)
    assert proc.returncode == 2, proc.stderr
    assert f"error: --ready-file {where}: No such file or directory" in proc.stderr


class _NanMetrics(http.server.BaseHTTPRequestHandler):
    body = (
        b'kvmesh_hit_rate{tier="l1"} NaN\n'
        b'kvmesh_hit_rate{tier="disk"} 0.25\n'
        b"kvmesh_l1_usage_bytes +Inf\n"
        b"kvmesh_l1_capacity_bytes 1024\n"
    )

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def _strict(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def test_status_json_stays_json_when_a_page_says_nan() -> None:
    srv = http.server.HTTPServer(("127.0.0.1", 0), _NanMetrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        dead = f"tcp://127.0.0.1:{free_port()}"
        proc, _ = run(
            "status", "--json", "--timeout", "0.5",
            "--controller", dead, "--lookup-url", dead, "--cacheserver-url", dead,
            "--metrics", f"eng=http://127.0.0.1:{srv.server_address[1]}/metrics",
        )  # fmt: skip
    finally:
        srv.shutdown()
        srv.server_close()
    no_traceback(proc)
    view = json.loads(proc.stdout, parse_constant=_strict)  # NaN/Infinity: not JSON
    (eng,) = view["engines"]
    assert eng["up"] is True
    assert eng["hit_rate"] == {"disk": 0.25}  # the NaN tier is unknown, the other kept
    assert eng["l1_usage_bytes"] is None and eng["l1_capacity_bytes"] == 1024
