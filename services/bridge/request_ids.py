"""The request id the bridge names a request by: the client's X-Request-Id, or its own.

It goes to the prefiller and the decoder in the same header (vLLM names its request
after it, and kvmesh's connector logs and pins under that name), back to the client,
and on every line the bridge logs for the request (structlog contextvars).
"""

from __future__ import annotations

from aiohttp import web

from kvmesh.common.observability import get_logger

log = get_logger(__name__)

REQUEST_ID = "X-Request-Id"
MAX_REQUEST_ID = 128


def client_request_id(request: web.Request) -> str:
    """The client's X-Request-Id if it is usable as an id ("" if none): printable
    ASCII without spaces, at most MAX_REQUEST_ID characters. Anything else is replaced,
    so a header cannot inject text into logs or make vLLM's request name unbounded."""
    value = request.headers.get(REQUEST_ID, "")
    usable = value.isascii() and value.isprintable() and " " not in value
    if 0 < len(value) <= MAX_REQUEST_ID and usable:
        return value
    if value:
        log.debug("client request id replaced", length=len(value))
    return ""
