"""The lookup-server's copy of the registry (services/lookup/index.py, follower.py),
with real processes on loopback.

Against a real controller and an engine: KV events reach the lookup-server's index,
and BestInstances follows an admit and an evict without asking the controller (its
PrefixCounts counter and the lookup-server's fallback counter stay put); a restarted
controller makes the index resync; a dead controller gets lookups answered from the
index while it is fresh and a clear UNAVAILABLE after, never a hang.

Against a stand-in controller (kvtest.fake_controller): a push out of sequence makes
the lookup-server subscribe again; frames that do not decode are counted and dropped;
a new epoch is a resync; a silent controller takes the index out of sync.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

import pytest
import zmq
from kvtest.controller import ControllerProcess, build_engine, store, tokens
from kvtest.fake_controller import FakeController
from kvtest.prom import sample_sum
from kvtest.service_process import KvmeshService, free_port
from kvtest.waiting import wait_for

from kvmesh.common.protocol import controller as cproto
from kvmesh.common.protocol import lookup as lwire
from kvmesh.common.protocol import lookup_service as proto

CHUNK = 8
PROMPT = tokens(32, 3)  # 4 chunks of 8
STALENESS_S = 2.0  # generous: a busy 2-core machine must not take the index out of sync
CONTROLLER_TIMEOUT_S = 0.5


class LookupProcess(KvmeshService):
    def __init__(self, workdir: Path, controller_url: str) -> None:
        options = {
            "controller-url": controller_url,
            "chunk-size": CHUNK,
            "controller-timeout-s": CONTROLLER_TIMEOUT_S,
            "metrics-port": free_port(),
            "index-ping-s": 0.1,
            "index-max-staleness-s": STALENESS_S,
        }
        super().__init__("lookup", workdir, free_port(), options)
        self.metrics_port = int(options["metrics-port"])

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Self:
        info = super().start(timeout).ready_info
        assert info["metrics_port"] == self.metrics_port
        return self

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as r:
            return r.read()

    def index(self) -> dict[str, Any]:
        return json.loads(self.get("/health"))["index"]

    def metric(self, name: str, **labels: str) -> float:
        return sample_sum(self.get("/metrics").decode(), name, **labels)


def ask(url: str, msg: Any, timeout_s: float = 10.0) -> Any:
    """One request on a DEALER of its own; the reply, or AssertionError without one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(url)
    try:
        sock.send(proto.encode(msg))
        assert sock.poll(int(timeout_s * 1000)), f"no reply to {msg!r} in {timeout_s}s"
        return proto.decode_reply(sock.recv())
    finally:
        sock.close(0)
        ctx.term()


def best(url: str, **kw: Any) -> proto.BestInstancesReply | proto.ErrorReply:
    if "tokens" in kw:
        kw["tokens"] = lwire.encode_tokens(kw["tokens"])
    return ask(url, proto.BestInstances(1, proto.PROTOCOL_VERSION, **kw))


def hits(reply: Any) -> list[tuple[str, int]]:
    assert isinstance(reply, proto.BestInstancesReply), reply
    return [(i.instance_id, i.hit_tokens) for i in reply.instances]


def index_hits(url: str, **kw: Any) -> list[tuple[str, int]] | None:
    """What the lookup-server's own index answers (None while it answers otherwise:
    an error, or from the controller)."""
    reply = best(url, **kw)
    if not isinstance(reply, proto.BestInstancesReply) or reply.source != "index":
        return None
    return hits(reply)


