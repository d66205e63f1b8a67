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

from kvmesh.common.protocol import wire
from kvmesh.common.transport.tcp_address import is_ipv6, tcp_endpoint

PROTOCOL_VERSION = 1
MAX_TOKENS = 1 << 22  # 16 MiB of token ids; far beyond any context length
TOKEN_BYTES = 4
# The largest frame a lookup server reads: a LookupPrefix of MAX_TOKENS and its other
# fields. ZMQ drops the connection of a sender of more, before buffering it.
MAX_MESSAGE_BYTES = MAX_TOKENS * TOKEN_BYTES + (1 << 20)
MAX_ID_CHARS = 256  # lookup ids and tenant salts
# sockaddr_un.sun_path is 108 bytes with the terminating NUL.
MAX_IPC_PATH_BYTES = 107

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
    WRONG_WORKER = 8  # the request names another instance or rank than the one asked


RETRYABLE = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.SHUTTING_DOWN})


# -- requests ----------------------------------------------------------------------------


class Hello(wire.Message, tag="hello"):
    rid: int
    version: int
    client: str = ""


class LookupPrefix(wire.Message, tag="lookup"):
    rid: int
    version: int
    lookup_id: str
    tokens: bytes
    pin: bool = True
    tenant: str = ""
    deadline: float = 0.0
    # The worker the asker means ("" / -1: any). An asker working from a worker list
    # that may be old (the lookup-server) names it: an endpoint reused since by another
    # worker answers WRONG_WORKER instead of counting its own chunks as that one's.
    instance_id: str = ""
    rank: int = -1


class ReleaseLookup(wire.Message, tag="release"):
    rid: int
    version: int
    lookup_id: str


Request = Hello | LookupPrefix | ReleaseLookup

# -- replies -----------------------------------------------------------------------------


class HelloReply(wire.Message, tag="hello_r"):
    rid: int
    version: int
    instance_id: str
    rank: int
    world_size: int
    chunk_size: int


class LookupPrefixReply(wire.Message, tag="lookup_r"):
    rid: int
    hit_tokens: int


class ReleaseLookupReply(wire.Message, tag="release_r"):
    rid: int
    released: bool


class ErrorReply(wire.Message, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = HelloReply | LookupPrefixReply | ReleaseLookupReply | ErrorReply


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


codec: wire.Codec[Request, Reply, ErrorReply] = wire.Codec(
    Request,
    Reply,
    ErrorReply,
    ErrorCode,
    RETRYABLE,
    version=PROTOCOL_VERSION,
    speaker="this engine",
    check=_check_request,
)
MalformedMessage = wire.MalformedMessage
encode = codec.encode
error_reply = codec.error_reply
# The frames that follow the routing id: exactly one.
decode_request = codec.decode_request_frames
decode_reply = codec.decode_reply


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
    return builtin_ipc_dir()


def builtin_ipc_dir() -> Path:
    """/tmp/kvmesh-<uid>, the directory used when $KVMESH_IPC_DIR is not set: a name
    any local user can predict (and create first)."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(base) / f"kvmesh-{os.getuid()}"


_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+)$")


def _tcp_host_port(configured: str) -> tuple[str, int]:
    match = _TCP.match(configured)
    if match is not None:
        return match["host"], int(match["port"])
    # An IPv6 address left unbracketed: what an orchestrator's "tcp://$(POD_IP):7610"
    # makes of an IPv6 pod address. The port is required, so the last group is it.
    host, _, port = configured.removeprefix("tcp://").rpartition(":")
    if is_ipv6(host) and port.isdigit():
        return host, int(port)
    raise ValueError(f"lookup endpoint {configured!r}: expected tcp://host:port")


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
        host, port = _tcp_host_port(configured)
        port += rank
        if not 0 < port <= 65535:
            raise ValueError(f"lookup endpoint {configured!r}: port {port} of rank {rank}")
        endpoint = tcp_endpoint(host, port)
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
