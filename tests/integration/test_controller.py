"""A real controller process with worker engines in this process and in others:
registration, KV events reaching the registry, P2P lookups (longest run, never the
asker, never a worker without a P2P endpoint), a kill -9'd worker dropped within three
heartbeat periods, a restarted controller back from its snapshot plus resyncs, a
sequence gap answered with a resync, admin fan-out with per-worker deadlines, the HTTP
API and the `kvmesh admin` CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvtest.controller import ControllerProcess, build_engine, store, tokens
from kvtest.prom import sample_sum
from kvtest.service_process import KvtestProcess
from kvtest.waiting import wait_for

from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import ControllerConnection, ControllerError

HEARTBEAT_S = 0.2


def http_get(srv: ControllerProcess, path: str):
    with urllib.request.urlopen(srv.http + path, timeout=5) as r:
        body = r.read()
    return json.loads(body) if path != "/metrics" else body.decode()


def http_post(srv: ControllerProcess, path: str, payload: object) -> tuple[int, dict]:
    req = urllib.request.Request(srv.http + path, data=json.dumps(payload).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def snapshots_written(srv: ControllerProcess) -> float:
    return sample_sum(http_get(srv, "/metrics"), "kvmesh_controller_snapshots_total")


def chunks_of(srv: ControllerProcess) -> dict[str, dict[str, int]]:
    return {w["worker_id"]: w["chunks"] for w in http_get(srv, "/workers")}


def keys_of(eng, toks):
    return [k for _, _, k in eng.chunks(toks)]


class WorkerProcess(KvtestProcess):
    """An engine in its own process (kvtest.controller_worker)."""

    def __init__(
        self, controller: ControllerProcess, instance: str, endpoint: str, seed: int, n: int = 32
    ) -> None:
        super().__init__(
            f"worker {instance}",
            "controller_worker",
            [controller.url, instance, endpoint, str(seed), str(n)],
            log=controller.workdir / f"worker-{instance}.log",
            ready_line='{"keys"',
        )
        self.keys = self.start(60.0).ready_info["keys"]


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    srv = ControllerProcess(tmp_path_factory.mktemp("ctl"), snapshot=False).start()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


def test_events_reach_the_registry_and_lookups_route_to_the_holder(controller) -> None:
    a = build_engine("A", controller.url, p2p_endpoint="tcp://127.0.0.1:1001")
    b = build_engine("B", controller.url, p2p_endpoint="tcp://127.0.0.1:1002")
    c = build_engine("C", controller.url)  # serves no peers
    try:
        toks = tokens(32, 1)
        assert len(store(a, toks)) == 4
        wait_for(lambda: chunks_of(controller).get("A/0") == {"l1": 4}, what="A's 4 admits")
        got = b.peer_locator.locate(keys_of(b, toks), 2.0)
        assert got is not None
        assert (got.instance_id, got.rank, got.endpoint, got.count) == (
            "A",
            0,
            "tcp://127.0.0.1:1001",
            4,
        )
        # The longest run from the first key: 2 held, then one nobody holds.
        other = keys_of(b, tokens(16, 99))
        mixed = keys_of(b, toks)[:2] + other[:1] + keys_of(b, toks)[2:]
        assert b.peer_locator.locate(mixed, 2.0).count == 2
        assert b.peer_locator.locate(other, 2.0) is None
        # Never the asker itself, even though it holds them.
        assert a.peer_locator.locate(keys_of(a, toks), 2.0) is None
        # A holder with no P2P endpoint is never named.
        toks_c = tokens(16, 2)
        store(c, toks_c)
        wait_for(lambda: chunks_of(controller).get("C/0") == {"l1": 2}, what="C's admits")
        assert b.peer_locator.locate(keys_of(b, toks_c), 2.0) is None
        # Evictions reach it too: remove A's chunks of the first 16 tokens.
        assert a.clear(toks[:16]) == 2
        wait_for(lambda: chunks_of(controller).get("A/0") == {"l1": 2}, what="A's evicts")
        assert b.peer_locator.locate(keys_of(b, toks), 2.0) is None
        assert b.peer_locator.locate(keys_of(b, toks)[2:], 2.0).count == 2
        # So does a whole tier cleared by the engine's own API (not the admin command,
        # which sends a full state after): its holders were listed for good.
        assert a.clear(tier="l1") == 2
        wait_for(lambda: chunks_of(controller).get("A/0") == {"l1": 0}, what="A's clear")
        assert b.peer_locator.locate(keys_of(b, toks)[2:], 2.0) is None
    finally:
        for eng in (a, b, c):
            eng.close()
    # A clean close deregisters: nothing of theirs is left.
    wait_for(lambda: not set(chunks_of(controller)) & {"A/0", "B/0", "C/0"}, what="deregistration")


def test_a_peer_lookup_keeps_near_its_deadline_while_the_engine_loop_is_busy(controller) -> None:
    """The P2P tier asks from vLLM's scheduler thread: with the engine's loop held (a
    long copy on it), the answer is a miss near the lookup's deadline, not half a
    second later (the old grace) with the scheduler stalled."""
    a = build_engine("A3", controller.url, p2p_endpoint="tcp://127.0.0.1:1005")
    b = build_engine("B3", controller.url, p2p_endpoint="tcp://127.0.0.1:1006")
    try:
        toks = tokens(32, 3)
        store(a, toks)
        wait_for(lambda: chunks_of(controller).get("A3/0") == {"l1": 4}, what="A3's admits")
        assert b.peer_locator.locate(keys_of(b, toks), 2.0).count == 4
        held = threading.Event()
        b.loop.call_soon(lambda: (held.set(), time.sleep(1.5)))
        assert held.wait(5.0)
        t0 = time.monotonic()
        assert b.peer_locator.locate(keys_of(b, toks), 0.05) is None
        took = time.monotonic() - t0
        assert took < 0.35, took
    finally:
        for eng in (a, b):
            eng.close()


def test_killed_worker_is_dropped_within_three_heartbeats(controller) -> None:
    b = build_engine("B2", controller.url, p2p_endpoint="tcp://127.0.0.1:1003")
    w = WorkerProcess(controller, "W", "tcp://127.0.0.1:1004", seed=7)
    try:
        toks = tokens(32, 7)
        assert [k.to_str() for k in keys_of(b, toks)] == w.keys
        wait_for(lambda: chunks_of(controller).get("W/0") == {"l1": 4}, what="W's admits")
        assert b.peer_locator.locate(keys_of(b, toks), 2.0).instance_id == "W"
        w.kill()
        t0 = time.monotonic()
        wait_for(lambda: "W/0" not in chunks_of(controller), timeout=5.0, what="W dropped")
        took = time.monotonic() - t0
        # 3 periods after its last heartbeat (at most one period before the kill),
        # plus the controller's 0.1 s housekeeping tick and polling.
        assert took <= 3 * HEARTBEAT_S + 0.5, took
        for _ in range(20):
            assert b.peer_locator.locate(keys_of(b, toks), 2.0) is None
    finally:
        w.kill()
        b.close()


def test_sequence_gap_and_lost_events_ask_for_a_resync(controller) -> None:
    key = "0123456789abcdef-" + "cd" * 16

    async def main() -> None:
        pushes: asyncio.Queue = asyncio.Queue()
        c = ControllerConnection(controller.url, timeout_s=3.0, on_push=pushes.put_nowait)
        await c.connect()
        try:
            reg = await c.request(
                proto.Register(c.next_rid(), "G", 0, 1, [], "tcp://x:9", 5.0), proto.RegisterReply
            )
            c.send(proto.KVEventBatch(0, reg.worker_id, 1, [(1, key, "l1")]))
            c.send(proto.KVEventBatch(0, reg.worker_id, 5, [(1, key, "disk")]))  # 2..4 lost
            push = await asyncio.wait_for(pushes.get(), 3.0)
            assert isinstance(push, proto.Resync) and "gap" in push.reason
            full = await c.request(
                proto.FullState(c.next_rid(), reg.worker_id, 5, {"l1": [key], "disk": []}),
                proto.FullStateReply,
            )
            assert full.chunks == 1
            c.send(proto.KVEventBatch(0, reg.worker_id, 6, [(2, key, "l1")]))
            # A heartbeat naming events that never arrived also asks for a resync.
            hb = await c.request(
                proto.Heartbeat(c.next_rid(), reg.worker_id, 9), proto.HeartbeatReply
            )
            assert hb.resync
            assert isinstance(await asyncio.wait_for(pushes.get(), 3.0), proto.Resync)
            listed = await c.request(proto.ListWorkers(c.next_rid()), proto.ListWorkersReply)
            g = next(w for w in listed.workers if w.worker_id == "G/0")
            assert (g.chunks.get("l1"), g.last_seq) == (0, 6)
            await c.request(proto.Deregister(c.next_rid(), reg.worker_id), proto.DeregisterReply)
        finally:
            await c.close()

    asyncio.run(main())


def test_a_large_full_state_goes_in_steps_serving_lookups_and_keeping_later_events(
    controller,
) -> None:
    """200k keys take the controller ~0.5-1 s to parse: it answers other requests
    meanwhile (a lookup sent after the state is answered first, from the old state), a
    heartbeat meanwhile asks for no resync, and the batch sent after the state is
    applied after it."""
    ns = "0123456789abcdef"
    keys = [f"{ns}-{i:032x}" for i in range(200_000)]
    extra = f"{ns}-{'ee' * 16}"

    async def main() -> None:
        pushes: list = []
        c = ControllerConnection(controller.url, timeout_s=10.0, on_push=pushes.append)
        q = ControllerConnection(controller.url, timeout_s=10.0)
        await c.connect()
        await q.connect()
        try:
            reg = await c.request(
                proto.Register(c.next_rid(), "S", 0, 1, [ns], "tcp://x:9", 5.0),
                proto.RegisterReply,
            )
            wid, order = reg.worker_id, []

            async def full_state() -> proto.FullStateReply:
                msg = proto.FullState(c.next_rid(), wid, 0, {"l1": keys})
                reply = await c.request(msg, proto.FullStateReply, deadline_s=30.0)
                order.append("full state")
                return reply

            task = asyncio.create_task(full_state())
            await asyncio.sleep(0)  # sent
            c.send(proto.KVEventBatch(0, wid, 1, [(2, keys[0], "l1"), (2, keys[1], "l1")]))
            c.send(proto.KVEventBatch(0, wid, 3, [(1, extra, "l1")]))
            hb = await c.request(proto.Heartbeat(c.next_rid(), wid, 3), proto.HeartbeatReply)
            during = await q.request(
                proto.P2PLookup(q.next_rid(), keys[2:6], "asker"), proto.P2PLookupReply
            )
            order.append("lookup")
            done = await task
            assert order == ["lookup", "full state"]
            assert not hb.resync and during.count == 0  # the old state: none yet
            assert done.chunks == 200_000 - 2 + 1
            after = await q.request(
                proto.P2PLookup(q.next_rid(), [*keys[2:6], extra], "asker"),
                proto.P2PLookupReply,
            )
            assert (after.instance_id, after.count) == ("S", 5)  # extra: admitted after it
            first = await q.request(
                proto.P2PLookup(q.next_rid(), keys[:3], "asker"), proto.P2PLookupReply
            )
            assert first.count == 0  # evicted after the state
            listed = await q.request(proto.ListWorkers(q.next_rid()), proto.ListWorkersReply)
            s = next(w for w in listed.workers if w.worker_id == wid)
            assert (s.chunks, s.last_seq) == ({"l1": 199_999}, 3)
            assert not [p for p in pushes if isinstance(p, proto.Resync)]
            await c.request(proto.Deregister(c.next_rid(), wid), proto.DeregisterReply)
        finally:
            await c.close()
            await q.close()

    asyncio.run(main())


def test_register_with_a_namespace_that_is_no_id_is_refused(controller) -> None:
    ns = "0123456789abcdef"
    chunk = bytes.fromhex("ab" * 16)
    key = f"{ns}-{chunk.hex()}"

    async def main() -> None:
        c = ControllerConnection(controller.url, timeout_s=3.0)
        await c.connect()
        try:
            for bad in (["ns"], ["0123456789ABCDEF"], [ns + "0"], [ns] * 65):
                with pytest.raises(ControllerError) as refused:
                    await c.request(
                        proto.Register(c.next_rid(), "NS", 0, 1, bad, "", 5.0), proto.RegisterReply
                    )
                assert refused.value.code == proto.ErrorCode.BAD_REQUEST
                assert "namespaces" in str(refused.value)
            # The refusals left nothing behind that breaks prefix counts for others.
            reg = await c.request(
                proto.Register(c.next_rid(), "NS", 0, 1, [ns], "", 5.0), proto.RegisterReply
            )
            c.send(proto.KVEventBatch(0, reg.worker_id, 1, [(1, key, "l1")]))

            async def counted() -> list:
                reply = await c.request(
                    proto.PrefixCounts(c.next_rid(), [chunk]), proto.PrefixCountsReply
                )
                return [(i.instance_id, i.chunks) for i in reply.instances]

            for _ in range(50):
                if ("NS", 1) in await counted():
                    break
                await asyncio.sleep(0.05)
            assert ("NS", 1) in await counted()
            await c.request(proto.Deregister(c.next_rid(), reg.worker_id), proto.DeregisterReply)
        finally:
            await c.close()

    asyncio.run(main())


def test_admin_fan_out_http_api_and_cli(controller) -> None:
    a = build_engine("FA", controller.url, p2p_endpoint="tcp://127.0.0.1:1005")
    b = build_engine("FB", controller.url)

    async def silent_worker() -> ControllerConnection:
        # Registered but never answers commands: its result must be a timeout.
        c = ControllerConnection(controller.url, timeout_s=3.0)
        await c.connect()
        await c.request(proto.Register(c.next_rid(), "FZ", 0, 1, [], "", 30.0), proto.RegisterReply)
        return c

    loop = asyncio.new_event_loop()
    z = loop.run_until_complete(silent_worker())
    try:
        keys_a = store(a, tokens(32, 11))
        store(b, tokens(24, 12))
        wait_for(lambda: chunks_of(controller).get("FB/0") == {"l1": 3}, what="FB's admits")
        assert http_get(controller, "/health")["status"] == "ok"
        instances = http_get(controller, "/instances")
        assert {"FA", "FB", "FZ"} <= set(instances) and instances["FA"][0]["p2p_endpoint"]
        assert "kvmesh_controller_kv_events_total" in http_get(controller, "/metrics")

        status, pinned = http_post(controller, "/pin", {"keys": keys_a[:2], "instance_id": "FA"})
        assert status == 200 and [
            (r["worker_id"], r["ok"], r["count"]) for r in pinned["results"]
        ] == [("FA/0", True, 2)]

        t0 = time.monotonic()
        status, cleared = http_post(controller, "/clear", {"event_id": "clear-1"})
        took = time.monotonic() - t0
        assert status == 200
        res = {r["worker_id"]: r for r in cleared["results"] if r["worker_id"].startswith("F")}
        assert (res["FA/0"]["ok"], res["FA/0"]["count"]) == (True, 2), res  # 2 of 4 were pinned
        assert (res["FB/0"]["ok"], res["FB/0"]["count"]) == (True, 3)
        assert (res["FZ/0"]["ok"], res["FZ/0"]["error"]) == (False, "timeout")
        assert 1.5 < took < 4.0, took  # bounded by the per-worker deadline (2 s)
        chunks = chunks_of(controller)
        assert chunks["FA/0"] == {"l1": 2} and chunks["FB/0"] == {}
        done = http_get(controller, "/events/clear-1")
        assert done["done"] and len(done["results"]) == len(cleared["results"])

        assert http_post(controller, "/pin", {"keys": "nope"})[0] == 400
        assert http_post(controller, "/nowhere", {})[0] == 404

        loop.run_until_complete(z.close())
        z = None
        cli = [
            sys.executable,
            "-m",
            "kvmesh.services.cli.main",
            "admin",
            "--url",
            controller.url,
            "--json",
        ]
        out = subprocess.run(
            [*cli, "health", "--instance", "FA"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        health = json.loads(out.stdout)["results"]
        assert [(r["worker_id"], r["detail"]["l1_chunks"]) for r in health] == [("FA/0", 2)]
        out = subprocess.run([*cli, "workers"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and {"FA/0", "FB/0"} <= {
            w["worker_id"] for w in json.loads(out.stdout)
        }
    finally:
        if z is not None:
            loop.run_until_complete(z.close())
        loop.close()
        a.close()
        b.close()


def test_restarted_controller_comes_back_from_snapshot_and_resync(tmp_path: Path) -> None:
    srv = ControllerProcess(tmp_path, snapshot=True).start()
    a = build_engine("RA", srv.url, p2p_endpoint="tcp://127.0.0.1:1006")
    w = WorkerProcess(srv, "RW", "tcp://127.0.0.1:1007", seed=21)
    try:
        store(a, tokens(16, 20))
        wait_for(lambda: chunks_of(srv) == {"RA/0": {"l1": 2}, "RW/0": {"l1": 4}}, what="admits")
        # A snapshot begun after the admits were seen is written: the one being written
        # now may have been packed before them. (A fixed wait of 0.7 s raced a loaded
        # controller's 0.5 s snapshot timer.)
        written = snapshots_written(srv)
        wait_for(lambda: snapshots_written(srv) >= written + 2, 10, "a snapshot with the admits")
        srv.kill()
        w.kill()  # RW dies with the controller: only the snapshot knows its chunks
        store(a, tokens(32, 22))  # events while the controller is down are lost
        srv.start()
        chunks = chunks_of(srv)
        assert chunks["RW/0"] == {"l1": 4}, chunks  # from the snapshot
        restored = {x["worker_id"]: x["restored"] for x in http_get(srv, "/workers")}
        assert restored["RW/0"] is True
        # RA re-registers and resends its full state: 2 + 4 chunks.
        wait_for(lambda: chunks_of(srv).get("RA/0") == {"l1": 6}, what="RA's resync")
        # The registry holds the full state before its reply reaches RA, and RA counts
        # the registration only once it has that reply.
        wait_for(lambda: a.controller_client.registrations >= 2, 5, "RA's registration counted")
        assert a.controller_client.registrations == 2
        # Lookups use the restored entry until RW misses its heartbeats, then never.
        keys = keys_of(a, tokens(32, 21))
        b = build_engine("RB", srv.url, p2p_endpoint="tcp://127.0.0.1:1008")
        try:
            wait_for(lambda: "RW/0" not in chunks_of(srv), timeout=8.0, what="RW dropped")
            assert b.peer_locator.locate(keys, 2.0) is None
            assert b.peer_locator.locate(keys_of(b, tokens(32, 22)), 2.0).instance_id == "RA"
        finally:
            b.close()
    finally:
        w.kill()
        a.close()
        assert srv.stop() == 0
