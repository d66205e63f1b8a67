"""The cache-server client's exceptions: one root, one table from wire codes to classes.

`CacheServerUnavailable` (no answer: not connected, connection lost, deadline passed,
client closed) is kept apart from the errors the server answered with.
"""

from __future__ import annotations

from kvmesh.common.protocol import cacheserver as proto


class CacheServerError(Exception):
    """The server answered with an error (or, for subclasses below, did not answer)."""

    def __init__(self, message: str, code: int = 0, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


class CacheServerUnavailable(CacheServerError):
    """No answer: not connected, connection lost, deadline passed, or client closed."""


class ProtocolVersionError(CacheServerError):
    pass


class ValueTooLargeError(CacheServerError):
    pass


class BadRequestError(CacheServerError):
    pass


class ServerBusyError(CacheServerError):
    pass


_ERRORS: dict[int, type[CacheServerError]] = {
    proto.ErrorCode.VERSION_MISMATCH: ProtocolVersionError,
    proto.ErrorCode.VALUE_TOO_LARGE: ValueTooLargeError,
    proto.ErrorCode.TOO_MANY_CONNECTIONS: ServerBusyError,
    proto.ErrorCode.SHUTTING_DOWN: CacheServerUnavailable,
}


def error_from(reply: proto.ErrorReply) -> CacheServerError:
    try:
        name = proto.ErrorCode(reply.code).name
    except ValueError:
        name = str(reply.code)
    cls = _ERRORS.get(reply.code, BadRequestError)
    return cls(f"{name}: {reply.message}", reply.code, reply.retryable)
