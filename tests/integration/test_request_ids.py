"""Request and lookup ids across processes: a pinned lookup through the lookup-server
(`kvmesh serve lookup`) reaches a worker engine in another process, and both
processes' JSON log lines for it carry the same `lookup_id`; the bridge takes the
client's X-Request-Id (or makes one), logs under it and passes it to the prefiller and
the decoder."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from kvtest.bridge import BridgeProcess
from kvtest.controller import ControllerProcess, tokens
from kvtest.http_backend import HttpBackend
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
            # The worker registers its lookup endpoint shortly after it is ready: until
            # then a lookup fails, or counts 0 (no rank asked).
            for _ in range(200):
                try:
                    reply = await client.lookup("inst-w", PROMPT, lookup_id=lookup_id, pin=True)
                except Exception:
                    await asyncio.sleep(0.05)
                    continue
                if reply.hit_tokens == 0:
                    await asyncio.sleep(0.05)
                    continue
                await client.release("inst-w", lookup_id)
                return reply.hit_tokens
            raise AssertionError("the lookup-server never reached the worker")

    assert asyncio.run(lookup()) == 32

    # The lookup-server queues a release to the worker without waiting for its answer,
    # so the worker's release line may come after the client's reply.
    def worker_lines_once_released() -> list[dict] | None:
        lines = lines_with(worker.log, "lookup_id", lookup_id)
        return lines if any(r["event"] == "lookup released" for r in lines) else None

    worker_lines = wait_for(worker_lines_once_released, 10, "the worker's release line")
    service_lines = wait_for(
        lambda: lines_with(service.log, "lookup_id", lookup_id), 10, "the lookup-server's lines"
    )
    served = [r for r in worker_lines if r["event"] == "lookup served"]
    assert served and served[0]["hit_tokens"] == 32 and served[0]["pinned"] is True
    assert served[0]["service"] == "worker-inst-w"
    answered = [r for r in service_lines if r["event"] == "lookup answered"]
    assert answered and answered[0]["hit_tokens"] == 32 and answered[0]["per_rank"] == [32]
    assert answered[0]["service"] == "lookup"
    released = [r for r in worker_lines if r["event"] == "lookup released"]
    assert released[0]["held_pins"] is True


def post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


@pytest.fixture
def bridge(tmp_path: Path):
    # Stand-ins that answer 500: the prefill fails (the bridge falls back to the
    # decoder), the decode's 500 goes back to the client. Both record what they got.
    prefiller, decoder = HttpBackend("fail").start(), HttpBackend("fail").start()
    proc = BridgeProcess(
        tmp_path, prefillers=[prefiller.url], decoders=[(decoder.url, ["tcp://127.0.0.1:7650"])]
    )
    proc.env.update(DEBUG_JSON)
    try:
        proc.start()
        yield proc, prefiller, decoder
    finally:
        proc.stop()
        prefiller.stop()
        decoder.stop()


def test_the_bridge_takes_or_makes_a_request_id_and_passes_it_on(bridge) -> None:
    proc, prefiller, decoder = bridge
    url = proc.url + "/v1/completions"
    body = {"prompt": "hello", "max_tokens": 4}

    status, headers = post(url, body, {"X-Request-Id": "client-7f3a"})
    assert status == 500  # the decoder's own answer, passed back
    assert headers["X-Request-Id"] == "client-7f3a"
    assert prefiller.requests[-1].headers["X-Request-Id"] == "client-7f3a"
    assert decoder.requests[-1].headers["X-Request-Id"] == "client-7f3a"

    # The bridge may log its answer after the client has it.
    def lines_once_answered() -> list[dict] | None:
        lines = lines_with(proc.log, "request_id", "client-7f3a")
        return lines if any(r["event"] == "request answered" for r in lines) else None

    lines = wait_for(lines_once_answered, 10, "the bridge's 'request answered' line")
    events = {r["event"] for r in lines}
    assert "prefill failed, the decoder prefills itself" in events
    assert "request answered" in events
    assert all(len(r["transfer_id"]) == 32 for r in lines)

    # No id, or one unfit for logs and vLLM's request names: the bridge makes one.
    for sent in ({}, {"X-Request-Id": "has a space"}, {"X-Request-Id": "x" * 129}):
        status, headers = post(url, body, sent)
        made = headers["X-Request-Id"]
        assert len(made) == 32 and int(made, 16) >= 0, sent
        assert prefiller.requests[-1].headers["X-Request-Id"] == made
        assert decoder.requests[-1].headers["X-Request-Id"] == made
        wait_for(lambda m=made: lines_with(proc.log, "request_id", m), 10, "bridge lines")
