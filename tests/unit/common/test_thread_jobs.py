"""map_all / map_all_async: every job has ended before the call returns or raises, the
jobs not started are cancelled once one fails, and the first failure is raised."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from kvmesh.common.thread_jobs import LazyPool, map_all, map_all_async


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as p:
        yield p


ITEMS = ["slow", "fail1", *["late"] * 20, "fail2"]


def _jobs() -> tuple[list[tuple[str, float]], object]:
    """(item, when it ended) of each job that ran, and fn: "slow" sleeps 0.3 s, "fail<n>"
    raises at once, "late" (queued behind the others) takes 20 ms."""
    log: list[tuple[str, float]] = []

    def fn(item: str) -> str:
        if item.startswith("fail"):
            raise ValueError(item)
        time.sleep(0.3 if item == "slow" else 0.02)
        log.append((item, time.monotonic()))
        return item.upper()

    return log, fn


def _check(log: list[tuple[str, float]], raised_at: float) -> None:
    assert "slow" in [item for item, _ in log], "the running job was not waited for"
    assert max(t for _, t in log) <= raised_at
    # The queued jobs were cancelled (a worker may take one or two before that).
    assert sum(item == "late" for item, _ in log) < 10


def test_map_all_waits_for_running_jobs_and_raises_the_first_failure(pool) -> None:
    log, fn = _jobs()
    assert map_all(pool, fn, ["a", "b", "c"]) == ["A", "B", "C"]
    log.clear()
    with pytest.raises(ValueError, match="fail1"):
        map_all(pool, fn, ITEMS)
    _check(log, time.monotonic())


def test_map_all_async_waits_for_running_jobs_and_raises_the_first_failure(pool) -> None:
    log, fn = _jobs()
    assert asyncio.run(map_all_async(pool, fn, ["a", "b"])) == ["A", "B"]
    log.clear()
    with pytest.raises(ValueError, match="fail1"):
        asyncio.run(map_all_async(pool, fn, ITEMS))
    _check(log, time.monotonic())


def test_a_cancelled_caller_waits_for_the_running_jobs(pool) -> None:
    log, fn = _jobs()

    async def main() -> None:
        task = asyncio.ensure_future(map_all_async(pool, fn, ["slow", "slow", *["late"] * 20]))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # a second cancel does not cut the wait short either
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [item for item, _ in log] == ["slow", "slow"]  # "late" never started
        assert max(t for _, t in log) <= time.monotonic()

    asyncio.run(main())


def test_lazy_pool_starts_once() -> None:
    made: list[int] = []

    def workers() -> int:
        made.append(1)
        return 2

    lazy = LazyPool(workers, "test-lazy")
    got: list[concurrent.futures.ThreadPoolExecutor] = []
    threads = [threading.Thread(target=lambda: got.append(lazy.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len({id(p) for p in got}) == 1
    got[0].shutdown()


def test_lazy_pool_is_made_again_in_a_forked_child() -> None:
    # A pool's threads do not survive a fork: the child's jobs would wait forever.
    import os

    lazy = LazyPool(lambda: 1, "test-fork")
    assert lazy.get().submit(lambda: 1).result(timeout=5) == 1
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its job ran
        try:
            ok = lazy.get().submit(lambda: 7).result(timeout=5) == 7
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lazy.get().shutdown()
