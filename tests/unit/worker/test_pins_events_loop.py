"""LookupPins, KVEventBuffer and LoopThread on their own."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc

import pytest

from kvmesh.services.worker import pins as pins_module
from kvmesh.services.worker.events import KVEventBuffer, KVEventKind
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.pins import LookupPins


class Recorder:
    def __init__(self) -> None:
        self.unpinned: list[object] = []

    def __call__(self, keys) -> None:
        self.unpinned.extend(keys)


def test_release_unpins_once() -> None:
    rec = Recorder()
    pins = LookupPins(rec, timeout_s=60)
    pins.hold("a", ["k1", "k2"])
    assert "a" in pins
    assert pins.release("a") == 2
    assert pins.release("a") == 0
    assert rec.unpinned == ["k1", "k2"]


def test_reissued_lookup_releases_old_pins_and_keeps_new_deadline() -> None:
    rec = Recorder()
    pins = LookupPins(rec, timeout_s=0.2)
    pins.hold("a", ["old"])
    time.sleep(0.15)
    pins.hold("a", ["new"])
    assert rec.unpinned == ["old"]
    # The first deadline passed; the re-issued lookup's has not.
    assert pins.expire(time.monotonic() + 0.06) == 0
    assert "a" in pins
    assert pins.expire(time.monotonic() + 0.3) == 1
    assert rec.unpinned == ["old", "new"]


def test_expiry_and_release_all() -> None:
    rec = Recorder()
    pins = LookupPins(rec, timeout_s=10)
    pins.hold("a", ["x"])
    pins.hold("b", ["y"])
    assert pins.expire() == 0
    assert pins.expire(time.monotonic() + 11) == 2
    assert len(pins) == 0
    pins.hold("c", ["z"])
    pins.release_all()
    assert sorted(rec.unpinned) == ["x", "y", "z"]


def test_released_lookups_leave_nothing_behind() -> None:
    """Every request's lookup holds and its retrieve releases: a busy scheduler does
    that thousands of times a second, so nothing of a released lookup may stay until
    its deadline."""
    pins = LookupPins(Recorder(), timeout_s=3600)
    only_pins = [tracemalloc.Filter(True, pins_module.__file__)]
    tracemalloc.start()
    try:
        for i in range(50_000):
            pins.hold(f"req-{i}", ["k"])
            pins.release(f"req-{i}")
        held = tracemalloc.take_snapshot().filter_traces(only_pins)
    finally:
        tracemalloc.stop()
    assert len(pins) == 0
    assert sum(t.size for t in held.traces) < 64 * 1024


def test_event_buffer_sequence_and_bound() -> None:
    buf = KVEventBuffer(capacity=3)
    for i in range(5):
        buf.record(KVEventKind.STORED, f"k{i}", "l1")
    assert buf.dropped == 2
    events = buf.drain()
    assert [e.key for e in events] == ["k2", "k3", "k4"]
    assert [e.seq for e in events] == [3, 4, 5]
    assert buf.drain() == []


def test_loop_thread_closes_what_it_cannot_run() -> None:
    """A stopped loop (an engine closing) refuses work: the coroutine it was handed is
    closed, not left to warn "never awaited"."""
    lt = LoopThread()
    lt.stop()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="stopped"):
        lt.run(coro, timeout=1)
    assert coro.cr_frame is None  # closed


def test_loop_thread_runs_and_times_out() -> None:
    lt = LoopThread()
    try:
        assert lt.run(asyncio.sleep(0, result=7), timeout=1) == 7
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            lt.run(asyncio.sleep(5), timeout=0.1)
        assert time.monotonic() - started < 1

        # Work is done on the loop's own thread, not the caller's.
        async def where() -> str:
            return threading.current_thread().name

        assert lt.run(where(), timeout=1) != threading.current_thread().name
    finally:
        lt.stop()
    assert not lt.running
    with pytest.raises(RuntimeError):
        lt.run(asyncio.sleep(0), timeout=1)


def test_loop_thread_returns_a_result_that_was_there_at_the_timeout() -> None:
    """The coroutine returned before the deadline, but the loop was busy right after,
    so its future is marked done only after the caller's wait ended: the result (for a
    get, objects holding the caller's references) is returned, not dropped."""
    lt = LoopThread()

    async def op() -> list[str]:
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_soon(time.sleep, 0.4)  # busy right after
        return ["obj"]

    try:
        assert lt.run(op(), timeout=0.2) == ["obj"]
    finally:
        lt.stop()


def test_loop_thread_hands_a_result_after_the_timeout_to_orphan() -> None:
    """The caller gave up while the coroutine was still running; it then returned
    before the cancellation landed: its result goes to orphan, once."""
    lt = LoopThread()
    orphans: list[list[str]] = []

    async def op() -> list[str]:
        await asyncio.sleep(0.01)
        time.sleep(0.3)  # noqa: ASYNC251 -- the loop busy past the caller's deadline
        return ["obj"]

    async def fails() -> list[str]:
        await op()
        raise ValueError("late failure")

    try:
        with pytest.raises(TimeoutError):
            lt.run(op(), timeout=0.1, orphan=orphans.append)
        deadline = time.monotonic() + 5
        while not orphans and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orphans == [["obj"]]
        with pytest.raises(TimeoutError):
            lt.run(fails(), timeout=0.1, orphan=orphans.append)
        time.sleep(0.4)  # it has failed by now: nothing to hand over
        assert lt.run(asyncio.sleep(0, result=1), timeout=5, orphan=orphans.append) == 1
        assert orphans == [["obj"]]
    finally:
        lt.stop()
