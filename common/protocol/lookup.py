"""The lookup protocol (version 1): "how many leading tokens of this prompt are cached?"

A scheduler (the vLLM connector's scheduler role, later the lookup-server) asks each
worker engine of an instance; each engine answers from its own tiers. Every message
is one ZMQ frame, a tagged array-like Struct encoded as msgpack. The client talks
through a DEALER socket per engine; the engine's ROUTER sees `[routing id, frame]`.

- Every request carries `rid` (echoed by the reply, so a client can drop late
  replies to requests it gave up on) and `version`, checked on every request: a
  mismatch gets `ErrorReply(VERSION_MISMATCH)`. `Hello` asks an engine who it is
  without looking anything up.
- `LookupPrefix.tokens` are the token ids as little-endian uint32 (`encode_tokens`).
  With `pin`, the engine keeps what it counted until a retrieve with the same
  `lookup_id`, a `ReleaseLookup`, or its pin timeout. `tenant` salts the chunk keys
  (tenants never see each other's chunks). `deadline` is a Unix time after which the
  answer is useless: the engine replies `DEADLINE_EXCEEDED` without looking up (and
  pins nothing) once it has passed; 0 means none.
- Every reply is the matching `...Reply` or `ErrorReply(rid, code, message,
  retryable)`. A frame that does not decode gets `ErrorReply` with `rid` 0 unless the
  id could still be read. Decoding never raises anything but `MalformedMessage`.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

import array
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path

import msgspec

PROTOCOL_VERSION = 1
MAX_TOKENS = 1 << 22  # 16 MiB of token ids; far beyond any context length
MAX_ID_CHARS = 256  # lookup ids and tenant salts
# sockaddr_un.sun_path is 108 bytes with the terminating NUL.
MAX_IPC_PATH_BYTES = 107

TOKEN_BYTES = 4
_U32 = next(c for c in ("I", "L") if array.array(c).itemsize == TOKEN_BYTES)
_LITTLE_ENDIAN = sys.byteorder == "little"


class ErrorCode(IntEnum):
    """Why a request failed. Values travel on the wire: append, never renumber."""

    BAD_MESSAGE = 1
    UNKNOWN_MESSAGE = 2
    VERSION_MISMATCH = 3
    BAD_TOKENS = 4
    DEADLINE_EXCEEDED = 5
    INTERNAL = 6
    SHUTTING_DOWN = 7


RETRYABLE = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.SHUTTING_DOWN})


class _Msg(msgspec.Struct, tag=True, frozen=True, array_like=True, gc=False):
    """Base of every message: tagged (the tag is the first array element)."""


# -- requests ----------------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    rid: int
    version: int
    client: str = ""


class LookupPrefix(_Msg, tag="lookup"):
    rid: int
    version: int
    lookup_id: str
    tokens: bytes
    pin: bool = True
    tenant: str = ""
    deadline: float = 0.0


class ReleaseLookup(_Msg, tag="release"):
    rid: int
    version: int
    lookup_id: str


Request = Hello | LookupPrefix | ReleaseLookup

# -- replies -----------------------------------------------------------------------------


class HelloReply(_Msg, tag="hello_r"):
    rid: int
    version: int
    instance_id: str
    rank: int
    world_size: int
    chunk_size: int


class LookupPrefixReply(_Msg, tag="lookup_r"):
    rid: int
    hit_tokens: int


class ReleaseLookupReply(_Msg, tag="release_r"):
    rid: int
    released: bool


class ErrorReply(_Msg, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = HelloReply | LookupPrefixReply | ReleaseLookupReply | ErrorReply

REQUEST_TAGS = frozenset(t.__struct_config__.tag for t in Request.__args__)
REPLY_TAGS = frozenset(t.__struct_config__.tag for t in Reply.__args__)

# One encoder and one decoder per direction, built once.
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()


class MalformedMessage(ValueError):
    """A frame that is not a valid message; `reply` is the ErrorReply to send back."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def error_reply(rid: int, code: ErrorCode, message: str) -> ErrorReply:
    return ErrorReply(rid, int(code), message[:300], code in RETRYABLE)


def decode_request(frames: Iterable[bytes | memoryview | msgspec.Raw]) -> Request:
    """The request in `frames` (what follows the routing id), fully validated.

    Raises MalformedMessage for anything else: not exactly one frame, bytes that are
    not msgpack, an unknown tag, a wrong field, another protocol version, or tokens
    that are not whole uint32s.
    """
    parts = list(frames)
    if len(parts) != 1:
        raw = parts[0] if parts else b""
        problem = f"expected 1 frame, got {len(parts)}"
        raise MalformedMessage(error_reply(_read_rid(raw), ErrorCode.BAD_MESSAGE, problem))
    raw = parts[0]
    try:
        msg = _request_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(_error_for(exc, raw, REQUEST_TAGS)) from None
    if not 0 <= msg.rid < 2**63:
        raise MalformedMessage(error_reply(0, ErrorCode.BAD_MESSAGE, "rid must be in [0, 2**63)"))
    if msg.version != PROTOCOL_VERSION:
        raise MalformedMessage(
            error_reply(
                msg.rid,
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {msg.version} not supported; this engine speaks "
                f"{PROTOCOL_VERSION}",
            )
        )
    problem = _check_request(msg)
    if problem is not None:
        raise MalformedMessage(error_reply(msg.rid, *problem))
    return msg


