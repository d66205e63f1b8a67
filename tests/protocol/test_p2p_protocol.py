"""The peer protocol's evolution rule (fields appended, with defaults), for the replies
that name the NIXL agent their addresses belong to."""

from __future__ import annotations

import msgspec

from kvmesh.common.protocol import p2p as proto

KEY = "0123456789abcdef-0123456789abcdef0123456789abcdef"
META = proto.ChunkMeta(KEY, 128, 7, [4, 16], "float16", 1, 4096)


def test_address_replies_from_an_older_peer_name_no_agent() -> None:
    """An older peer's pin and alloc replies decode, with no agent named: the reader
    and the prefiller then use the agent they hello'd, as before."""
    pin = msgspec.msgpack.encode(["pin_r", 3, 9, [msgspec.to_builtins(META)]])
    got = proto.decode_reply([pin])
    assert isinstance(got, proto.PinChunksReply) and got.agent == "" and got.chunks == [META]
    alloc = msgspec.msgpack.encode(["alloc_r", 4, 77, [[4096, 128, False]]])
    got = proto.decode_reply([alloc])
    assert got == proto.AllocChunksReply(4, 77, [proto.Slot(4096, 128)], "")


def test_address_replies_name_their_agent_and_older_readers_ignore_it() -> None:
    pin = proto.PinChunksReply(3, 9, [META], "kvmesh-a-1-ff")
    alloc = proto.AllocChunksReply(4, 77, [proto.Slot(4096, 128)], "kvmesh-d-2-ee")
    for reply in (pin, alloc):
        assert proto.decode_reply([proto.encode(reply)]) == reply

    class OldAllocReply(msgspec.Struct, tag="alloc_r", array_like=True):
        rid: int
        alloc_id: int
        slots: list[proto.Slot]

    old = msgspec.msgpack.decode(proto.encode(alloc), type=OldAllocReply)
    assert old == OldAllocReply(4, 77, [proto.Slot(4096, 128)])
