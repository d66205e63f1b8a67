"""The lookup-server (`kvmesh serve lookup`) against a real controller and real engines:
one engine in this process, one in a subprocess, each serving its lookup endpoint and
registering it with the controller.

Scheduler-facing lookups ask the instance's workers (and they pin what they counted);
router-facing best_instances ranks instances from the controller's registry; a rank
that does not answer makes a lookup 0 within the deadline; malformed, unknown and
wrong-version messages get error replies and the service stays up; a controller that
is down is an UNAVAILABLE reply, not a hang.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import msgspec
import pytest
import zmq
from kvtest.controller import ControllerProcess, build_engine, store, tokens
from kvtest.remote import free_port
from kvtest.service_process import KvmeshService, KvtestProcess
from kvtest.waiting import wait_for

from kvmesh.common.protocol import controller as cproto
from kvmesh.common.protocol import lookup_service as proto
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.common.transport.lookup_service_client import (
    LookupServiceClient,
    LookupServiceError,
)
from kvmesh.services.worker.lookup_server import attach_lookup_server

CHUNK = 8
WORKER_TIMEOUT_S = 0.5
PROMPT = tokens(32, 1)  # 4 chunks of 8


class LookupProcess(KvmeshService):
    """`kvmesh serve lookup` in a subprocess."""

    def __init__(self, workdir: Path, controller_url: str) -> None:
        options = {
            "controller-url": controller_url,
            "chunk-size": CHUNK,
            "worker-timeout-s": WORKER_TIMEOUT_S,
            "controller-timeout-s": 1.0,
        }
        super().__init__("lookup", workdir, free_port(), options)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Self:
        super().start(timeout)
        assert self.ready_info == {"pid": self.proc.pid, "port": self.port}
        return self


class WorkerProcess(KvtestProcess):
    """kvtest.lookup_worker: an engine with a lookup endpoint in its own process."""

    def __init__(self, controller: ControllerProcess, instance: str, n: int) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        super().__init__(
            f"worker {instance}",
            "lookup_worker",
            [controller.url, instance, self.endpoint, "1", "32", str(n)],
            log=controller.workdir / f"worker-{instance}.log",
            ready_line='{"endpoint"',
            stop_grace_s=20.0,
        )
        self.keys = self.start(60.0).ready_info["keys"]


def lookup_service(url: str, fn, timeout_s: float = 10.0):
    async def main():
        async with LookupServiceClient(url, timeout_s=timeout_s, name="test") as client:
            return await fn(client)

    return asyncio.run(main())


def controller_workers(url: str) -> dict[str, cproto.WorkerInfo]:
    async def main():
        conn = ControllerConnection(url, timeout_s=5.0, client="test")
        try:
            await conn.connect()
            reply = await conn.request(cproto.ListWorkers(conn.next_rid()), cproto.ListWorkersReply)
        finally:
            await conn.close()
        return {w.worker_id: w for w in reply.workers}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A controller, the lookup-server, engine A here (all 4 chunks of PROMPT) and
    engine B in a subprocess (its first 2 chunks)."""
    tmp = tmp_path_factory.mktemp("lookup")
    controller = ControllerProcess(tmp, snapshot=False).start()
    service = worker_b = eng_a = None
    try:
        service = LookupProcess(tmp, controller.url).start()
        eng_a = build_engine("inst-a", controller.url)
        attach_lookup_server(eng_a, f"tcp://127.0.0.1:{free_port()}")
        store(eng_a, PROMPT)
        worker_b = WorkerProcess(controller, "inst-b", 16)

        def registered() -> bool:
            ws = controller_workers(controller.url)
            a, b = ws.get("inst-a/0"), ws.get("inst-b/0")
            return bool(
                a and b and a.lookup_endpoint == eng_a.lookup_endpoint
                and b.lookup_endpoint == worker_b.endpoint
                and a.chunks.get("l1") == 4 and b.chunks.get("l1") == 2
            )  # fmt: skip

        wait_for(registered, 20, "both workers registered with their lookup endpoints")

        def indexed() -> bool:
            # The lookup-server's copy of the registry is a push behind the controller.
            hits = lookup_service(service.url, lambda c: c.best_instances(PROMPT))
            return {(h.instance_id, h.hit_tokens) for h in hits} == {("inst-a", 32), ("inst-b", 16)}

        wait_for(indexed, 20, "both workers' chunks in the lookup-server's index")
        yield controller, service, eng_a, worker_b
    finally:
        if worker_b is not None:
            worker_b.stop()
        if eng_a is not None:
            eng_a.close()
        if service is not None:
            assert service.stop() == 0, service.log.read_text()[-2000:]
        controller.stop()


