"""Request and lookup ids across processes: a pinned lookup through the lookup-server
(`kvmesh serve lookup`) reaches a worker engine in another process, and both
processes' JSON log lines for it carry the same `lookup_id`."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from kvtest.controller import ControllerProcess, tokens
from kvtest.remote import free_port
from kvtest.service_process import KvmeshService, KvtestProcess
from kvtest.waiting import wait_for

from kvmesh.common.transport.lookup_service_client import LookupServiceClient

CHUNK = 8
PROMPT = tokens(32, 1)  # 4 chunks of 8
DEBUG_JSON = {"KVMESH_LOGGING__JSON": "true", "KVMESH_LOGGING__LEVEL": "debug"}


def json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a process still writing
    return out


def lines_with(path: Path, key: str, value: str) -> list[dict]:
    return [r for r in json_lines(path) if r.get(key) == value]


@pytest.fixture
def mesh(tmp_path: Path):
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    service = worker = None
    try:
        service = KvmeshService(
            "lookup",
            tmp_path,
            free_port(),
            {"controller-url": controller.url, "chunk-size": CHUNK, "worker-timeout-s": 2.0},
        )
        service.env.update(DEBUG_JSON)
        service.start(60.0)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        worker = KvtestProcess(
            "worker w",
            "lookup_worker",
            [controller.url, "inst-w", endpoint, "1", "32", "32"],
            log=tmp_path / "worker-w.log",
            ready_line='{"endpoint"',
            stop_grace_s=20.0,
        )
        worker.env.update(DEBUG_JSON)
        worker.start(60.0)
        yield service, worker
    finally:
        if worker is not None:
            worker.stop()
        if service is not None:
            service.stop()
        controller.stop()


def test_a_pinned_lookup_carries_its_id_in_both_processes_logs(mesh) -> None:
    service, worker = mesh
    lookup_id = f"req-{uuid.uuid4().hex[:12]}"
    url = f"tcp://127.0.0.1:{service.port}"

    async def lookup() -> int:
        async with LookupServiceClient(url, timeout_s=10.0, name="test") as client:
            # The worker registers its lookup endpoint shortly after it is ready.
            for _ in range(200):
                try:
                    reply = await client.lookup("inst-w", PROMPT, lookup_id=lookup_id, pin=True)
                except Exception:
                    await asyncio.sleep(0.05)
                    continue
                await client.release("inst-w", lookup_id)
                return reply.hit_tokens
            raise AssertionError("the lookup-server never reached the worker")

    assert asyncio.run(lookup()) == 32

    worker_lines = wait_for(
        lambda: lines_with(worker.log, "lookup_id", lookup_id), 10, "the worker's lines"
    )
    service_lines = wait_for(
        lambda: lines_with(service.log, "lookup_id", lookup_id), 10, "the lookup-server's lines"
    )
    served = [r for r in worker_lines if r["event"] == "lookup served"]
    assert served and served[0]["hit_tokens"] == 32 and served[0]["pinned"] is True
    assert served[0]["service"] == "worker-inst-w"
    answered = [r for r in service_lines if r["event"] == "lookup answered"]
    assert answered and answered[0]["hit_tokens"] == 32 and answered[0]["per_rank"] == [32]
    assert answered[0]["service"] == "lookup"
    assert any(r["event"] == "lookup released" for r in worker_lines)
