"""engine.metrics_port / metrics_host: each rank serves its Prometheus metrics on
port + rank at the configured address (0.0.0.0 in containers, so another host can
scrape it); loopback by default."""

from __future__ import annotations

import socket
import urllib.request

import pytest
import torch
from kvtest.paged import make_cache
from kvtest.service_process import free_port

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


@pytest.mark.parametrize(
    ("metrics_host", "reachable", "unreachable"),
    [("127.0.0.1", "127.0.0.1", "127.0.0.2"), ("0.0.0.0", "127.0.0.2", None)],
)
def test_metrics_served_on_the_configured_host(
    metrics_host: str, reachable: str, unreachable: str | None
) -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=4, block_size=4)
    port = free_port()
    config = EngineConfig(
        chunk_size=8,
        l1=L1Config(max_size=4 << 20, reserve=0),
        metrics_port=port - 1,  # rank 1 serves on port + 1
        metrics_host=metrics_host,
    )
    eng = KVEngine("metrics-test", 1, config, view, world_size=2)
    try:
        assert "kvmesh_tokens_hit_total" in _scrape(reachable, port)
        if unreachable is not None:
            assert not _listening(unreachable, port)
    finally:
        eng.close()
    assert not _listening(reachable, port)
