"""The KV-event feed's protocol: payloads and replay messages round-trip, the payload is
a self-describing map (consumers in other languages), and malformed replay requests
decode to the right ErrorReply."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.protocol.kv_events import ErrorCode

V = kv.PROTOCOL_VERSION
NS = "0123456789abcdef"
KEY = f"{NS}-{'ab' * 16}"
PAYLOADS = [
    kv.EventBatch("e", 0, "i/0", "i", 1.5, [kv.KVEvent("stored", KEY, "l1")]),
    kv.EventBatch("e", 3, "i/0", "i", 1.5, [kv.KVEvent("removed", KEY, "disk")]),
    kv.WorkerState("e", 4, "i/0", "i", 2.0, []),
    kv.WorkerLeft("e", 5, "i/0", "i", 3.0, "dropped"),
]


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: type(p).__name__)
def test_payloads_round_trip_as_maps(payload) -> None:
    raw = kv.encode_payload(payload)
    assert kv.decode_payload(raw) == payload
    plain = msgspec.msgpack.decode(raw)
    assert plain["kind"] == payload.__struct_config__.tag
    assert plain["epoch"] == "e" and plain["worker_id"] == "i/0"
    if "events" in plain:
        assert all(isinstance(e, list) and len(e) == 3 for e in plain["events"])


def test_bad_payloads_and_seqs_raise() -> None:
    with pytest.raises(msgspec.ValidationError):
        kv.decode_payload(msgspec.msgpack.encode({"kind": "events", "epoch": "e"}))
    bad_op = msgspec.msgpack.encode(
        {
            "kind": "events",
            "epoch": "e",
            "prev_seq": 0,
            "worker_id": "w",
            "instance_id": "i",
            "ts": 0.0,
            "events": [["kept", KEY, "l1"]],
        }
    )
    with pytest.raises(msgspec.ValidationError):
        kv.decode_payload(bad_op)
    assert kv.decode_seq(kv.encode_seq(2**40 + 7)) == 2**40 + 7
    assert kv.encode_seq(1) == b"\x00" * 7 + b"\x01"  # big-endian
    with pytest.raises(ValueError):
        kv.decode_seq(b"\x01\x02")


@pytest.mark.parametrize(
    "msg",
    [
        kv.Hello(1, V, "t"),
        kv.Replay(2, V, 0),
        kv.Replay(3, V, 17, [NS], "epoch"),
    ],
    ids=repr,
)
def test_requests_round_trip(msg) -> None:
    assert kv.decode_request(kv.encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        kv.HelloReply(1, V, "e", 9),
        kv.ReplayBatch(2, "e", [kv.ReplayEntry(5, NS, b"\x80")]),
        kv.ReplayEnd(2, "e", 9, 1),
        kv.ErrorReply(3, ErrorCode.TOO_OLD, kv.TOO_OLD_MESSAGE),
    ],
    ids=lambda m: type(m).__name__,
)
def test_replies_round_trip(msg) -> None:
    assert kv.decode_reply(kv.encode(msg)) == msg


enc = msgspec.msgpack.encode


@pytest.mark.parametrize(
    ("raw", "code", "rid"),
    [
        (b"", ErrorCode.BAD_MESSAGE, 0),
        (b"\xc1", ErrorCode.BAD_MESSAGE, 0),
        (enc(["what", 4, V]), ErrorCode.UNKNOWN_MESSAGE, 4),
        (enc(["replay", 5, V]), ErrorCode.BAD_MESSAGE, 5),  # no since_seq
        (enc(["replay", 6, V + 1, 0]), ErrorCode.VERSION_MISMATCH, 6),
        (enc(["replay", 7, V, -1]), ErrorCode.BAD_MESSAGE, 7),
        (enc(["replay", 8, V, 0, ["ABCDEF0123456789"]]), ErrorCode.BAD_MESSAGE, 8),
        (enc(["replay", 9, V, 0, [NS] * (kv.MAX_REPLAY_NAMESPACES + 1)]), ErrorCode.BAD_MESSAGE, 9),
        (enc(["replay", 10, V, 0, [], "e" * 65]), ErrorCode.BAD_MESSAGE, 10),
    ],
)
def test_malformed_requests_get_their_error(raw: bytes, code: ErrorCode, rid: int) -> None:
    with pytest.raises(kv.MalformedMessage) as err:
        kv.decode_request(raw)
    assert (err.value.reply.code, err.value.reply.rid) == (code, rid)