def test_lookup_asks_the_instance_workers_and_they_pin(mesh) -> None:
    _, service, eng_a, worker_b = mesh

    async def scenario(c: LookupServiceClient):
        hello = await c.hello()
        a = await c.lookup("inst-a", PROMPT, lookup_id="q-a", pin=True)
        pinned = "q-a" in eng_a.pins
        released = await c.release("inst-a", "q-a")
        b = await c.lookup("inst-b", PROMPT, lookup_id="q-b", pin=True)
        other = await c.lookup("inst-a", tokens(32, 7), lookup_id="q-o", pin=True)
        by_hash = await c.lookup("inst-a", hashes=[bytes.fromhex(k[17:]) for k in worker_b.keys])
        return hello, a, pinned, released, b, other, by_hash

    hello, a, pinned, released, b, other, by_hash = lookup_service(service.url, scenario)
    assert hello.chunk_size == CHUNK and hello.version == proto.PROTOCOL_VERSION
    assert (a.hit_tokens, a.per_rank, a.l1_tokens, a.source) == (32, [32], 32, "workers")
    assert pinned  # the worker pinned what it counted, under the scheduler's id
    assert released.ranks == 1
    wait_for(lambda: "q-a" not in eng_a.pins, 5, "A's pins released")
    assert (b.hit_tokens, b.per_rank) == (16, [16])
    assert (other.hit_tokens, other.per_rank) == (0, [0])
    # By chunk hashes (B's two): answered from the registry (the lookup-server's copy
    # once in sync, else the controller's), no pins.
    assert (by_hash.hit_tokens, by_hash.per_rank) == (16, [])
    assert by_hash.source in ("index", "controller")


def test_best_instances_ranks_by_cached_prefix(mesh) -> None:
    service = mesh[1]

    async def scenario(c: LookupServiceClient):
        return (
            await c.best_instances(PROMPT),
            await c.best_instances(PROMPT, limit=1),
            await c.best_instances(PROMPT[:8] + tokens(24, 9)),
        )

    ranked, top, short = lookup_service(service.url, scenario)
    assert [(i.instance_id, i.hit_tokens, i.l1_tokens) for i in ranked] == [
        ("inst-a", 32, 32),
        ("inst-b", 16, 16),
    ]
    assert [i.instance_id for i in top] == ["inst-a"]
    assert [(i.instance_id, i.hit_tokens) for i in short] == [("inst-a", 8), ("inst-b", 8)]


def test_unknown_instance_and_silent_rank(mesh) -> None:
    service, worker_b = mesh[1], mesh[3]

    async def unknown(c: LookupServiceClient):
        with pytest.raises(LookupServiceError) as err:
            await c.lookup("nobody", PROMPT)
        return err.value.code

    assert lookup_service(service.url, unknown) == proto.ErrorCode.UNKNOWN_INSTANCE
    # A stopped worker process does not answer: 0 hits, within about the deadline.
    lookup_service(service.url, lambda c: c.lookup("inst-b", PROMPT))  # fresh worker list
    worker_b.proc.send_signal(signal.SIGSTOP)
    try:

        async def silent(c: LookupServiceClient):
            t0 = time.monotonic()
            try:
                reply = await c.lookup("inst-b", PROMPT, lookup_id="q-s", pin=True)
            except LookupServiceError as exc:  # dropped by the controller meanwhile
                assert exc.code == proto.ErrorCode.UNKNOWN_INSTANCE
                reply = None
            return reply, time.monotonic() - t0

        reply, took = lookup_service(service.url, silent)
    finally:
        worker_b.proc.send_signal(signal.SIGCONT)
    assert reply is None or (reply.hit_tokens, reply.per_rank) == (0, [-1])
    assert took < WORKER_TIMEOUT_S + 3.0
    # Back: it re-registers (if it was dropped) and answers again.

    def answers() -> bool:
        try:
            reply = lookup_service(service.url, lambda c: c.lookup("inst-b", PROMPT))
        except LookupServiceError:
            return False  # dropped and not registered again yet
        return reply.hit_tokens == 16

    wait_for(answers, 20, "B answering again")


def _raw_ask(url: str, frames: list[bytes]) -> proto.ErrorReply | proto.Reply:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(url)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), f"no reply to {frames!r}"
        return proto.decode_reply(sock.recv())
    finally:
        sock.close(0)
        ctx.term()


