"""wire.Codec on hostile input: whatever the bytes, decoding raises MalformedMessage
(with the protocol's ErrorReply) and nothing else, so a server's receive loop never sees
another exception. Found by the fuzz tests (tests/fuzz)."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.common.protocol import cacheserver, controller, lookup, lookup_service, p2p

PROTOCOLS = [controller, cacheserver, lookup_service, lookup, p2p]
# Arrays nested past msgspec's recursion limit, with and without a known tag first.
DEEP = b"\x91" * 100_000 + b"\xc0"
DEEP_TAGGED = b"\x92\xa5hello" + DEEP


@pytest.mark.parametrize("proto", PROTOCOLS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("raw", [DEEP, DEEP_TAGGED], ids=["bare", "tagged"])
def test_nesting_past_the_recursion_limit_is_a_bad_message(proto, raw: bytes) -> None:
    with pytest.raises(proto.MalformedMessage) as caught:
        proto.codec.decode_request(raw)
    assert caught.value.reply.code == proto.ErrorCode.BAD_MESSAGE
    with pytest.raises(proto.MalformedMessage):
        proto.codec.decode_reply(raw)


def test_the_error_reply_of_deep_nesting_encodes() -> None:
    with pytest.raises(controller.MalformedMessage) as caught:
        controller.decode_request(DEEP)
    reply = controller.decode_reply(controller.encode(caught.value.reply))
    assert isinstance(reply, controller.ErrorReply) and reply.rid == 0
    assert msgspec.msgpack.decode(controller.encode(reply))[0] == "error"


def test_tags_of_a_single_message_type_is_its_tag() -> None:
    from kvmesh.common.protocol import controller as cproto
    from kvmesh.common.protocol.wire import tags_of

    assert tags_of(cproto.Clear) == {"clear"}
    assert tags_of(cproto.Clear | cproto.Pin) == {"clear", "pin"}
