"""The data connection's framing (common/protocol/cacheserver_data.py): what a client
accepts from a server and what it sends."""

from __future__ import annotations

import pytest

from kvmesh.common.protocol import cacheserver_data as data
from kvmesh.common.protocol.cacheserver import MAX_KEY_BYTES, MAX_META_BYTES


def test_a_get_request_carries_the_keys_utf8_bytes() -> None:
    frame = data.pack_get("ns:é")
    op, n = data.REQUEST.unpack(frame[: data.REQUEST.size])
    assert (op, frame[data.REQUEST.size :]) == (data.OP_GET, "ns:é".encode())
    assert n == len("ns:é".encode())


@pytest.mark.parametrize("key", ["", "k" * (MAX_KEY_BYTES + 1)])
def test_keys_out_of_bounds_are_not_framed(key: str) -> None:
    with pytest.raises(data.DataFrameError):
        data.pack_get(key)


def test_replies_within_bounds_parse() -> None:
    head = data.REPLY.pack(data.FOUND, 10, 1 << 20, 123)
    assert data.parse_reply(head, 1 << 20) == (data.FOUND, 10, 1 << 20, 123)
    assert data.parse_reply(data.REPLY.pack(data.MISSING, 0, 0, 0), 1)[0] == data.MISSING


@pytest.mark.parametrize(
    "fields",
    [
        (7, 0, 0, 0),  # unknown status
        (data.FOUND, MAX_META_BYTES + 1, 10, 0),  # meta too long
        (data.FOUND, 0, (1 << 20) + 1, 0),  # more than the largest value
        (data.MISSING, 0, 5, 0),  # a miss with a payload
        (data.REFUSED, data.MAX_REFUSAL_BYTES + 1, 0, 0),
    ],
)
def test_replies_no_server_sends_are_refused(fields: tuple[int, int, int, int]) -> None:
    with pytest.raises(data.DataFrameError):
        data.parse_reply(data.REPLY.pack(*fields), 1 << 20)
