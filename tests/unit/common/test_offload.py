"""common/offload.py: work on a thread, awaited; a caller cancelled meanwhile leaves the
thread to finish and hands what it used or made to `abandoned`."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.common import offload


async def test_the_result_and_the_error_reach_the_caller_from_another_thread() -> None:
    ran: list[int] = []

    def work(x: int) -> int:
        ran.append(threading.get_ident())
        return x * 2

    abandoned: list[object] = []
    assert await offload.offload(work, 21, abandoned=abandoned.append) == 42
    assert ran and ran[0] != threading.get_ident()

    def fail() -> None:
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        await offload.offload(fail, abandoned=abandoned.append)
    assert abandoned == []  # the caller had the outcome both times


async def test_a_cancelled_caller_leaves_the_outcome_to_abandoned_once_the_thread_ends() -> None:
    started, go = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        go.wait(5)
        return "buffer"

    abandoned: asyncio.Queue[asyncio.Future[str]] = asyncio.Queue()
    task = asyncio.ensure_future(offload.offload(work, abandoned=abandoned.put_nowait))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert abandoned.empty()  # the thread is still working: nothing to release yet
    go.set()
    fut = await asyncio.wait_for(abandoned.get(), 5)
    assert fut.result() == "buffer"


async def test_the_loop_serves_other_tasks_while_the_thread_works() -> None:
    # The thread waits for what only a task on the loop does (ten ticks): with the loop
    # held for the thread's wait, it would time out instead (a count of ticks in a fixed
    # time failed on a loaded machine).
    go = threading.Event()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while ticks < 10:
            ticks += 1
            await asyncio.sleep(0.001)
        go.set()

    ticker = asyncio.ensure_future(tick())
    assert await offload.offload(go.wait, 5) is True
    await ticker
    assert ticks == 10
