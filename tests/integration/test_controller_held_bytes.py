"""A worker's KV event batches held while its full state is applied are bounded by
their memory, not only by their count: each may fill a whole message (64 MiB), and
4096 of them would take the controller's memory. Past the bound they are dropped, the
worker is asked to resync once the state is in, and the overflow is counted."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from kvtest.bridge import parse_metrics
from kvtest.controller import ControllerProcess

from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import ControllerConnection

NS = "0123456789abcdef"
# ~52 MB encoded: the controller takes ~1 s to apply it (more with batches arriving).
STATE_KEYS = [f"{NS}-{i:032x}" for i in range(1_000_000)]
DROPPED = "events dropped while the full state was applied"


def metrics(srv: ControllerProcess) -> dict[str, float]:
    with urllib.request.urlopen(srv.http + "/metrics", timeout=5.0) as resp:
        return parse_metrics(resp.read().decode())


def peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) >> 10


def batch(key_chars: int) -> list[tuple[int, str, str]]:
    """A full batch of admits whose keys are key_chars long (no chunk keys: they are
    held all the same, and skipped when applied)."""
    return [(1, f"{i:08d}".rjust(key_chars, "k"), "l1") for i in range(proto.MAX_EVENTS_PER_BATCH)]


async def state_then_batches(
    srv: ControllerProcess, instance: str, events: list[tuple[int, str, str]], n: int
) -> tuple[list[str], int, int]:
    """Register, send the big full state and n batches right after it (so they arrive
    while it is applied), wait for it; the Resync reasons pushed, last_seq after, and
    the chunks the state's reply counts (held batches applied included)."""
    pushes: list[object] = []
    c = ControllerConnection(srv.url, timeout_s=10.0, on_push=pushes.append)
    await c.connect()
    try:
        reg = await c.request(
            proto.Register(c.next_rid(), instance, 0, 1, [NS], "tcp://x:9", 30.0),
            proto.RegisterReply,
        )
        wid = reg.worker_id
        state = proto.FullState(c.next_rid(), wid, 0, {"l1": STATE_KEYS})
        done = asyncio.ensure_future(c.request(state, proto.FullStateReply, deadline_s=60.0))
        await asyncio.sleep(0)  # sent first
        for i in range(n):
            assert c.send(proto.KVEventBatch(0, wid, 1 + i * len(events), events))
        chunks = (await done).chunks
        # A heartbeat answered means every batch before it on the connection is handled.
        await c.request(proto.Heartbeat(c.next_rid(), wid, 0), proto.HeartbeatReply)
        listed = await c.request(proto.ListWorkers(c.next_rid()), proto.ListWorkersReply)
        last_seq = next(w.last_seq for w in listed.workers if w.worker_id == wid)
        reasons = [p.reason for p in pushes if isinstance(p, proto.Resync)]
        if reasons:  # the worker's answer to it: a fresh state, then its events go on
            fresh = proto.FullState(c.next_rid(), wid, 7, {"l1": STATE_KEYS[:3]})
            assert (await c.request(fresh, proto.FullStateReply)).chunks == 3
            c.send(proto.KVEventBatch(0, wid, 8, [(2, STATE_KEYS[0], "l1")]))
            listed = await c.request(proto.ListWorkers(c.next_rid()), proto.ListWorkersReply)
            w = next(w for w in listed.workers if w.worker_id == wid)
            assert (w.chunks, w.last_seq) == ({"l1": 2}, 8)
        await c.request(proto.Deregister(c.next_rid(), wid), proto.DeregisterReply)
        return reasons, last_seq, chunks
    finally:
        await c.close()


@pytest.fixture
def controller(tmp_path: Path):
    srv = ControllerProcess(tmp_path, snapshot=False).start()
    yield srv
    assert srv.stop() == 0, srv.log_tail(2000)


def test_held_batches_overflow_by_bytes_long_before_their_count(controller) -> None:
    """8 batches of ~6.7 MiB each (~18 MiB decoded, ~140 MiB in all): far from 4096
    batches, past 64 MiB. They are dropped, a resync asked for once the state is in,
    and the overflow counted by its bound; nothing stays counted as held."""
    events = batch(100)
    assert len(proto.encode(events)) > 6 << 20
    reasons, last_seq, chunks = asyncio.run(state_then_batches(controller, "B", events, 8))
    assert reasons == [DROPPED] and chunks == len(STATE_KEYS)
    assert last_seq == 0  # the state's: none of the held batches was applied
    m = metrics(controller)
    assert m['kvmesh_controller_held_overflows_total{bound="bytes"}'] == 1
    assert m['kvmesh_controller_held_overflows_total{bound="batches"}'] == 0
    assert m["kvmesh_controller_held_event_bytes"] == 0


def test_a_few_small_batches_are_still_held_and_applied_after_the_state(controller) -> None:
    events = [(1, f"{NS}-{i:032x}", "l1") for i in range(2_000_000, 2_000_100)]
    reasons, last_seq, chunks = asyncio.run(state_then_batches(controller, "S", events, 5))
    # Held (not applied after the reply): the reply counts them.
    assert (reasons, last_seq, chunks) == ([], 500, len(STATE_KEYS) + 100)
    m = metrics(controller)
    assert sum(v for k, v in m.items() if "held_overflows_total{" in k) == 0
    assert m["kvmesh_controller_held_event_bytes"] == 0


def test_batches_flooding_a_full_state_leave_the_controller_memory_bounded(controller) -> None:
    """24 batches of ~33 MiB (~790 MiB encoded) during a full state: held, they took the
    controller from ~50 MiB to ~1.3 GiB; bounded, its peak is the state's own
    (~460 MiB), the batches adding at most the 64 MiB bound and one in decoding."""
    pid = controller.proc.pid
    before = peak_rss_mib(pid)
    events = batch(520)
    assert len(proto.encode(events)) > 32 << 20
    reasons, _, _ = asyncio.run(state_then_batches(controller, "F", events, 24))
    grown = peak_rss_mib(pid) - before
    assert grown < 750, f"controller peak RSS grew {grown} MiB"
    assert reasons == [DROPPED]
