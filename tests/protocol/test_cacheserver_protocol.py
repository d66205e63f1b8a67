"""The cache-server's wire formats: kvmesh's msgspec headers and LMCache's lm:// framing.
Round trips, evolution (old reads new, new reads old), and what bad input maps to."""

from __future__ import annotations

import struct

import msgspec
import pytest

from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol import lmcache_lm as lm

REQUESTS = [
    proto.Hello(1, proto.PROTOCOL_VERSION, "me"),
    proto.PutValue(2, "k", b"meta", 123),
    proto.PutValue(3, "k"),
    proto.GetValue(4, "k"),
    proto.CheckValue(5, "k"),
    proto.DeleteValue(6, "k"),
    proto.PutValues(7, ["a", "b"], [b"", b"m"], [None, 5]),
    proto.GetValues(8, ["a", "b"]),
    proto.CheckValues(9, ["a"] * 1000),
    proto.DeleteValues(10, ["a"]),
    proto.ListKeys(11, "pre", "3:x", 50),
    proto.GetStats(12),
    proto.CheckHealth(13),
]
REPLIES = [
    proto.HelloReply(1, 1, "srv", 1 << 20, 4096),
    proto.PutValueReply(2, 2**64 - 1),
    proto.GetValueReply(4, True, b"m", 7),
    proto.GetValueReply(4, False),
    proto.CheckValueReply(5, True),
    proto.DeleteValueReply(6, False),
    proto.PutValuesReply(7, [0, 6]),
    proto.GetValuesReply(8, [True, False], [b"m", b""], [1, 0]),
    proto.CheckValuesReply(9, [True, False]),
    proto.DeleteValuesReply(10, [True]),
    proto.ListKeysReply(11, ["a"], ""),
    proto.GetStatsReply(12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1.5),
    proto.CheckHealthReply(13, True),
    proto.ErrorReply(14, int(proto.ErrorCode.NO_HELLO), "say hello", True),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg) -> None:
    assert proto.decode_request(proto.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(msg) -> None:
    assert proto.decode_reply(proto.encode(msg)) == msg


def test_requests_and_replies_never_cross() -> None:
    with pytest.raises(proto.MalformedMessage):
        proto.decode_reply(proto.encode(proto.GetValue(1, "k")))
    with pytest.raises(proto.MalformedMessage):
        proto.decode_request(proto.encode(proto.CheckValueReply(1, True)))


def test_old_reads_new_and_new_reads_old() -> None:
    """A future version may append fields with defaults: today's decoder ignores them,
    and a message without today's trailing defaults still decodes."""
    newer = msgspec.msgpack.encode(["get", 9, "key", "a field from the future", 42])
    assert proto.decode_request(newer) == proto.GetValue(9, "key")
    older = msgspec.msgpack.encode(["put", 3, "key"])
    assert proto.decode_request(older) == proto.PutValue(3, "key", b"", None)


def test_unknown_type_and_garbage_are_told_apart() -> None:
    unknown = msgspec.msgpack.encode(["frobnicate", 77, "x"])
    with pytest.raises(proto.MalformedMessage) as exc:
        proto.decode_request(unknown)
    err = exc.value.reply
    assert (err.code, err.rid) == (proto.ErrorCode.UNKNOWN_MESSAGE, 77)

    garbage = b"\xc1\xff\x00 not msgpack"
    with pytest.raises(proto.MalformedMessage) as exc2:
        proto.decode_request(garbage)
    err = exc2.value.reply
    assert (err.code, err.rid) == (proto.ErrorCode.BAD_MESSAGE, 0)

    bad_utf8 = b"\x93\xa3get\x07\xa2\xff\xfe"  # ["get", 7, <invalid UTF-8 str>]
    with pytest.raises(proto.MalformedMessage) as exc4:
        proto.decode_request(bad_utf8)
    err = exc4.value.reply
    assert err.code == proto.ErrorCode.BAD_MESSAGE

    wrong_field = msgspec.msgpack.encode(["get", 5, 12345])  # key must be a str
    with pytest.raises(proto.MalformedMessage) as exc3:
        proto.decode_request(wrong_field)
    err = exc3.value.reply
    assert (err.code, err.rid) == (proto.ErrorCode.BAD_MESSAGE, 5)


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("kvmesh:0123-ab", True),
        ("x" * proto.MAX_KEY_BYTES, True),
        ("x" * (proto.MAX_KEY_BYTES + 1), False),
        ("é" * (proto.MAX_KEY_BYTES // 2 + 1), False),  # too many bytes, not chars
        ("", False),
        ("a\x00b", False),
        ("line\nbreak", False),
    ],
)
def test_key_rules(key: str, ok: bool) -> None:
    assert proto.valid_key(key) is ok


def test_every_request_tag_is_known() -> None:
    assert {type(m).__struct_config__.tag for m in REQUESTS} == proto.REQUEST_TAGS


# -- lm:// ---------------------------------------------------------------------------------


def test_lm_request_layout_matches_the_protocol_facts() -> None:
    req = lm.LmRequest(int(lm.Command.PUT), 100, 1, 2, 1, (2, 3, 4, 0), "m@1@0@ab@half")
    raw = req.pack()
    assert len(raw) == lm.REQUEST_SIZE == 186
    assert struct.unpack_from("=9i", raw) == (1, 100, 1, 2, 1, 2, 3, 4, 0)
    assert raw[36:].rstrip(b" ") == b"m@1@0@ab@half"
    assert lm.parse_request(raw) == req


def test_lm_reply_has_location_last() -> None:
    reply = lm.LmReply(200, 64, 1, 2, (2, 3, 4, 0), 1)
    raw = reply.pack()
    assert len(raw) == lm.REPLY_SIZE == 36
    assert struct.unpack("=9i", raw) == (200, 64, 1, 2, 2, 3, 4, 0, 1)
    assert lm.parse_reply(raw) == reply


def test_lm_stored_meta_round_trips_into_the_get_reply() -> None:
    req = lm.LmRequest(1, 64, 3, 4, 1, (5, 6, 0, 0), "k")
    reply = lm.reply_from_meta(lm.meta_of(req), 64)
    assert (reply.code, reply.length, reply.fmt, reply.dtype) == (200, 64, 3, 4)
    assert (reply.shape, reply.location) == ((5, 6, 0, 0), 1)


@pytest.mark.parametrize(
    "raw",
    [
        struct.pack("=9i", 2, -1, 1, 2, 0, 0, 0, 0, 0) + b"k".ljust(150),  # negative length
        struct.pack("=9i", 2, 0, 1, 2, 0, 0, 0, 0, 0) + b" " * 150,  # empty key
        struct.pack("=9i", 2, 0, 1, 2, 0, 0, 0, 0, 0) + b"\xff\xfe".ljust(150),  # not UTF-8
        struct.pack("=9i", 2, 0, 1, 2, 0, 0, 0, 0, 0) + b"a\x01b".ljust(150),  # control char
    ],
    ids=["negative-length", "empty-key", "not-utf8", "control-char"],
)
def test_lm_bad_headers_are_frame_errors(raw: bytes) -> None:
    with pytest.raises(lm.LmFrameError):
        lm.parse_request(raw)


def test_lm_key_longer_than_150_bytes_cannot_be_sent() -> None:
    with pytest.raises(ValueError):
        lm.LmRequest(2, 0, 1, 2, 0, (0, 0, 0, 0), "k" * 151).pack()
