"""Real processes for the controller tests: the controller itself, worker engines in
their own processes, and small engines built in the test process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch

from kvmesh.common.config import EngineConfig, EngineControllerConfig, L1Config
from kvtest.paged import make_cache
from kvtest.remote import free_port

REPO = Path(__file__).resolve().parents[2]
CHUNK = 8
SLOTS = 64  # 16 blocks of 4


class ControllerProcess:
    """`kvmesh serve controller` in a subprocess on fixed ports (a restart keeps them)."""

    def __init__(self, workdir: Path, *, snapshot: bool = True, **options) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.http_port = free_port()
        self.options = {"heartbeat-misses": 3, "admin-timeout-s": 2.0, **options}
        if snapshot:
            self.options.setdefault("snapshot-path", str(workdir / "registry.snapshot"))
            self.options.setdefault("snapshot-interval-s", 0.5)
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"controller-{self.port}.log"

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 20.0) -> ControllerProcess:
        ready = self.workdir / f"ready-{self.port}.json"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "kvmesh.services.controller", "--port", str(self.port),
            "--http-port", str(self.http_port), "--ready-file", str(ready),
        ]  # fmt: skip
        for k, v in self.options.items():
            cmd += [f"--{k}", str(v)]
        env = {**os.environ, "KVMESH_LOGGING__JSON": "false", "KVMESH_LOGGING__LEVEL": "warning"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"controller not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        assert info["port"] == self.port and info["http_port"] == self.http_port
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


def engine_config(url: str, *, heartbeat_s: float = 0.2) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="test",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        controller=EngineControllerConfig(
            enabled=True, url=url, heartbeat_s=heartbeat_s, timeout_s=1.0, event_flush_s=0.02
        ),
    )


def build_engine(instance: str, url: str, *, p2p_endpoint: str = "", heartbeat_s: float = 0.2):
    """A KVEngine (rank 0 of 1) on a small CPU paged cache, registered with the
    controller at url; p2p_endpoint is what it tells the controller it serves on."""
    from kvmesh.services.worker import controller_client as cc
    from kvmesh.services.worker.engine import KVEngine

    view, _layers, _kind = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
    cfg = engine_config(url, heartbeat_s=heartbeat_s)
    # Built unattached, given a P2P endpoint (no P2P tier here: the controller only
    # routes), then attached: the client registers the endpoint it finds.
    eng = KVEngine(instance, 0, msgspec.structs.replace(cfg, controller=_off(cfg)), view)
    eng.p2p_endpoint = p2p_endpoint
    client = cc.start_controller_client(eng, cfg.controller)
    assert cc.wait_registered(client, 10.0), "engine did not register"
    return eng


def _off(cfg: EngineConfig) -> EngineControllerConfig:
    return msgspec.structs.replace(cfg.controller, enabled=False)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def store(eng, toks: list[int]) -> list[str]:
    """Store toks (full chunks) in eng; the chunk key strings, in order."""
    eng.store(toks, torch.arange(len(toks)))
    return [key.to_str() for _, _, key in eng.chunks(toks)]
