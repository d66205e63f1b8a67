"""What every protocol module shares (ARCHITECTURE.md §3): the message base, one codec
per protocol, and the one exception decoding raises.

A protocol module declares its Structs, `Request` and `Reply` unions, `ErrorCode` and
`ErrorReply`, then builds its `codec` from them and re-exports the codec's functions as
`encode`, `decode_request`, `decode_reply` and `error_reply` (the codec itself is for
code that serves any protocol, such as the ROUTER loop). Every ErrorCode starts
BAD_MESSAGE = 1, UNKNOWN_MESSAGE = 2, VERSION_MISMATCH = 3 and has an INTERNAL; every
ErrorReply is `(rid, code, message, retryable)`.

Decoding raises nothing but `MalformedMessage`, whose `reply` is the protocol's
ErrorReply for the bad input: UNKNOWN_MESSAGE for a well-formed message of a tag the
decoder does not know, BAD_MESSAGE for anything else the decoder refuses, the
request's rid echoed whenever it can still be read.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any, Generic, TypeVar

import msgspec

RID_LIMIT = 2**63
MAX_ERROR_CHARS = 300

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Err = TypeVar("Err")
Buffer = bytes | bytearray | memoryview


class Message(msgspec.Struct, tag=True, frozen=True, array_like=True, gc=False):
    """Base of every message: tagged (the tag is the first array element)."""


class MalformedMessage(ValueError):
    """Frames that are not a valid message; `reply` is the ErrorReply for them."""

    def __init__(self, reply: Any) -> None:
        super().__init__(reply.message)
        self.reply = reply


def tags_of(union: Any) -> frozenset[str]:
    """The wire tags of the Structs in a union (or of one Struct type)."""
    members = typing.get_args(union) or (union,)
    return frozenset(t.__struct_config__.tag for t in members)


# What _peek reads of a refused message: a tag longer than this is no known one.
PEEK_BYTES = 256
_ARRAY_LEN = {0xDC: 2, 0xDD: 4}  # msgpack array16, array32: bytes of the length
_STR_LEN = {0xD9: 1, 0xDA: 2, 0xDB: 4}  # str8, str16, str32
_INT = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False)}
_INT |= {0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


def _peek(raw: Buffer) -> list | None:
    """The tag and rid at the head of a msgpack array, for the error reply to a message
    the typed decoder refused: [tag, rid] (None for one that is neither a str nor an
    int), shorter for a shorter array, None when it is not an array. Only the first
    PEEK_BYTES are read: a refused header may hold millions of items, and decoding them
    all would cost the loop seconds."""
    head = bytes(memoryview(raw)[:PEEK_BYTES])
    if not head:
        return None
    first, pos = head[0], 1
    if 0x90 <= first <= 0x9F:
        n = first & 0x0F
    elif first in _ARRAY_LEN:
        pos += _ARRAY_LEN[first]
        if len(head) < pos:
            return None
        n = int.from_bytes(head[1:pos], "big")
    else:
        return None
    out: list = []
    while len(out) < min(n, 2) and pos < len(head):
        item, pos = _scalar(head, pos)
        if item is _CUT:
            out.append(None)
            break
        out.append(item)
    return out


_CUT = object()
_FIXED = {0xC0: None, 0xC2: False, 0xC3: True}  # nil, false, true


def _scalar(head: bytes, pos: int) -> tuple[object, int]:
    """(the str, int, bool or nil at pos, the position after it), or (_CUT, pos) for
    anything else, or for one cut off by PEEK_BYTES."""
    b = head[pos]
    if b <= 0x7F:
        return b, pos + 1
    if b >= 0xE0:
        return b - 0x100, pos + 1
    if b in _FIXED:
        return _FIXED[b], pos + 1
    start, size = pos + 1, 0
    if 0xA0 <= b <= 0xBF or b in _STR_LEN:
        if b in _STR_LEN:
            start += _STR_LEN[b]
            size = int.from_bytes(head[pos + 1 : start], "big")
        else:
            size = b & 0x1F
        if start + size > len(head):
            return _CUT, pos
        try:
            return head[start : start + size].decode(), start + size
        except UnicodeDecodeError:
            return _CUT, pos
    if b in _INT:
        width, signed = _INT[b]
        if start + width > len(head):
            return _CUT, pos
        return int.from_bytes(head[start : start + width], "big", signed=signed), start + width
    return _CUT, pos


def rid_at_head(raw: Buffer) -> int:
    """The rid a message's first frame starts with (0 when it has none to read), read
    from its first bytes only: for the error reply to a message refused undecoded."""
    return _rid_of(_peek(raw))


def _rid_of(arr: list | None) -> int:
    if arr is not None and len(arr) > 1:
        rid = arr[1]
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < RID_LIMIT:
            return rid
    return 0


class Codec(Generic[Req, Rep, Err]):
    """Encodes and decodes one protocol's messages with encoders and decoders built once
    (msgspec's advice: building one costs more than a decode).

    `version`, where every request of the protocol carries one: each request's version
    must equal it and its rid lie in [0, 2**63); `speaker` names who answers in the
    VERSION_MISMATCH message. None where only the hello carries a version (the server
    checks it there). `check` returns (code, message) for a request that decoded but
    breaks a rule of the protocol, None for a good one.
    """

    def __init__(
        self,
        request: Any,
        reply: Any,
        error: Callable[[int, int, str, bool], Err],
        codes: type[IntEnum],
        retryable: frozenset[IntEnum],
        *,
        version: int | None = None,
        speaker: str = "",
        check: Callable[[Req], tuple[IntEnum, str] | None] | None = None,
    ) -> None:
        self.request_tags = tags_of(request)
        self.reply_tags = tags_of(reply)
        self.codes = codes
        self.version = version
        self.encode: Callable[[Any], bytes] = msgspec.msgpack.Encoder().encode
        self._requests = msgspec.msgpack.Decoder(request)
        self._replies = msgspec.msgpack.Decoder(reply)
        self._error = error
        self._retryable = retryable
        self._speaker = speaker
        self._check = check

    def code_name(self, code: int) -> str:
        """An error code as a metric label: its name, lower case (its number for one
        this side does not know: a label, never an exception in a serve loop)."""
        try:
            return self.codes(code).name.lower()
        except ValueError:
            return str(code)

    def error_reply(self, rid: int, code: IntEnum, message: str) -> Err:
        return self._error(rid, int(code), message[:MAX_ERROR_CHARS], code in self._retryable)

    def decode_request(self, raw: Buffer) -> Req:
        """The request in one frame, validated; MalformedMessage otherwise."""
        try:
            msg = self._requests.decode(raw)
        # msgspec's errors, UnicodeDecodeError for a bad str, RecursionError for nesting
        # too deep (a field of type Any would reach it)
        except (ValueError, RecursionError) as exc:
            raise MalformedMessage(self._refused(exc, raw, self.request_tags)) from None
        codes = self.codes
        if self.version is not None:
            if not 0 <= msg.rid < RID_LIMIT:
                problem = "rid must be in [0, 2**63)"
                raise MalformedMessage(self.error_reply(0, codes.BAD_MESSAGE, problem))
            if msg.version != self.version:
                problem = (
                    f"protocol version {msg.version} not supported; {self._speaker} speaks "
                    f"{self.version}"
                )
                raise MalformedMessage(self.error_reply(msg.rid, codes.VERSION_MISMATCH, problem))
        if self._check is not None:
            refused = self._check(msg)
            if refused is not None:
                raise MalformedMessage(self.error_reply(msg.rid, *refused))
        return msg

    def decode_request_frames(self, frames: Iterable[Buffer]) -> Req:
        """The request in frames (what follows the routing id), which must be exactly one;
        MalformedMessage otherwise."""
        parts = list(frames)
        if len(parts) != 1:
            rid = _rid_of(_peek(parts[0])) if parts else 0
            problem = f"expected 1 frame, got {len(parts)}"
            raise MalformedMessage(self.error_reply(rid, self.codes.BAD_MESSAGE, problem))
        return self.decode_request(parts[0])

    def decode_reply(self, raw: Buffer) -> Rep:
        """The reply in one frame; MalformedMessage (with a local ErrorReply) otherwise."""
        try:
            return self._replies.decode(raw)
        except (ValueError, RecursionError) as exc:
            raise MalformedMessage(self._refused(exc, raw, self.reply_tags)) from None

    def _refused(self, exc: Exception, raw: Buffer, tags: frozenset[str]) -> Err:
        arr = _peek(raw)
        unknown = bool(arr) and isinstance(arr[0], str) and arr[0] not in tags
        code = self.codes.UNKNOWN_MESSAGE if unknown else self.codes.BAD_MESSAGE
        what = "unknown message type" if unknown else "bad message"
        return self.error_reply(_rid_of(arr), code, f"{what}: {exc}")