def decode_reply(raw: bytes | memoryview) -> Reply:
    """The reply in one frame; MalformedMessage (with a local ErrorReply) otherwise."""
    try:
        return _reply_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(_error_for(exc, raw, REPLY_TAGS)) from None


def _check_request(msg: Request) -> tuple[ErrorCode, str] | None:
    if isinstance(msg, LookupPrefix | ReleaseLookup) and not 0 < len(msg.lookup_id) <= MAX_ID_CHARS:
        return ErrorCode.BAD_MESSAGE, f"lookup_id must have 1 to {MAX_ID_CHARS} characters"
    if isinstance(msg, LookupPrefix):
        if len(msg.tenant) > MAX_ID_CHARS or not msg.tenant.isprintable():
            return ErrorCode.BAD_MESSAGE, (
                f"tenant must be at most {MAX_ID_CHARS} printable characters"
            )
        if len(msg.tokens) % TOKEN_BYTES:
            return ErrorCode.BAD_TOKENS, (
                f"tokens must be little-endian uint32s; got {len(msg.tokens)} bytes"
            )
        if len(msg.tokens) > MAX_TOKENS * TOKEN_BYTES:
            return ErrorCode.BAD_TOKENS, f"more than {MAX_TOKENS} tokens"
    return None


def _read_rid(raw: bytes | memoryview | msgspec.Raw) -> int:
    try:
        arr = _raw_decoder.decode(raw)
    except (msgspec.DecodeError, TypeError):
        return 0
    if isinstance(arr, list) and len(arr) > 1:
        rid = arr[1]
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
            return rid
    return 0


def _error_for(exc: Exception, raw: bytes | memoryview, tags: frozenset[str]) -> ErrorReply:
    """BAD_MESSAGE, or UNKNOWN_MESSAGE for a well-formed message of a tag not in tags."""
    code = ErrorCode.BAD_MESSAGE
    try:
        arr = _raw_decoder.decode(raw)
    except (msgspec.DecodeError, TypeError):
        arr = None
    if isinstance(arr, list) and arr and isinstance(arr[0], str) and arr[0] not in tags:
        code = ErrorCode.UNKNOWN_MESSAGE
    what = "unknown message type" if code is ErrorCode.UNKNOWN_MESSAGE else "bad message"
    return error_reply(_read_rid(raw), code, f"{what}: {exc}")


# -- token ids ---------------------------------------------------------------------------


def encode_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError for ids outside [0, 2**32)."""
    try:
        arr = array.array(_U32, tokens)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2**32)") from exc
    if not _LITTLE_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def decode_tokens(data: bytes | memoryview) -> array.array:
    """The token ids of `encode_tokens` output, in native byte order."""
    if len(data) % TOKEN_BYTES:
        raise ValueError(f"token bytes must be a multiple of {TOKEN_BYTES}, got {len(data)}")
    arr = array.array(_U32)
    arr.frombytes(data)
    if not _LITTLE_ENDIAN:
        arr.byteswap()
    return arr


# -- where engines listen ----------------------------------------------------------------


def default_ipc_dir() -> Path:
    """A short per-user directory for ipc sockets: $KVMESH_IPC_DIR or /tmp/kvmesh-<uid>.

    Short on purpose: an ipc path must fit in 107 bytes, and $TMPDIR may be deep.
    """
    env = os.environ.get("KVMESH_IPC_DIR")
    if env:
        return Path(env)
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(base) / f"kvmesh-{os.getuid()}"


_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+)$")


def engine_endpoint(configured: str, instance_id: str, rank: int) -> str:
    """The endpoint the lookup server of (instance_id, rank) binds and clients connect to.

    - `""`: `ipc://<default_ipc_dir()>/lk-<hash of instance id>-<rank>.sock`;
    - a string containing `{rank}`: that string with the rank filled in;
    - `tcp://host:port`: rank r listens on port + r;
    - `ipc://path`: rank r listens on `path-r`.

    Raises ValueError for other schemes, a bad port, or an ipc path too long for a
    Unix socket.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if not configured:
        digest = hashlib.blake2b(instance_id.encode(), digest_size=8).hexdigest()
        endpoint = f"ipc://{default_ipc_dir()}/lk-{digest}-{rank}.sock"
    elif "{rank}" in configured:
        endpoint = configured.replace("{rank}", str(rank))
    elif configured.startswith("tcp://"):
        match = _TCP.match(configured)
        if match is None:
            raise ValueError(f"lookup endpoint {configured!r}: expected tcp://host:port")
        port = int(match["port"]) + rank
        if not 0 < port <= 65535:
            raise ValueError(f"lookup endpoint {configured!r}: port {port} of rank {rank}")
        endpoint = f"tcp://{match['host']}:{port}"
    elif configured.startswith("ipc://"):
        endpoint = f"{configured}-{rank}"
    else:
        raise ValueError(f"lookup endpoint {configured!r}: expected ipc://PATH or tcp://HOST:PORT")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            raise ValueError(
                f"ipc path {path!r} is longer than {MAX_IPC_PATH_BYTES} bytes, the limit "
                "of a Unix socket path; set KVMESH_IPC_DIR or engine.lookup_endpoint to a "
                "shorter one"
            )
    elif not endpoint.startswith("tcp://"):
        raise ValueError(f"lookup endpoint {endpoint!r}: expected ipc:// or tcp://")
    return endpoint
