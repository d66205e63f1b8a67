"""Audit of the lookup-server's index with real processes on loopback.

Against a stand-in controller: an event batch larger than a step goes in in steps
(the loop answers meanwhile), the pushes after it follow it, and the index ends up
exactly where the controller is, in sync, without a resync.

Against a real controller and two engines: a lookup-server started late (a follower
joining after the stores) answers like the one that saw every push, and an engine
that leaves is dropped from both at once: neither names it for chunks it no longer
serves.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq
from kvtest.controller import ControllerProcess, build_engine, store, tokens
from kvtest.fake_controller import FakeController
from kvtest.waiting import wait_for
from test_lookup_index import NS, WORKER, LookupProcess, best, h, hits, index_hits, packed

from kvmesh.common.chunk_holders import WALK_STEP, pack_ints
from kvmesh.common.protocol import controller as cproto
from kvmesh.common.protocol import lookup_service as proto

HASHES = [h(i) for i in range(6)]


def hello_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    """Hello round trips, one every few ms, until stop: how long the loop was held."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(url)
    rid = 0
    try:
        while not stop.is_set():
            rid += 1
            t0 = time.perf_counter()
            sock.send(proto.encode(proto.Hello(rid, proto.PROTOCOL_VERSION, "probe")))
            assert sock.poll(10_000), "no hello reply in 10 s"
            sock.recv()
            out.append(time.perf_counter() - t0)
            time.sleep(0.003)
    finally:
        sock.close(0)
        ctx.term()


def test_a_large_event_batch_goes_in_in_steps_and_the_pushes_after_it_follow(
    tmp_path: Path,
) -> None:
    state = {"a/0": cproto.IndexWorkerState(WORKER, {"l1": packed(0, 1)})}
    with FakeController(state) as fake:
        service = LookupProcess(tmp_path, fake.url).start()
        try:

            def answer() -> list[tuple[str, int]] | None:
                return index_hits(service.url, hashes=HASHES)

            wait_for(lambda: answer() == [("a", 16)], 20, "the snapshot's two chunks")
            # Chunks 2..5 inside a batch of 4 steps' worth of others, then 3 evicted
            # and (next push) back on disk, then 5 evicted.
            rng_ints = [
                (i * 0x9E3779B97F4A7C15) & cproto.CHUNK_INT_MASK for i in range(4 * WALK_STEP)
            ]
            filler = pack_ints(rng_ints)
            runs = [
                (1, "l1", filler[: 8 * WALK_STEP] + packed(2, 3, 4, 5) + filler[8 * WALK_STEP :]),
                (2, "l1", packed(3)),
            ]
            events = service.metric("kvmesh_lookup_index_events_total")
            lat: list[float] = []
            stop = threading.Event()
            probe = threading.Thread(target=hello_latencies, args=(service.url, stop, lat))
            probe.start()
            try:
                fake.push(lambda e, s: cproto.IndexEvents(0, e, s, "a/0", runs))
                fake.push(lambda e, s: cproto.IndexEvents(0, e, s, "a/0", [(1, "disk", packed(3))]))
                fake.push(lambda e, s: cproto.IndexEvents(0, e, s, "a/0", [(2, "l1", packed(5))]))
                wait_for(lambda: answer() == [("a", 40)], 20, "the batch and the pushes after it")
            finally:
                stop.set()
                probe.join()
            reply = best(service.url, hashes=HASHES)
            assert reply.instances[0].l1_tokens == 24  # 3 left l1
            index = service.index()
            assert index["in_sync"] and index["chunks"] == 2 + 4 + 4 * WALK_STEP - 1
            assert index["seq"] == 3
            total = 4 * WALK_STEP + 4 + 1 + 1 + 1
            assert service.metric("kvmesh_lookup_index_events_total") == events + total
            for reason in ("gap", "diverged", "restart"):
                assert service.metric("kvmesh_lookup_index_resyncs_total", reason=reason) == 0
            assert fake.subscribes == 1
            assert lat and max(lat) < 2.0, max(lat)  # answered all along (a loose bound)
        finally:
            assert service.stop() == 0, service.log_tail()


def test_a_late_lookup_server_agrees_and_a_leaving_engine_is_dropped_from_both(
    tmp_path: Path,
) -> None:
    controller = ControllerProcess(tmp_path, snapshot=True).start()
    early = late = eng_a = eng_b = None
    prompt = tokens(32, 11)
    try:
        early = LookupProcess(tmp_path, controller.url).start()
        eng_a = build_engine("inst-a", controller.url)
        eng_b = build_engine("inst-b", controller.url)
        store(eng_a, prompt)
        store(eng_b, prompt[:16])
        want = [("inst-a", 32), ("inst-b", 16)]

        def answer(service: LookupProcess) -> list[tuple[str, int]] | None:
            return index_hits(service.url, tokens=prompt)

        wait_for(lambda: answer(early) == want, 20, "the early server sees both stores")
        # Joining after every push it never saw: it starts from the snapshot.
        late = LookupProcess(tmp_path, controller.url).start()
        wait_for(lambda: answer(late) == want, 20, "the late server agrees")
        assert late.index()["workers"] == early.index()["workers"] == 2
        # An engine that leaves: named by neither, at once for both.
        eng_a.close()
        eng_a = None
        for service in (early, late):
            wait_for(lambda s=service: answer(s) == [("inst-b", 16)], 20, "inst-a dropped")
            assert service.index()["workers"] == 1
            assert service.metric("kvmesh_lookup_index_resyncs_total", reason="diverged") == 0
    finally:
        for eng in (eng_a, eng_b):
            if eng is not None:
                eng.close()
        for service in (early, late):
            if service is not None:
                assert service.stop() == 0, service.log_tail()
        controller.stop()


def test_the_namespace_is_the_engines(tmp_path: Path) -> None:
    """Keys pushed for another namespace than the worker's never count for it."""
    other = "fedcba9876543210"
    assert other != NS
    state = {"a/0": cproto.IndexWorkerState(WORKER, {"l1": packed(0, 1)})}
    with FakeController(state) as fake:
        service = LookupProcess(tmp_path, fake.url).start()
        try:
            wait_for(lambda: hits(best(service.url, hashes=HASHES)) == [("a", 16)], 20, "in sync")
            ints = [
                (int.from_bytes(h(i)[8:], "big") ^ int(other, 16)) & cproto.CHUNK_INT_MASK
                for i in range(2, 6)
            ]
            fake.push(lambda e, s: cproto.IndexEvents(0, e, s, "a/0", [(1, "l1", pack_ints(ints))]))
            fake.push(lambda e, s: cproto.IndexEvents(0, e, s, "a/0", [(1, "disk", packed(2))]))
            wait_for(lambda: hits(best(service.url, hashes=HASHES)) == [("a", 24)], 20, "chunk 2")
        finally:
            assert service.stop() == 0, service.log_tail()
