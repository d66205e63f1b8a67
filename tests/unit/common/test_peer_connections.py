"""PeerConnections' forgetting of peers: one whose connection a failure dropped is let
go (on_idle) after idle_s like an idle one, unless it is asked for again."""

from __future__ import annotations

import asyncio

from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.peer_conn import PeerConnections, PeerError

A, B = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


def sweep_after_drop(then_get: str) -> list[str]:
    async def main() -> list[str]:
        idle: list[str] = []
        conns = PeerConnections(idle_s=0.2, on_idle=idle.append)
        conns.get(A)
        assert conns.drop(A)
        await asyncio.sleep(0.3)  # past idle_s: the next get sweeps
        conns.get(then_get)
        conns.close()
        return idle

    return asyncio.run(main())


def test_a_dropped_peer_never_asked_for_again_is_let_go() -> None:
    """Only live connections were swept: a peer dropped after a failure kept what its
    owner held for it (a loaded NIXL agent) for the process's life."""
    assert sweep_after_drop(B) == [A]


def test_a_dropped_peer_dialled_again_is_not_let_go() -> None:
    assert sweep_after_drop(A) == []


def test_a_send_cut_by_its_connection_closing_is_a_peer_error() -> None:
    """A dead peer's connection has no pipe, so sends wait; one waiting when the broken
    connection was replaced (closed) was cancelled by zmq, and the CancelledError
    escaped the P2P tier's handling (no log, no count, the wrong miss reason)."""

    async def main() -> tuple[PeerError, BaseException]:
        conns = PeerConnections()
        a = conns.get(A)

        async def ask(timeout_s: float) -> BaseException:
            hello = proto.Hello(a.next_rid(), proto.PROTOCOL_VERSION, "x")
            try:
                await a.request(hello, timeout_s)
            except (PeerError, asyncio.CancelledError) as exc:
                return exc
            raise AssertionError("a dead address answered")

        first = asyncio.ensure_future(ask(0.3))
        second = asyncio.ensure_future(ask(5.0))
        late = await first
        assert conns.get(A) is not a  # the broken one is replaced, and closed
        cut = await asyncio.wait_for(second, 5)
        conns.close()
        assert isinstance(late, PeerError)
        return late, cut

    late, cut = asyncio.run(main())
    assert late.timed_out
    assert isinstance(cut, PeerError) and not cut.timed_out
