"""The lookup-server protocol: every message round-trips; malformed, unknown,
wrong-version and invalid requests decode to the right ErrorReply."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.common.protocol import lookup_service as proto
from kvmesh.common.protocol.lookup import encode_tokens
from kvmesh.common.protocol.lookup_service import ErrorCode

V = proto.PROTOCOL_VERSION
REQUESTS = [
    proto.Hello(1, V, "t"),
    proto.Lookup(2, V, "inst", "q", encode_tokens([1, 2, 3]), [], True, "tenant"),
    proto.Lookup(3, V, "inst", hashes=[b"\x02" * 16], pin=False),
    proto.Release(4, V, "inst", "q"),
    proto.BestInstances(5, V, encode_tokens(range(10)), limit=3),
]
REPLIES = [
    proto.HelloReply(1, V, "s", 256),
    proto.LookupReply(2, 512, [512, 768], 256, "workers"),
    proto.ReleaseReply(4, 2),
    proto.BestInstancesReply(5, [proto.InstanceHit("a", 512, 256, 2)]),
    proto.ErrorReply(6, 5, "no", False),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg) -> None:
    assert proto.decode_request(proto.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(msg) -> None:
    assert proto.decode_reply(proto.encode(msg)) == msg


enc = msgspec.msgpack.encode


@pytest.mark.parametrize(
    ("raw", "code", "rid"),
    [
        (b"", ErrorCode.BAD_MESSAGE, 0),
        (b"\xc1", ErrorCode.BAD_MESSAGE, 0),
        (enc(["what", 4, V]), ErrorCode.UNKNOWN_MESSAGE, 4),
        (enc(["hello", 5]), ErrorCode.BAD_MESSAGE, 5),  # truncated
        (enc(["hello", 6, V + 1]), ErrorCode.VERSION_MISMATCH, 6),
        (enc(["hello", -1, V]), ErrorCode.BAD_MESSAGE, 0),
        (proto.encode(proto.Lookup(7, V, "i", "q", b"\x00" * 5)), ErrorCode.BAD_TOKENS, 7),
        (
            proto.encode(proto.Lookup(8, V, "i", "", b"\x00" * 4, pin=True)),
            ErrorCode.BAD_MESSAGE,
            8,
        ),
        (
            proto.encode(proto.Lookup(9, V, "i", "q", b"\x00" * 4, [b"\x00" * 16])),
            ErrorCode.BAD_MESSAGE,
            9,
        ),
        (proto.encode(proto.BestInstances(10, V, hashes=[b"\x00" * 15])), ErrorCode.BAD_TOKENS, 10),
        (proto.encode(proto.BestInstances(11, V, limit=-1)), ErrorCode.BAD_MESSAGE, 11),
        (proto.encode(proto.Release(12, V, "i", "")), ErrorCode.BAD_MESSAGE, 12),
        (proto.encode(proto.Release(13, V, "i" * 300, "q")), ErrorCode.BAD_MESSAGE, 13),
    ],
)
def test_invalid_requests_get_error_replies(raw: bytes, code: ErrorCode, rid: int) -> None:
    with pytest.raises(proto.MalformedMessage) as err:
        proto.decode_request(raw)
    assert (err.value.reply.code, err.value.reply.rid) == (int(code), rid)
    assert err.value.reply.retryable is False
