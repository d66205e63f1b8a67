"""The controller protocol: every message round-trips, and a real controller answers
malformed, truncated, unknown and wrong-version messages with error replies while it
keeps serving its other clients."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvtest.controller import ControllerProcess

from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.common.transport.controller_client import ControllerConnection, ControllerError

KEY = "0123456789abcdef-" + "ab" * 16

REQUESTS = [
    proto.Hello(1, proto.PROTOCOL_VERSION, "t"),
    proto.Register(2, "inst", 1, 2, ["0123456789abcdef"], "tcp://h:1", 0.5),
    proto.Deregister(3, "inst/1"),
    proto.Heartbeat(4, "inst/1", 99),
    proto.KVEventBatch(0, "inst/1", 7, [(1, KEY, "l1"), (2, KEY, "disk")]),
    proto.FullState(5, "inst/1", 9, {"l1": [KEY]}),
    proto.CommandReply(6, "inst/1", True, 3, "", {"l1_chunks": 3}),
    proto.P2PLookup(7, [KEY, KEY], "other"),
    proto.ListWorkers(8),
    proto.Clear(9, "ev", "inst", "l1"),
    proto.Pin(10, "ev", [KEY], "", True),
    proto.Health(11, "ev"),
    proto.Move(12, "ev", [KEY], "a", "b", True),
    proto.Compress(13, "ev", "a", "zstd"),
    proto.CheckFinish(14, "ev"),
    proto.PrefixCounts(15, [b"\x01" * 16], "inst"),
    proto.Register(16, "inst", 0, 1, [], "", 1.0, "tcp://h:2"),
    proto.Move(17, "ev", [], "a", "b", False, 30.0),
    proto.CommandReply(18, "b/0", False, 2, "1 of 3 chunks not copied", {"failed": 1}, [KEY]),
    proto.IndexSubscribe(19),
    proto.IndexPing(20, "epoch"),
]
REPLIES = [
    proto.HelloReply(1, 1, "c"),
    proto.RegisterReply(2, "inst/1"),
    proto.DeregisterReply(3, 5),
    proto.HeartbeatReply(4, True),
    proto.FullStateReply(5, 1),
    proto.P2PLookupReply(7, "a", 0, "tcp://h:1", 4),
    proto.ListWorkersReply(8, [proto.WorkerInfo("a/0", "a", 0, 1, "", {"l1": 2}, 5, 0.1, False)]),
    proto.AdminReply(9, "ev", True, [proto.WorkerResult("a/0", False, 0, "timeout")]),
    proto.ErrorReply(10, 1, "bad", False),
    proto.PrefixCountsReply(11, [proto.InstancePrefix("a", 2, 2, 3, 1)]),
    proto.IndexSnapshotReply(
        12,
        "ep",
        7,
        [
            proto.IndexWorkerState(
                proto.IndexWorker("a/0", "a", 0, 1, ["0123456789abcdef"], "", "tcp://h:2"),
                {"l1": bytes(16)},
            )
        ],
    ),
    proto.IndexTick(13, "ep", 7),
    # Pushes to index subscribers (rid 0).
    proto.WorkerJoined(
        0, "ep", 8, proto.IndexWorker("a/0", "a", 0, 1, ["0123456789abcdef"], "", "tcp://h:2")
    ),
    proto.WorkerLeft(0, "ep", 9, "a/0"),
    proto.WorkerReplaced(0, "ep", 10, "a/0", {"disk": bytes(8)}),
    proto.IndexEvents(0, "ep", 11, "a/0", [(1, "l1", bytes(8)), (2, "disk", bytes(24))]),
]


def test_old_register_and_worker_info_read_with_empty_lookup_endpoint() -> None:
    # What a version-1 worker without a lookup endpoint sends: 8 fields, not 9.
    old = msgspec.msgpack.encode(["register", 1, "i", 0, 1, [], "", 1.0])
    assert proto.decode_request(old).lookup_endpoint == ""


def test_move_messages_old_reads_new_and_new_reads_old() -> None:
    """Move, Command and CommandReply grew fields for copy/move (appended, with
    defaults): what an older peer sends still decodes, and an older decoder, which
    knows fewer fields, reads today's messages."""
    old_move = msgspec.msgpack.encode(["move", 1, "ev", [KEY], "a", "b", True])
    assert proto.decode_request(old_move) == proto.Move(1, "ev", [KEY], "a", "b", True, 0.0)
    old_reply = msgspec.msgpack.encode(["command_r", 2, "a/0", True, 3, "", {}])
    assert proto.decode_request(old_reply).keys == []
    old_cmd = msgspec.msgpack.encode(["command", 3, "ev", "clear", "", []])
    assert proto.decode_reply(old_cmd) == proto.Command(3, "ev", "clear", "", [], "", 0.0)

    class OldCommand(msgspec.Struct, tag="command", array_like=True):
        rid: int
        event_id: str
        op: str
        tier: str = ""
        keys: list[str] = []

    new = proto.encode(proto.Command(4, "ev", "fetch", "", [KEY], "tcp://h:1", 2.0))
    # An older worker reads the op and answers "fetch: unsupported"; it never sees a
    # clear, whatever it does not know.
    assert msgspec.msgpack.decode(new, type=OldCommand) == OldCommand(4, "ev", "fetch", "", [KEY])


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: m.__struct_config__.tag)
def test_requests_round_trip(msg) -> None:
    assert proto.decode_request(proto.encode(msg)) == msg


