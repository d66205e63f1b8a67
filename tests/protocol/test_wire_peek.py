"""wire._peek: the tag and rid an error reply needs, read from the first bytes of a
message the typed decoder refused, agree with a full decode of the message; and a header
of millions of items is not decoded to find them."""

from __future__ import annotations

import time

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.common.protocol import wire

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.text(max_size=60)
)
anything = st.recursive(scalars | st.floats() | st.binary(max_size=20), st.lists, max_leaves=8)


@given(st.lists(scalars, max_size=2), st.lists(anything, max_size=20))
def test_the_head_read_agrees_with_a_full_decode(head: list, rest: list) -> None:
    raw = msgspec.msgpack.encode(head + rest if len(head) == 2 else head)
    full = msgspec.msgpack.decode(raw)[:2]
    assert wire._peek(raw) == full
    assert wire._rid_of(wire._peek(raw)) == wire._rid_of(full)


@given(anything)
def test_what_is_not_an_array_or_has_no_plain_head_gives_no_rid(value) -> None:
    raw = msgspec.msgpack.encode(value)
    full = msgspec.msgpack.decode(raw)
    peeked = wire._peek(raw)
    if not isinstance(full, list):
        assert peeked is None
    else:
        assert wire._rid_of(peeked) == wire._rid_of(full[:2]) or peeked[-1] is None


def test_a_header_of_millions_of_items_is_not_decoded_to_answer_it() -> None:
    raw = msgspec.msgpack.encode(["mget", 7, ["k"] * 4_000_000])
    t0 = time.perf_counter()
    assert wire._peek(raw) == ["mget", 7]
    assert time.perf_counter() - t0 < 0.01  # a full decode takes ~100 ms
    assert wire._peek(b"") is None and wire._peek(b"\xdd\x00") is None
    assert wire._peek(msgspec.msgpack.encode(["x" * 300, 7])) == [None]  # past the bytes read
