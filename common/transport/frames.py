"""One ZMQ message off an asyncio socket, at most `max_frames` frames of it.

ZMQ bounds a frame's size (MAXMSGSIZE) but not how many frames a message has: a message
of a million empty frames is 2 MB on the wire, and received whole it holds the loop for
seconds and costs ~180 MB of frame objects before any check. `FrameReader` keeps the
first `max_frames` and reads the rest only to drop them, letting the loop run every
YIELD_EVERY frames; the caller answers such a message with an error. (The cache-server
and controller, which serve their ROUTER from the loop's selector, do the same in
common/transport/router_loop.py.)
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

YIELD_EVERY = 8192  # frames read between two turns of the loop, ~2-3 µs each


class FrameReader:
    def __init__(self, sock: zmq.asyncio.Socket, max_frames: int) -> None:
        self._sock = sock
        # The same socket, without futures: the frames after the first are already
        # here (ZMQ delivers a message whole), and a future for each costs ~10x more.
        self._sync = zmq.Socket.shadow(sock.underlying)
        self.max_frames = max(1, max_frames)

    async def recv(self) -> tuple[list[zmq.Frame], int]:
        """The next message's first max_frames frames (not copied), and how many more
        it had (read and dropped)."""
        frame = await self._sock.recv(copy=False)
        frames, dropped = [frame], 0
        more, sync = frame.more, self._sync
        n = 0
        while more:
            n += 1
            if n % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if len(frames) < self.max_frames:
                frame = sync.recv(zmq.NOBLOCK, copy=False)
                frames.append(frame)
                more = frame.more
            else:
                more = sync.recv(zmq.NOBLOCK, copy=False).more  # not copied: dropped
                dropped += 1
        return frames, dropped
