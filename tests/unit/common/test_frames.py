"""common/transport/frames.py: a message of more frames than a server takes is read to
its end with its surplus dropped, the loop running meanwhile, and the next message comes
whole."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from kvmesh.common.transport import frames as frames_mod
from kvmesh.common.transport.frames import FrameReader


async def test_frames_past_the_limit_are_dropped_while_the_loop_runs(monkeypatch) -> None:
    monkeypatch.setattr(frames_mod, "YIELD_EVERY", 1000)
    ctx = zmq.asyncio.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        reader = FrameReader(router, 3)  # routing id, header, one value
        await dealer.send_multipart([b"head", b"v1", *([b""] * 50_000)])
        await dealer.send_multipart([b"next", b"v2"])
        assert await router.poll(5000)  # here whole: what follows is the reading alone
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        got, dropped = await asyncio.wait_for(reader.recv(), 10)
        ticker.cancel()
        assert [bytes(f.buffer) for f in got[1:]] == [b"head", b"v1"] and dropped == 50_000
        assert ticks >= 10  # the loop ran between the batches of dropped frames
        got, dropped = await asyncio.wait_for(reader.recv(), 5)
        assert [bytes(f.buffer) for f in got[1:]] == [b"next", b"v2"] and dropped == 0
        # A message within the limit comes whole, and the socket still works after.
        await dealer.send_multipart([b"a"])
        got, dropped = await asyncio.wait_for(reader.recv(), 5)
        assert [bytes(f.buffer) for f in got[1:]] == [b"a"] and dropped == 0
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
