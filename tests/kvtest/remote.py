"""Real processes for the remote-tier tests: the cache-server, redis-server, a Redis Cluster.

Each starts on free loopback ports, waits until it answers, and is stopped (or killed
and restarted, for fault tests) by the test. A missing redis-server fails the test
loudly: CI installs it (scripts/setup.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvtest.service_process import KvmeshService, ServiceProcess, free_port

LMCACHE_PYTHON_ENV = "KVMESH_LMCACHE_PYTHON"
REPO = Path(__file__).resolve().parents[2]


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


class CacheServerProcess(KvmeshService):
    """`kvmesh serve cacheserver` in a subprocess, on fixed ports so a restart keeps
    them (clients reconnect to the same address)."""

    def __init__(
        self, workdir: Path, *, lm: bool = False, metrics: bool = False, **options: object
    ) -> None:
        self.lm_port = free_port() if lm else None
        self.metrics_port = free_port() if metrics else None
        flags: dict[str, object] = {"max-memory": "256MiB", "max-value-size": "64MiB"}
        if self.lm_port:
            flags |= {"lm": True, "lm-port": self.lm_port}
        if self.metrics_port:
            flags["metrics-port"] = self.metrics_port
        super().__init__("cacheserver", workdir, free_port(), flags | options)

    @property
    def url(self) -> str:
        return f"kvmesh://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server is not installed (scripts/setup.sh installs it)")
    return found


class RedisProcess(ServiceProcess):
    def __init__(self, workdir: Path, port: int | None = None, *, cluster: bool = False) -> None:
        self.port = port or (cluster_port() if cluster else free_port())
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
        ]  # fmt: skip
        if cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        super().__init__(
            "redis-server",
            cmd,
            log=workdir / f"redis-{self.port}.log",
            cwd=self.dir,
            ready_port=self.port,
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


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


def run_lmcache_client(port: int, *args: str, log_level: str = "ERROR") -> dict:
    """tests/kvtest/lmcache_client.py (LMCache's own lm:// client) against port, in the
    LMCache venv; its JSON result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(PYTHONHASHSEED="0", LMCACHE_LOG_LEVEL=log_level, PYTHONPATH="")
    done = subprocess.run(
        [lmcache_python(), str(REPO / "tests" / "kvtest" / "lmcache_client.py"), str(port), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO / "tests",
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1])


def read_json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def remote_engine(
    url: str, view, *, instance: str = "t", chunk: int = 8, l1_bytes: int = 8 << 20, **remote
):
    """A KVEngine with a small L1 and the remote tier at url (health checks every 0.1 s).
    The deadline is 5 s unless a test sets its own: a test that asserts reuse must not
    turn into misses when the loaded CI machine stalls a second (CI stop 24 did)."""
    from kvmesh.common.config import EngineConfig, L1Config, RemoteConfig
    from kvmesh.services.worker.engine import KVEngine

    options = {"health_interval_s": 0.1, "timeout_s": 5.0, **remote}
    cfg = EngineConfig(
        chunk_size=chunk,
        model_name="remote-test",
        l1=L1Config(max_size=l1_bytes, reserve=0, alloc_timeout_s=0.2),
        remote=RemoteConfig(enabled=True, url=url, **options),
    )
    engine = KVEngine(instance, 0, cfg, view)
    if not engine.storage.tier("remote").wait_ready(10):
        engine.close()
        raise TimeoutError(f"remote {url} not ready")
    return engine