def test_malformed_messages_get_error_replies_and_the_service_stays_up(mesh) -> None:
    controller, service = mesh[0], mesh[1]
    enc = msgspec.msgpack.encode
    v = proto.PROTOCOL_VERSION
    cases = [
        ([b"\xc1garbage"], proto.ErrorCode.BAD_MESSAGE, 0),
        ([enc(["no_such_op", 5, v])], proto.ErrorCode.UNKNOWN_MESSAGE, 5),
        ([proto.encode(proto.Hello(7, v + 1))], proto.ErrorCode.VERSION_MISMATCH, 7),
        ([enc(["lookup", 8, v])], proto.ErrorCode.BAD_MESSAGE, 8),  # truncated
        (
            [proto.encode(proto.Lookup(9, v, "inst-a", "x", b"\x01\x02\x03"))],
            proto.ErrorCode.BAD_TOKENS,
            9,
        ),
        (
            [proto.encode(proto.BestInstances(10, v, hashes=[b"short"]))],
            proto.ErrorCode.BAD_TOKENS,
            10,
        ),
        ([proto.encode(proto.Lookup(11, v, ""))], proto.ErrorCode.BAD_MESSAGE, 11),
        ([proto.encode(proto.Hello(12, v)), b"extra"], proto.ErrorCode.BAD_MESSAGE, 0),
    ]
    for frames, code, rid in cases:
        reply = _raw_ask(service.url, frames)
        assert isinstance(reply, proto.ErrorReply), (frames, reply)
        assert (reply.code, reply.rid) == (int(code), rid), (frames, reply)
    assert service.alive()
    hello = _raw_ask(service.url, [proto.encode(proto.Hello(13, v))])
    assert isinstance(hello, proto.HelloReply) and hello.rid == 13
    # The controller's new request validates too.
    bad = _raw_controller(controller.url, cproto.PrefixCounts(3, [b"x" * 15]))
    assert isinstance(bad, cproto.ErrorReply) and bad.code == cproto.ErrorCode.BAD_REQUEST


def _raw_controller(url: str, msg) -> cproto.Reply:
    async def main():
        conn = ControllerConnection(url, timeout_s=5.0, client="test")
        try:
            await conn.connect()
            fut = asyncio.get_running_loop().create_future()
            conn._pending[msg.rid] = fut
            conn.send(msg)
            return await asyncio.wait_for(fut, 5)
        finally:
            await conn.close()

    return asyncio.run(main())


def test_admin_lookup_cli(mesh, tmp_path: Path) -> None:
    service = mesh[1]
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    cli = [sys.executable, "-m", "kvmesh.services.cli.main", "admin", "--json", "lookup"]
    cli += ["--lookup-url", service.url]
    one = subprocess.run(
        [*cli, "--instance", "inst-b", str(prompt)], capture_output=True, text=True, timeout=120
    )
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["hit_tokens"] == 16
    best = subprocess.run([*cli, str(prompt)], capture_output=True, text=True, timeout=120)
    assert best.returncode == 0, best.stderr
    assert [i["instance_id"] for i in json.loads(best.stdout)] == ["inst-a", "inst-b"]
    # A range of ids nobody cached, and an unknown instance (exit 1).
    none = subprocess.run([*cli, "0:64"], capture_output=True, text=True, timeout=120)
    assert none.returncode == 0 and all(i["hit_tokens"] == 0 for i in json.loads(none.stdout))
    unknown = subprocess.run(
        [*cli, "--instance", "zz", "0:64"], capture_output=True, text=True, timeout=120
    )
    assert unknown.returncode == 1 and "no worker" in unknown.stderr


def test_controller_down_is_an_unavailable_reply(tmp_path: Path) -> None:
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    service = LookupProcess(tmp_path, controller.url).start()
    try:
        assert lookup_service(service.url, lambda c: c.best_instances(PROMPT)) == []
        controller.stop()

        async def down(c: LookupServiceClient):
            # Answered from the lookup-server's copy of the registry while that is
            # fresh (lookup.index_max_staleness_s), then UNAVAILABLE; never a hang.
            give_up = time.monotonic() + 10.0
            while True:
                t0 = time.monotonic()
                try:
                    assert await c.best_instances(PROMPT) == []
                except LookupServiceError as exc:
                    return exc, time.monotonic() - t0
                assert time.monotonic() - t0 < 5.0 and time.monotonic() < give_up
                await asyncio.sleep(0.1)

        err, took = lookup_service(service.url, down)
        assert err.code == proto.ErrorCode.UNAVAILABLE and took < 5.0

        async def burst(c: LookupServiceClient) -> list[tuple[int, float]]:
            async def one() -> tuple[int, float]:
                t0 = time.monotonic()
                with pytest.raises(LookupServiceError) as exc:
                    await c.best_instances(PROMPT)
                return exc.value.code, time.monotonic() - t0

            return await asyncio.gather(*(one() for _ in range(8)))

        # A controller that did not answer is asked again by one request at a time, at
        # most every 0.5 s: the others do not each wait out the 1 s deadline.
        got = lookup_service(service.url, burst)
        assert {code for code, _ in got} == {proto.ErrorCode.UNAVAILABLE}
        assert sorted(t for _, t in got)[-2] < 0.5, got
        controller.start()  # same port: the service says hello again and answers

        def answered() -> bool:
            try:
                return lookup_service(service.url, lambda c: c.best_instances(PROMPT)) == []
            except LookupServiceError as exc:
                # Until the service asks the controller again (every 0.5 s at most).
                assert exc.code == proto.ErrorCode.UNAVAILABLE, exc
                return False

        wait_for(answered, 20, "answers after the controller restarted")
        assert service.alive()
    finally:
        assert service.stop() == 0, service.log.read_text()[-2000:]
        controller.stop()
