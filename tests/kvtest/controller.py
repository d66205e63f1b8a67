"""Real processes for the controller tests: the controller itself, worker engines in
their own processes, and small engines built in the test process."""

from __future__ import annotations

from pathlib import Path
from typing import Self

import msgspec
import torch

from kvmesh.common.config import EngineConfig, EngineControllerConfig, L1Config
from kvtest.paged import make_cache
from kvtest.remote import free_port
from kvtest.service_process import KvmeshService

REPO = Path(__file__).resolve().parents[2]
CHUNK = 8
SLOTS = 64  # 16 blocks of 4


class ControllerProcess(KvmeshService):
    """`kvmesh serve controller` in a subprocess on fixed ports (a restart keeps them)."""

    def __init__(
        self, workdir: Path, *, snapshot: bool = True, events: bool = False, **options: object
    ) -> None:
        self.http_port = free_port()
        # The KV-event feed (PUB and replay) on fixed ports too; set through the
        # environment, as a user's deployment would.
        self.events_port = free_port() if events else 0
        self.events_replay_port = free_port() if events else 0
        options = {
            "http-port": self.http_port,
            "heartbeat-misses": 3,
            "admin-timeout-s": 2.0,
            **options,
        }
        if snapshot:
            options.setdefault("snapshot-path", str(workdir / "registry.snapshot"))
            options.setdefault("snapshot-interval-s", 0.5)
        super().__init__("controller", workdir, free_port(), options)
        if events:
            self.env["KVMESH_CONTROLLER__EVENTS_PORT"] = str(self.events_port)
            self.env["KVMESH_CONTROLLER__EVENTS_REPLAY_PORT"] = str(self.events_replay_port)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def events_url(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_url(self) -> str:
        return f"tcp://127.0.0.1:{self.events_replay_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 20.0) -> Self:
        info = super().start(timeout).ready_info
        assert info["port"] == self.port and info["http_port"] == self.http_port
        return self


def engine_config(url: str, *, heartbeat_s: float = 0.2, tenant_salt: str = "") -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="test",
        tenant_salt=tenant_salt,
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        controller=EngineControllerConfig(
            enabled=True, url=url, heartbeat_s=heartbeat_s, timeout_s=1.0, event_flush_s=0.02
        ),
    )


def build_engine(
    instance: str,
    url: str,
    *,
    p2p_endpoint: str = "",
    heartbeat_s: float = 0.2,
    tenant_salt: str = "",
):
    """A KVEngine (rank 0 of 1) on a small CPU paged cache, registered with the
    controller at url; p2p_endpoint is what it tells the controller it serves on;
    tenant_salt puts its chunks in a namespace of their own."""
    from kvmesh.services.worker import controller_client as cc
    from kvmesh.services.worker.engine import KVEngine

    view, _layers, _kind = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
    cfg = engine_config(url, heartbeat_s=heartbeat_s, tenant_salt=tenant_salt)
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
