"""PeerConnections' forgetting of peers: one whose connection a failure dropped is let
go (on_idle) after idle_s like an idle one, unless it is asked for again."""

from __future__ import annotations

import asyncio

from kvmesh.common.transport.peer_conn import PeerConnections

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
