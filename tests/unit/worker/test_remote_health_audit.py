"""The remote tier's health monitor: one outage is one "down", however it is noticed."""

from __future__ import annotations

import asyncio

from kvmesh.services.worker.tiers.remote_health import HealthMonitor, describe


def test_requests_failing_during_a_ping_count_one_outage_not_two() -> None:
    changes: list[tuple[bool, str]] = []

    async def main() -> None:
        in_ping = asyncio.Event()
        release = asyncio.Event()
        pings = 0

        async def ping() -> None:
            nonlocal pings
            pings += 1
            if pings == 1:
                return  # the first answer marks it up
            in_ping.set()
            await release.wait()
            raise ConnectionError("gone")

        async def reconnect() -> None:
            if in_ping.is_set():
                raise ConnectionError("still gone")

        monitor = HealthMonitor(
            ping=ping,
            reconnect=reconnect,
            interval_s=0.01,
            timeout_s=1.0,
            failures_to_down=2,
            on_change=lambda up, why: changes.append((up, why)),
        )
        task = asyncio.create_task(monitor.run())
        await asyncio.wait_for(in_ping.wait(), 2)
        # Requests fail while the ping is out: they mark the store down first.
        monitor.failure("get: ConnectionError")
        monitor.failure("get: ConnectionError")
        assert not monitor.up
        release.set()  # then the ping fails too
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    downs = [why for up, why in changes if not up]
    # Was two: remote_state_changes_total{to="down"} counted every outage seen this way
    # twice, and the "remote store is down" warning was logged twice.
    assert len(downs) == 1, changes
    assert downs[0].startswith("2 failures in a row")


def test_describe_keeps_the_message_redis_py_leaves_out_of_repr() -> None:
    from redis.exceptions import AuthenticationError

    exc = AuthenticationError("invalid username-password pair")
    assert "invalid username-password pair" not in repr(exc)  # what the reasons held
    assert describe(exc) == "AuthenticationError: invalid username-password pair"
    assert describe(TimeoutError()) == "TimeoutError"
