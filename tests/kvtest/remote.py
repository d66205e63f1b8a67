"""Real processes for the remote-tier tests: the cache-server, redis-server, a Redis Cluster.

Each starts on free loopback ports, waits until it answers, and is stopped (or killed
and restarted, for fault tests) by the test. A missing redis-server fails the test
loudly: CI installs it (scripts/setup.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

LMCACHE_PYTHON_ENV = "KVMESH_LMCACHE_PYTHON"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_port() -> int:
    """A free port whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class CacheServerProcess:
    """`kvmesh serve cacheserver` in a subprocess, on fixed ports so a restart keeps
    them (clients reconnect to the same address)."""

    def __init__(self, workdir: Path, *, lm: bool = False, metrics: bool = False, **options):
        self.workdir = workdir
        self.port = free_port()
        self.lm_port = free_port() if lm else None
        self.metrics_port = free_port() if metrics else None
        self.options = {"max-memory": "256MiB", "max-value-size": "64MiB", **options}
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"cacheserver-{self.port}.log"

    @property
    def url(self) -> str:
        return f"kvmesh://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> CacheServerProcess:
        ready = self.workdir / f"ready-{self.port}.json"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "kvmesh.services.cacheserver",
            "--port", str(self.port), "--ready-file", str(ready),
        ]  # fmt: skip
        if self.lm_port:
            cmd += ["--lm", "--lm-port", str(self.lm_port)]
        if self.metrics_port:
            cmd += ["--metrics-port", str(self.metrics_port)]
        for k, v in self.options.items():
            cmd += [f"--{k}", str(v)]
        env = {**os.environ, "KVMESH_LOGGING__JSON": "false", "KVMESH_LOGGING__LEVEL": "warning"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"cache-server exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"cache-server not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server is not installed (scripts/setup.sh installs it)")
    return found


class RedisProcess:
    def __init__(self, workdir: Path, port: int | None = None, *, cluster: bool = False):
        self.port = port or (cluster_port() if cluster else free_port())
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisProcess:
        cmd = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
        ]  # fmt: skip
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir
        )
        wait_port(self.port)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    stop = kill


class RedisCluster:
    """Three masters, no replicas, on loopback (redis-cli --cluster create)."""

    def __init__(self, workdir: Path, size: int = 3):
        self.nodes = [RedisProcess(workdir, cluster=True) for _ in range(size)]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli") or pytest.fail("redis-cli is not installed")
        done = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            out = subprocess.run(
                [cli, "-p", str(self.nodes[0].port), "cluster", "info"],
                capture_output=True, text=True, timeout=5,
            ).stdout  # fmt: skip
            if "cluster_state:ok" in out:
                return self
            time.sleep(0.1)
        raise TimeoutError("redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def lmcache_python() -> str:
    """The Python of the separate LMCache venv (scripts/setup.sh makes it)."""
    venv = os.environ.get("KVMESH_LMCACHE_VENV") or str(REPO / ".venv-lmcache")
    path = os.environ.get(LMCACHE_PYTHON_ENV) or os.path.join(venv, "bin", "python")
    if not os.path.exists(path):
        pytest.fail(
            f"no LMCache venv at {path}: run scripts/setup.sh (it creates .venv-lmcache) or "
            f"set {LMCACHE_PYTHON_ENV}"
        )
    return path


def read_json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def remote_engine(url: str, view, *, instance: str = "t", chunk: int = 8, **remote):
    """A KVEngine with a small L1 and the remote tier at url (health checks every 0.1 s)."""
    from kvmesh.common.config import EngineConfig, L1Config, RemoteConfig
    from kvmesh.services.worker.engine import KVEngine

    options = {"health_interval_s": 0.1, "timeout_s": 1.0, **remote}
    cfg = EngineConfig(
        chunk_size=chunk,
        model_name="remote-test",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        remote=RemoteConfig(enabled=True, url=url, **options),
    )
    engine = KVEngine(instance, 0, cfg, view)
    if not engine.storage.tier("remote").wait_ready(10):
        engine.close()
        raise TimeoutError(f"remote {url} not ready")
    return engine
