"""Fuzz the controller: its ZMQ ROUTER (common/protocol/controller.py) and its HTTP admin
API (services/controller/http.py), on one real `kvmesh serve controller` process with a
bearer token set. After each batch the controller is alive, logged no traceback, kept
its RSS bounded and still answers a well-formed request correctly in time."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fuzzkit import (
    FUZZ_SECONDS,
    Watched,
    ZmqTarget,
    fuzz_for,
    http_get,
    http_requests,
    send_http,
    slow_client,
)
from hypothesis import strategies as st
from kvtest.controller import ControllerProcess

from kvmesh.common.protocol import controller as proto

TOKEN = "fuzz-token"
PATHS = [
    "/health", "/healthz", "/metrics", "/workers", "/instances", "/events/x",
    "/clear", "/pin", "/copy", "/move",
]  # fmt: skip
SHAPES = [
    {"instance_id": "a", "tier": "l1", "event_id": "e"},
    {"keys": ["0123456789abcdef-" + "ab" * 16], "unpin": True, "instance_id": ""},
    {"src_instance": "a", "dst_instance": "b", "keys": [], "timeout_s": 1.0},
]


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerProcess]:
    work = tmp_path_factory.mktemp("fuzz-controller")
    (work / "token").write_text(TOKEN)
    proc = ControllerProcess(work, snapshot=False)
    proc.env["KVMESH_SECURITY__HTTP_TOKEN_FILE"] = str(work / "token")
    with proc:
        yield proc


def test_router_answers_every_fuzzed_message(controller: ControllerProcess) -> None:
    target = ZmqTarget(controller.url, proto, proto.Request)
    watched = Watched(controller)
    rid = iter(range(1, 1 << 30))

    def run_batch(batch: list[list[bytes]]) -> None:
        target.send_batch(batch)
        reply, *_ = target.call(proto.ListWorkers(next(rid)))
        assert isinstance(reply, proto.ListWorkersReply), reply
        watched.check()

    try:
        batches = fuzz_for("controller router", target.batches(), run_batch, FUZZ_SECONDS / 2)
    finally:
        target.close()
    assert batches > 0 and target.errors > 0


def test_http_api_answers_every_fuzzed_request(controller: ControllerProcess) -> None:
    watched = Watched(controller)
    host, port = "127.0.0.1", controller.http_port
    statuses: dict[int | None, int] = {}

    def run_batch(batch: list) -> None:
        for req in batch:
            status = send_http(host, port, req)
            statuses[status] = statuses.get(status, 0) + 1
        # A client stalled mid-request holds no one else up.
        with slow_client(host, port):
            status, body = http_get(host, port, "/health")
            assert status == 200 and json.loads(body)["status"] == "ok", body
            status, body = http_get(host, port, "/workers", TOKEN)
            assert status == 200 and isinstance(json.loads(body), list), body
        watched.check()

    requests = st.lists(http_requests(PATHS, SHAPES, TOKEN), min_size=1, max_size=8)
    fuzz_for("controller http", requests, run_batch, FUZZ_SECONDS / 2)
    assert statuses.get(401) and statuses.get(400) and statuses.get(200), statuses
