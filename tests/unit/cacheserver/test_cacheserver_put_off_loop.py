"""Large puts are checksummed on a thread (services/cacheserver/store.py,
checksums_off_loop): the handler runs as a task and the event loop serves others
meanwhile; the checks (a client's checksum that does not match) are the same as for a
put hashed inline."""

from __future__ import annotations

import asyncio
import os

import pytest
import xxhash
import zmq
from kvtest.cacheserver_handlers import handlers

from kvmesh.common.offload import OFFLOAD_FROM
from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.services.cacheserver.handlers import Handlers, RequestError
from kvmesh.services.cacheserver.store import MemoryStore

MiB = 1 << 20


def big_handlers() -> Handlers:
    return handlers(MemoryStore(max_memory=512 * MiB, max_value_size=128 * MiB))


def test_puts_of_large_values_run_as_tasks() -> None:
    h = big_handlers()
    big, small = zmq.Frame(bytes(OFFLOAD_FROM)), zmq.Frame(bytes(1024))
    assert h.suspends(proto.PutValue(1, "k"), [big])
    assert not h.suspends(proto.PutValue(1, "k"), [small])
    quarter = zmq.Frame(bytes(OFFLOAD_FROM // 4))
    assert h.suspends(proto.PutValues(1, ["a", "b", "c", "d"]), [quarter] * 4)
    assert not h.suspends(proto.PutValues(1, ["a", "b"]), [quarter] * 2)
    assert h.async_table[proto.PutValue] == h.aput


def test_the_loop_serves_while_a_large_put_is_hashed() -> None:
    h = big_handlers()
    value = os.urandom(64 * MiB)

    async def run() -> tuple[int, proto.PutValueReply]:
        ticks = 0
        put = asyncio.ensure_future(h.aput(proto.PutValue(1, "big"), [zmq.Frame(value)]))
        while not put.done():
            ticks += 1
            await asyncio.sleep(0)
        return ticks, (await put)[0]

    ticks, reply = asyncio.run(run())
    # Hashed on the loop, nothing else could run until the put returned.
    assert ticks > 10
    assert reply.checksum == xxhash.xxh3_64_intdigest(value)
    got, frames = h.get(proto.GetValue(2, "big"), [])
    assert got.found and got.checksum == reply.checksum
    assert bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]) == value


def test_a_large_put_with_a_wrong_checksum_is_refused() -> None:
    h = big_handlers()
    value = os.urandom(2 * MiB)
    good = xxhash.xxh3_64_intdigest(value)
    with pytest.raises(RequestError) as refused:
        asyncio.run(h.aput(proto.PutValue(1, "k", checksum=good ^ 1), [zmq.Frame(value)]))
    assert refused.value.code is ErrorCode.CHECKSUM_MISMATCH
    assert not h.get(proto.GetValue(2, "k"), [])[0].found
    msg = proto.PutValues(3, ["a", "b"], checksums=[good, good ^ 1])
    reply, _ = asyncio.run(h.aput_many(msg, [zmq.Frame(value), zmq.Frame(value)]))
    assert reply.errors == [0, int(ErrorCode.CHECKSUM_MISMATCH)]
    assert h.get(proto.GetValue(4, "a"), [])[0].found
    assert not h.get(proto.GetValue(5, "b"), [])[0].found