COMMANDS = [
    proto.Command(3, "e", "clear"),
    proto.Command(4, "e", "fetch", "", [KEY], "tcp://h:1", 1.5),
    proto.Command(5, "e", "remove", "", [KEY]),
]


@pytest.mark.parametrize("msg", [*REPLIES, proto.Resync(0, "a/0", "gap"), *COMMANDS])
def test_worker_inbound_round_trips(msg) -> None:
    assert proto.decode_reply(proto.encode(msg)) == msg


def test_decode_tells_unknown_from_malformed() -> None:
    unknown = msgspec.msgpack.encode(["bogus", 42, "x"])
    with pytest.raises(proto.MalformedMessage) as exc:
        proto.decode_request(unknown)
    err = exc.value.reply
    assert (err.code, err.rid) == (ErrorCode.UNKNOWN_MESSAGE, 42)
    truncated = proto.encode(REQUESTS[1])[:-3]
    with pytest.raises(proto.MalformedMessage) as exc:
        proto.decode_request(truncated)
    assert exc.value.reply.code == ErrorCode.BAD_MESSAGE


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    srv = ControllerProcess(tmp_path_factory.mktemp("ctlproto"), snapshot=False).start()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


async def _raw(url: str, frames: list[bytes], deadline_s: float = 3.0) -> proto.ErrorReply:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        await sock.send_multipart(frames)
        async with asyncio.timeout(deadline_s):
            raw = await sock.recv()
        return proto.decode_reply(raw)
    finally:
        sock.close(0)
        ctx.term()


BAD_INPUTS = {
    "garbage": ([b"\x00\xff\xfe not msgpack"], ErrorCode.BAD_MESSAGE),
    "truncated": ([proto.encode(REQUESTS[1])[:-4]], ErrorCode.BAD_MESSAGE),
    "unknown": ([msgspec.msgpack.encode(["bogus", 77])], ErrorCode.UNKNOWN_MESSAGE),
    "wrong_types": ([msgspec.msgpack.encode(["heartbeat", 5, 3, "x"])], ErrorCode.BAD_MESSAGE),
    "wrong_version": ([proto.encode(proto.Hello(6, 999))], ErrorCode.VERSION_MISMATCH),
    "no_hello": ([proto.encode(proto.ListWorkers(8))], ErrorCode.NO_HELLO),
    "two_frames": ([proto.encode(proto.ListWorkers(9)), b"extra"], ErrorCode.BAD_MESSAGE),
}


