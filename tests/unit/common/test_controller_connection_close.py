"""ControllerConnection on a URL zmq refuses: connect() raises, and close() (which the
CLI calls in a `finally`) returns instead of waiting in the context's term() for the
socket connect() failed on."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from kvmesh.common.transport.controller_client import ControllerConnection


def _returns_within(seconds: float, fn) -> bool:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


@pytest.mark.parametrize("url", ["foo", "host:7600", "tcp://bad host:1"])
def test_close_after_a_refused_url_returns(url: str) -> None:
    raised: list[BaseException] = []

    async def main() -> None:
        conn = ControllerConnection(url, timeout_s=0.5)
        try:
            await conn.connect()
        except zmq.ZMQError as exc:
            raised.append(exc)
        finally:
            await conn.close()

    assert _returns_within(5.0, lambda: asyncio.run(main())), "close() hung"
    assert len(raised) == 1


def test_close_never_waits_for_another_socket_of_its_context() -> None:
    async def main() -> None:
        conn = ControllerConnection("tcp://127.0.0.1:1", timeout_s=0.5)
        await conn.connect(hello=False)
        conn._ctx.socket(zmq.DEALER)  # left open, as a failed connect() once did
        await conn.close()

    assert _returns_within(5.0, lambda: asyncio.run(main())), "close() hung in term()"
