"""The cache-server data client looks the server's name up once per hello, within the
connect deadline, and never for a numeric address (common/transport/cacheserver_data_client.py)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kvmesh.common.transport import cacheserver_data_client as client
from kvmesh.common.transport.cacheserver_data_client import DataConnectError, DataConnections


@pytest.fixture
def lookups(monkeypatch):
    """Counts getaddrinfo calls on asyncio's loop; `hang` makes them never answer."""
    state = {"calls": 0, "hang": False}
    real = asyncio.base_events.BaseEventLoop.getaddrinfo

    async def counting(self, host, port, *args, **kwargs):
        state["calls"] += 1
        if state["hang"]:
            await asyncio.sleep(3600)
        return await real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "getaddrinfo", counting)
    return state


def test_a_name_is_looked_up_once(lookups) -> None:
    conns = DataConnections("localhost", 7623, b"t" * 16)

    async def twice():
        return await conns._address(), await conns._address()

    first, second = asyncio.run(twice())
    assert first == second and first[0] in (socket.AF_INET, socket.AF_INET6)
    assert first[1][1] == 7623
    assert lookups["calls"] == 1


@pytest.mark.parametrize(
    ("host", "family"), [("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)]
)
def test_a_numeric_address_is_never_looked_up(lookups, host: str, family: int) -> None:
    conns = DataConnections(host, 7623, b"t" * 16)
    assert asyncio.run(conns._address()) == (family, (host, 7623))
    assert lookups["calls"] == 0


def test_a_silent_resolver_costs_the_connect_deadline_and_is_asked_again(lookups) -> None:
    lookups["hang"] = True
    conns = DataConnections("kvmesh-cacheserver", 7623, b"t" * 16)
    for attempt in (1, 2):  # a failure is not remembered: the next get asks again
        t0 = time.monotonic()
        with pytest.raises(DataConnectError, match="resolving kvmesh-cacheserver"):
            asyncio.run(conns._address())
        assert time.monotonic() - t0 < client.CONNECT_TIMEOUT_S + 1.0
        assert lookups["calls"] == attempt
    lookups["hang"] = False
    conns.host = "localhost"
    assert asyncio.run(conns._address())[1][1] == 7623