def controller_prefix_counts(controller: ControllerProcess) -> float:
    with urllib.request.urlopen(controller.http + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sample_sum(text, "kvmesh_controller_requests_total", op="prefix_counts")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lookup-index")
    controller = ControllerProcess(tmp, snapshot=True).start()
    service = eng = None
    try:
        service = LookupProcess(tmp, controller.url).start()
        eng = build_engine("inst-a", controller.url)
        # In sync is not enough: the engine's registration reaches the index in a push
        # that may come after the lookup-server is in sync.
        wait_for(
            lambda: (i := service.index())["in_sync"] and i["workers"] == 1,
            20,
            "the index in sync, with the engine",
        )
        yield controller, service, eng
    finally:
        if eng is not None:
            eng.close()
        if service is not None:
            assert service.stop() == 0, service.log_tail()
        controller.stop()


def test_best_instances_follow_an_admit_and_an_evict_from_the_index(mesh) -> None:
    controller, service, eng = mesh
    asked = controller_prefix_counts(controller)
    fallbacks = service.metric("kvmesh_lookup_controller_fallbacks_total", op="best")
    events = service.metric("kvmesh_lookup_index_events_total")
    assert hits(best(service.url, tokens=PROMPT)) == [("inst-a", 0)]
    store(eng, PROMPT)
    wait_for(
        lambda: hits(best(service.url, tokens=PROMPT)) == [("inst-a", 32)], 10, "the admit seen"
    )
    reply = best(service.url, tokens=PROMPT[:16] + tokens(16, 4))
    assert hits(reply) == [("inst-a", 16)] and reply.source == "index"
    assert reply.instances[0].l1_tokens == 16
    eng.clear(PROMPT)  # removes its chunks: evict events
    wait_for(lambda: hits(best(service.url, tokens=PROMPT)) == [("inst-a", 0)], 10, "the evict")
    # Neither the controller's PrefixCounts nor a fallback to it answered any of these.
    assert controller_prefix_counts(controller) == asked
    assert service.metric("kvmesh_lookup_controller_fallbacks_total", op="best") == fallbacks
    assert service.metric("kvmesh_lookup_index_events_total") >= events + 8
    assert service.metric("kvmesh_lookup_index_answers_total", op="best") >= 4
    assert service.metric("kvmesh_lookup_index_in_sync") == 1
    assert service.metric("kvmesh_lookup_requests_total", op="best", outcome="ok") >= 4
    assert service.metric("kvmesh_lookup_request_seconds_count", op="best") >= 4
    health = json.loads(service.get("/healthz"))
    assert health["status"] == "ok" and health["index"]["workers"] == 1


def test_a_dead_controller_then_a_restarted_one(mesh) -> None:
    controller, service, eng = mesh
    store(eng, PROMPT)
    wait_for(lambda: hits(best(service.url, tokens=PROMPT)) == [("inst-a", 32)], 10, "stored")
    epoch = service.index()["epoch"]
    restarts = service.metric("kvmesh_lookup_index_resyncs_total", reason="restart")
    controller.stop()
    # Fresh a moment ago: still answered, from the index (or, on a very slow machine,
    # already UNAVAILABLE), within the deadline either way.
    t0 = time.monotonic()
    reply = best(service.url, tokens=PROMPT)
    assert time.monotonic() - t0 < CONTROLLER_TIMEOUT_S + 2.0
    if isinstance(reply, proto.BestInstancesReply):
        assert reply.source == "index" and hits(reply) == [("inst-a", 32)]
    else:
        assert reply.code == proto.ErrorCode.UNAVAILABLE
    # Past the staleness bound the index is not used: a clear error, never a hang.
    wait_for(lambda: not service.index()["in_sync"], STALENESS_S + 5, "the index out of sync")
    t0 = time.monotonic()
    reply = best(service.url, tokens=PROMPT)
    took = time.monotonic() - t0
    assert isinstance(reply, proto.ErrorReply) and reply.code == proto.ErrorCode.UNAVAILABLE
    assert reply.retryable and took < CONTROLLER_TIMEOUT_S + 2.0
    assert service.metric("kvmesh_lookup_index_in_sync") == 0
    assert service.metric("kvmesh_lookup_requests_total", op="best", outcome="unavailable") >= 1
    # Back (from its snapshot, on the same port): the lookup-server resyncs to the new
    # epoch and answers from the index again.
    controller.start()
    wait_for(lambda: service.index()["in_sync"], 20, "the index in sync again")
    assert service.index()["epoch"] != epoch
    assert service.metric("kvmesh_lookup_index_resyncs_total", reason="restart") == restarts + 1
    reply = best(service.url, tokens=PROMPT)
    assert hits(reply) == [("inst-a", 32)] and reply.source == "index"
    assert service.alive()


# -- against a stand-in controller ------------------------------------------------------------

NS = "0123456789abcdef"


def h(i: int) -> bytes:
    return bytes([i]) * 16


def packed(*chunks: int) -> bytes:
    ints = [(int.from_bytes(h(i)[8:], "big") ^ int(NS, 16)) & cproto.CHUNK_INT_MASK for i in chunks]
    return b"".join(k.to_bytes(8, "little") for k in ints)


WORKER = cproto.IndexWorker("a/0", "a", 0, 1, [NS])
HASHES = [h(i) for i in range(4)]


def test_gaps_epochs_malformed_frames_and_silence(tmp_path: Path) -> None:
    state = {"a/0": cproto.IndexWorkerState(WORKER, {"l1": packed(0, 1)})}
    with FakeController(state) as fake:
        service = LookupProcess(tmp_path, fake.url).start()
        try:

            def answer() -> list[tuple[str, int]] | None:
                return index_hits(service.url, hashes=HASHES)

            wait_for(lambda: answer() == [("a", 16)], 20, "the snapshot's two chunks")
            assert fake.subscribes == 1
            fake.push(lambda e, s: cproto.IndexEvents(0, e, s, "a/0", [(1, "l1", packed(2))]))
            wait_for(lambda: answer() == [("a", 24)], 10, "the pushed admit")
            # Frames that do not decode: counted, dropped, the index still in sync.
            fake.send_raw(b"\xc1 not msgpack")
            fake.send_raw(cproto.encode(cproto.HelloReply(0, 1, "x"))[:-3])
            wait_for(
                lambda: service.metric("kvmesh_lookup_index_malformed_total") == 2, 10, "counted"
            )
            assert answer() == [("a", 24)] and service.index()["in_sync"]
            assert service.metric("kvmesh_lookup_index_resyncs_total", reason="gap") == 0
            # A push lost on the way (seq skips one): subscribe again, from the snapshot.
            state["a/0"] = cproto.IndexWorkerState(WORKER, {"l1": packed(0, 1, 2, 3)})
            fake.push(
                lambda e, s: cproto.IndexEvents(0, e, s, "a/0", [(2, "l1", packed(0))]), skip=1
            )
            wait_for(lambda: fake.subscribes == 2, 10, "a second subscribe")
            wait_for(lambda: answer() == [("a", 32)], 10, "the new snapshot")
            assert service.metric("kvmesh_lookup_index_resyncs_total", reason="gap") == 1
            # A controller that restarted (new epoch, forgot us): its ping answer says so.
            fake.restart()
            wait_for(lambda: fake.subscribes == 3, 10, "a subscribe after the restart")
            assert service.metric("kvmesh_lookup_index_resyncs_total", reason="restart") == 1
            wait_for(lambda: answer() == [("a", 32)], 10, "in sync after the restart")
            # Silent: out of sync past the staleness bound, then UNAVAILABLE in time.
            fake.silent = True
            wait_for(lambda: not service.index()["in_sync"], STALENESS_S + 5, "out of sync")
            t0 = time.monotonic()
            reply = best(service.url, hashes=HASHES)
            assert isinstance(reply, proto.ErrorReply)
            assert reply.code == proto.ErrorCode.UNAVAILABLE
            assert time.monotonic() - t0 < CONTROLLER_TIMEOUT_S + 2.0
            fallbacks = service.metric("kvmesh_lookup_controller_fallbacks_total", op="best")
            assert fallbacks >= 1
            # Speaking again: pings confirm the same index, no resync needed.
            fake.silent = False
            wait_for(lambda: answer() == [("a", 32)], 10, "in sync again")
            assert fake.subscribes == 3
        finally:
            assert service.stop() == 0, service.log_tail()
