"""Fuzz the lookup path: the lookup-server's ROUTER (common/protocol/lookup_service.py)
and its /metrics, /health endpoint, and a worker engine's lookup endpoint
(common/protocol/lookup.py, services/worker/lookup_server.py), on real processes: a
controller, `kvmesh serve lookup`, and an engine (kvtest.lookup_worker) that holds a
4-chunk prompt. After each batch each is alive, logged no traceback, kept its RSS
bounded, and a lookup of that prompt still counts all of it in time."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fuzzkit import FUZZ_SECONDS, Watched, ZmqTarget, fuzz_for, fuzz_probe_http
from kvtest.controller import ControllerProcess, tokens
from kvtest.service_process import KvmeshService, KvtestProcess, free_port
from kvtest.waiting import wait_for

from kvmesh.common.protocol import lookup as wproto
from kvmesh.common.protocol import lookup_service as proto

CHUNK = 8
PROMPT = tokens(32, 1)  # what kvtest.lookup_worker stores with seed 1, total 32


@dataclass
class Mesh:
    controller: ControllerProcess
    worker: KvtestProcess
    worker_endpoint: str
    lookup: KvmeshService
    metrics_port: int

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.lookup.port}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work: Path = tmp_path_factory.mktemp("fuzz-lookup")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    with ControllerProcess(work, snapshot=False) as controller:
        worker = KvtestProcess(
            "worker w",
            "lookup_worker",
            [controller.url, "w", endpoint, "1", "32", "32"],
            log=work / "worker.log",
            ready_line='{"endpoint"',
            stop_grace_s=20.0,
        )
        options = {
            "controller-url": controller.url,
            "chunk-size": CHUNK,
            "worker-timeout-s": 0.5,
            "controller-timeout-s": 1.0,
            "metrics-port": metrics_port,
        }
        lookup = KvmeshService("lookup", work, free_port(), options)
        with worker.start(60.0), lookup:
            yield Mesh(controller, worker, endpoint, lookup, metrics_port)


def test_lookup_server_answers_every_fuzzed_message(mesh: Mesh) -> None:
    target = ZmqTarget(mesh.url, proto, proto.Request)
    watched = [Watched(mesh.lookup), Watched(mesh.worker), Watched(mesh.controller)]
    rid = itertools.count(1)
    encoded = wproto.encode_tokens(PROMPT)

    def best() -> proto.BestInstancesReply:
        reply, *_ = target.call(proto.BestInstances(next(rid), proto.PROTOCOL_VERSION, encoded))
        assert isinstance(reply, proto.BestInstancesReply), reply
        return reply

    wait_for(lambda: best().instances, 20, "the worker in the lookup-server's index")

    def run_batch(batch: list[list[bytes]]) -> None:
        target.send_batch(batch)
        msg = proto.Lookup(next(rid), proto.PROTOCOL_VERSION, "w", "", encoded, [], False)
        reply, *_ = target.call(msg)
        assert isinstance(reply, proto.LookupReply) and reply.hit_tokens == 32, reply
        hits = best().instances
        assert [(h.instance_id, h.hit_tokens) for h in hits] == [("w", 32)], hits
        for w in watched:
            w.check()

    try:
        batches = fuzz_for("lookup-server router", target.batches(), run_batch, FUZZ_SECONDS / 2)
    finally:
        target.close()
    assert batches > 0 and target.errors > 0


def test_lookup_server_probe_endpoint(mesh: Mesh) -> None:
    def healthy(status: int, body: bytes) -> bool:
        return status == 200 and json.loads(body)["status"] == "ok"

    statuses = fuzz_probe_http(
        "lookup-server metrics",
        Watched(mesh.lookup),
        mesh.metrics_port,
        FUZZ_SECONDS / 4,
        healthy=healthy,
    )
    assert statuses.get(200) and statuses.get(404), statuses


def test_worker_lookup_endpoint_answers_every_fuzzed_message(mesh: Mesh) -> None:
    target = ZmqTarget(mesh.worker_endpoint, wproto, wproto.Request)
    watched = Watched(mesh.worker)
    rid = itertools.count(1)
    encoded = wproto.encode_tokens(PROMPT)

    def run_batch(batch: list[list[bytes]]) -> None:
        target.send_batch(batch, hello_first=False)
        n = next(rid)
        msg = wproto.LookupPrefix(n, wproto.PROTOCOL_VERSION, f"probe-{n}", encoded, False)
        reply, *_ = target.call(msg)
        assert isinstance(reply, wproto.LookupPrefixReply) and reply.hit_tokens == 32, reply
        watched.check()

    try:
        batches = fuzz_for("worker lookup", target.batches(), run_batch, FUZZ_SECONDS / 2)
    finally:
        target.close()
    assert batches > 0 and target.errors > 0
