"""The chart's cache-server fits its memory limit: the cache-server runs for real with
the kvmesh.yaml a value set renders (its memory bound, largest value and spill),
clients fill it past max_memory with the largest values it accepts, and its peak
resident memory stays under the limit the StatefulSet gives the container. Past the
limit the kubelet kills the pod, and a restarted cache-server starts cold.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest
import yaml
from deploy_helm import config_dict, container, full_name, helm_binary, render, workloads
from kvtest.service_process import KvmeshService, free_port

from kvmesh.common.config import load_config
from kvmesh.common.transport.cacheserver_client import CacheServerClient

_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 1000, "M": 10**6, "G": 10**9}


def _quantity(q: str | int) -> int:
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|k|M|G)?", str(q))
    assert m, q
    return int(m[1]) * _UNITS[m[2] or ""]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def _fill(port: int, value_bytes: int, values: int, clients: int) -> None:
    conns = [CacheServerClient(f"tcp://127.0.0.1:{port}", timeout_s=60) for _ in range(clients)]
    for c in conns:
        await c.connect(timeout_s=10)
    blob = os.urandom(value_bytes)

    async def put_from(i: int, c: CacheServerClient) -> None:
        for j in range(i, values, clients):
            await c.put(f"chunk-{j}", blob, timeout_s=60)

    try:
        await asyncio.gather(*(put_from(i, c) for i, c in enumerate(conns)))
    finally:
        for c in conns:
            await c.close()


@pytest.mark.parametrize("value_set", ["default", "podman"])
def test_cacheserver_stays_under_its_memory_limit(tmp_path: Path, value_set: str) -> None:
    docs = render(helm_binary(), value_set)
    (workload,) = [w for w in workloads(docs) if w["metadata"]["name"] == full_name("cacheserver")]
    limit = _quantity(container(workload)["resources"]["limits"]["memory"])
    section = config_dict(docs)["cacheserver"]
    # The pod's bounds as rendered; only where it listens and spills is local.
    section.update(host="127.0.0.1", metrics_port=0, data_port=0)
    section["spill_path"] = str(tmp_path / "spill")
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump({"cacheserver": section}))
    cfg = load_config(path, env={}).cacheserver
    assert cfg.spill_path  # the spill's write backlog counts too

    # The largest values it accepts, three times its memory's worth, from a few
    # workers at once: the memory fills, then evictions go to the spill.
    value_bytes = int(cfg.max_value_size) - (1 << 20)
    values = 3 * int(cfg.max_memory) // value_bytes
    port = free_port()
    with KvmeshService("cacheserver", tmp_path, port, {"config": str(path)}) as server:
        asyncio.run(_fill(port, value_bytes, values, clients=4))
        peak = _peak_rss(server.proc.pid)
    assert peak < limit, (
        f"cache-server peaked at {peak >> 20} MiB; the chart's limit is {limit >> 20} MiB"
    )