def test_bad_input_gets_error_replies_and_others_are_served(controller) -> None:
    async def main() -> None:
        good = ControllerConnection(controller.url, timeout_s=3.0)
        await good.connect()
        try:
            for name, (frames, code) in BAD_INPUTS.items():
                reply = await _raw(controller.url, frames)
                assert isinstance(reply, proto.ErrorReply), name
                assert reply.code == code, (name, reply)
                # The session opened before the bad input is still served.
                listed = await good.request(
                    proto.ListWorkers(good.next_rid()), proto.ListWorkersReply
                )
                assert listed.workers == []
            assert (
                await _raw(controller.url, [proto.encode(proto.Move(13, "e", [], "a", "b"))])
            ).code == ErrorCode.NO_HELLO
        finally:
            await good.close()
        assert controller.alive()

    asyncio.run(main())


def test_invalid_requests_of_a_session(controller) -> None:
    async def main() -> None:
        c = ControllerConnection(controller.url, timeout_s=3.0)
        await c.connect()
        try:

            async def code_of(msg) -> int:
                with pytest.raises(ControllerError) as exc:
                    await c.request(msg, proto.HelloReply)
                return exc.value.code

            assert (
                await code_of(proto.Heartbeat(c.next_rid(), "nobody/0", 1))
                == ErrorCode.NOT_REGISTERED
            )
            assert (
                await code_of(proto.Register(c.next_rid(), "", 0, 1, [])) == ErrorCode.BAD_REQUEST
            )
            assert (
                await code_of(proto.Register(c.next_rid(), "x", 2, 2, [])) == ErrorCode.BAD_REQUEST
            )
            # A heartbeat period that never ends keeps a gone worker forever (found by
            # tests/fuzz).
            for period in (float("nan"), float("inf"), 1e300, 0.0, -1.0):
                bad = proto.Register(c.next_rid(), "x", 0, 1, [], "", period)
                assert await code_of(bad) == ErrorCode.BAD_REQUEST, period
            too_many = [KEY] * (proto.MAX_LOOKUP_KEYS + 1)
            assert await code_of(proto.P2PLookup(c.next_rid(), too_many)) == ErrorCode.BAD_REQUEST
            # Unknown instances: refused as a whole, no worker asked.
            assert (
                await code_of(proto.Move(c.next_rid(), "e", [KEY], "a", "b"))
                == ErrorCode.BAD_REQUEST
            )
            assert (
                await code_of(proto.Move(c.next_rid(), "e", [], "a", "a", True))
                == ErrorCode.BAD_REQUEST
            )
            assert (
                await code_of(proto.Move(c.next_rid(), "", [], "a", "b", True))
                == ErrorCode.BAD_REQUEST
            )
            # compress: a codec and a tier it knows, a bounded deadline.
            for bad in (
                proto.Compress(c.next_rid(), "e", method="brotli"),
                proto.Compress(c.next_rid(), "e", tier="l1"),
                proto.Compress(c.next_rid(), "e", timeout_s=-1.0),
                proto.Compress(c.next_rid(), "", method="zstd"),
            ):
                assert await code_of(bad) == ErrorCode.BAD_REQUEST, bad
            assert await code_of(proto.CheckFinish(c.next_rid(), "never")) == ErrorCode.BAD_REQUEST
            # An unregistered worker's events are refused (it must register first).
            c.send(proto.KVEventBatch(c.next_rid(), "nobody/0", 1, [(1, KEY, "l1")]))
            # Bad chunk keys in a registered worker's batch are skipped, not fatal.
            reg = await c.request(
                proto.Register(c.next_rid(), "w", 0, 1, [], "tcp://x:1"), proto.RegisterReply
            )
            c.send(
                proto.KVEventBatch(0, reg.worker_id, 1, [(1, "not-a-key", "l1"), (1, KEY, "l1")])
            )
            found = await c.request(
                proto.P2PLookup(c.next_rid(), [KEY], "other"), proto.P2PLookupReply
            )
            assert (found.instance_id, found.count, found.endpoint) == ("w", 1, "tcp://x:1")
            assert (
                await c.request(proto.P2PLookup(c.next_rid(), ["bad"]), proto.P2PLookupReply)
            ).count == 0
        finally:
            await c.close()
        assert controller.alive()

    asyncio.run(main())


def test_compress_methods_are_the_codecs() -> None:
    from kvmesh.common.codecs import CODEC_TYPES

    assert set(proto.COMPRESS_METHODS) == {"none"} | {c.name for c in CODEC_TYPES.values()}
