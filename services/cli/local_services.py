"""Start the local kvmesh services a config names, for `kvmesh demo`.

Only what a single machine can run by itself is started: a `kvmesh://` remote tier on a
loopback address with nothing listening there yet gets a cache-server child. Anything
already listening, or on another host, is the user's and is left alone.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvmesh.common.config import KvmeshConfig

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ServiceStartError(RuntimeError):
    """A local service did not come up before its deadline; the message has its output."""


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def local_cacheserver_address(cfg: KvmeshConfig) -> tuple[str, int] | None:
    """(host, port) of the cache-server the engine's remote tier names, when it is a
    kvmesh:// URL on this machine; else None."""
    remote = cfg.engine.remote
    if not remote.enabled or not remote.url.lower().startswith("kvmesh://"):
        return None
    hostport = remote.url.partition("://")[2].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    if host not in _LOOPBACK or not port.isdigit():
        return None
    return host, int(port)


@contextlib.contextmanager
def local_services(
    cfg: KvmeshConfig, config_path: str | None, *, timeout_s: float = 30.0
) -> Iterator[list[str]]:
    """Run the services cfg names that are missing here; yields one line per service
    started, and stops them on exit."""
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    lines: list[str] = []
    try:
        addr = local_cacheserver_address(cfg)
        if addr is not None and not _listening(*addr):
            proc, line = _start_cacheserver(addr, config_path, timeout_s)
            started.append((proc, line))
            lines.append(line)
        yield lines
    finally:
        for proc, _ in started:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start_cacheserver(
    addr: tuple[str, int], config_path: str | None, timeout_s: float
) -> tuple[subprocess.Popen[bytes], str]:
    work = Path(tempfile.mkdtemp(prefix="kvmesh-demo-cs-"))
    ready, log_path = work / "ready.json", work / "cacheserver.log"
    cmd = [sys.executable, "-m", "kvmesh.services.cli.main", "serve", "cacheserver"]
    cmd += ["--host", addr[0], "--port", str(addr[1]), "--ready-file", str(ready)]
    if config_path:
        cmd += ["--config", config_path]
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes it until it stops
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            output = log_path.read_text(errors="replace")[-4000:]
            raise ServiceStartError(
                f"the cache-server at {addr[0]}:{addr[1]} did not start\n{output}"
            )
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    return (
        proc,
        f"started a cache-server on {addr[0]}:{info['port']} (pid {info['pid']}, log {log_path})",
    )
