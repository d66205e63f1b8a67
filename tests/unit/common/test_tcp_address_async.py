"""Resolving a bind host from a coroutine: the loop keeps running while the resolver
works, a resolver that does not answer ends at the deadline, and a name that does not
resolve is a clear error. The resolver (socket.getaddrinfo, the OS's) is patched to be
slow: a real slow DNS server is not something a test can count on."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from kvmesh.common.transport import tcp_address
from kvmesh.common.transport.tcp_address import UnresolvedHost, bind_host, bind_host_async

SLOW_S = 0.6


@pytest.fixture
def slow_resolver(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """socket.getaddrinfo, SLOW_S late; the names asked, from which thread."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def slow(host, *args, **kwargs):
        asked.append(threading.current_thread().name)
        time.sleep(SLOW_S)
        return real("localhost" if host == "slow.test" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    return asked


async def _ticks_while(coro) -> tuple[object, float]:
    """coro's result and the longest gap between 10 ms ticks of the loop meanwhile."""
    worst = 0.0
    stop = False

    async def tick() -> None:
        nonlocal worst
        last = time.monotonic()
        while not stop:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst, last = max(worst, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    try:
        result = await coro
    finally:
        stop = True
        await ticker
    return result, worst


def test_a_name_resolves_off_the_loop(slow_resolver: list[str]) -> None:
    result, worst = asyncio.run(_ticks_while(bind_host_async("slow.test")))
    assert result == "127.0.0.1"
    assert slow_resolver and slow_resolver[0] != threading.main_thread().name
    assert worst < SLOW_S / 2, f"the loop stood still {worst:.3f}s while resolving"


def test_addresses_and_wildcards_ask_no_resolver(slow_resolver: list[str]) -> None:
    async def all_of() -> list[str]:
        return [await bind_host_async(h) for h in ("", "*", "0.0.0.0", "10.1.2.3", "::1", "lo")]

    assert asyncio.run(all_of()) == ["*", "*", "*", "10.1.2.3", "[::1]", "lo"]
    # What it answers binds as it is: the sync path (bind_tcp) asks no resolver either.
    assert [bind_host(h) for h in ("10.1.2.3", "[::1]", "*")] == ["10.1.2.3", "[::1]", "*"]
    assert slow_resolver == []


def test_a_resolver_that_does_not_answer_ends_at_the_deadline(
    slow_resolver: list[str],
) -> None:
    t0 = time.monotonic()
    with pytest.raises(UnresolvedHost, match=r"'slow.test'.*did not answer within 0.1s"):
        asyncio.run(bind_host_async("slow.test", timeout_s=0.1))
    # asyncio.run waits for the resolver thread at its end; the caller does not.
    assert time.monotonic() - t0 < SLOW_S + 1.0


@pytest.mark.parametrize("resolve", ["sync", "async"])
def test_a_name_that_does_not_resolve_is_a_clear_error(
    resolve: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unknown(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(UnresolvedHost, match=r"bind host 'cache\.nowhere' does not resolve"):
        if resolve == "sync":
            bind_host("cache.nowhere")
        else:
            asyncio.run(bind_host_async("cache.nowhere"))


def test_the_deadline_is_below_a_service_start_wait() -> None:
    # P2PServer.start waits 10 s for its bind: the resolver's error must come first.
    assert tcp_address.RESOLVE_TIMEOUT_S < 10.0
