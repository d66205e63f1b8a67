"""What the bridge checks of an OpenAI request before forwarding it, and the shape of
the errors it answers itself.

The Structs validate only the fields the bridge reads or rewrites (model, prompt or
messages, max_tokens, stream, kv_transfer_params); every other field is allowed and
forwarded untouched, since the backends (vLLM) validate the rest and their errors
reach the client as they are. The request is forwarded as the client's own JSON
object, not re-encoded from these Structs, so nothing the Structs do not know is lost.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

Endpoint = Literal["completions", "chat"]

PositiveTokens = Annotated[int, msgspec.Meta(ge=1)]


class KvTransferParams(msgspec.Struct, kw_only=True):
    # Only kvmesh's own entry is read; a client may pass other connectors' keys.
    kvmesh: dict[str, Any] | None = None


class _Request(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: PositiveTokens | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    kv_transfer_params: KvTransferParams | None = None


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[Any]

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list) and not _is_prompt_list(self.prompt):
            raise ValueError(
                "prompt: expected a string, a list of strings, a list of token ids or a "
                "list of lists of token ids"
            )


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveTokens | None = None


REQUEST_TYPES: dict[Endpoint, type[_Request]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}


class BadRequest(Exception):
    """A request the bridge refuses itself: `status` (4xx), and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


_json_decoder = msgspec.json.Decoder()
_AT_PATH = re.compile(r"^(?P<problem>.*) - at `\$\.?(?P<path>[^`]*)`$", re.DOTALL)


def parse_request(body: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The client's JSON object, once it passed the checks; BadRequest (400) names the
    first problem."""
    try:
        obj = _json_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise BadRequest(400, f"the body must be a JSON object, got {_json_type(obj)}")
    try:
        msgspec.convert(obj, REQUEST_TYPES[endpoint])
    except msgspec.ValidationError as exc:
        message, param = _describe(exc)
        raise BadRequest(400, message, param) from None
    kvmesh = (obj.get("kv_transfer_params") or {}).get("kvmesh")
    if kvmesh is not None and "pd" in kvmesh:
        # The transfer id ties one prefill to one decode; a client-chosen one could
        # claim KV that another request's prefill sent.
        raise BadRequest(
            400, "kv_transfer_params.kvmesh.pd is set by the bridge", "kv_transfer_params"
        )
    return obj


def _is_prompt_list(items: list[Any]) -> bool:
    if not items:
        return False
    if all(isinstance(x, str) for x in items):
        return True
    if _is_token_ids(items):
        return True
    return all(isinstance(x, list) and x and _is_token_ids(x) for x in items)


def _is_token_ids(items: list[Any]) -> bool:
    # bool is an int in Python, never a token id in JSON.
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items)


def _describe(exc: msgspec.ValidationError) -> tuple[str, str | None]:
    """msgspec's "Expected `int`, got `str` - at `$.max_tokens`" as
    ("max_tokens: expected int, got str", "max_tokens")."""
    text = str(exc)
    match = _AT_PATH.match(text)
    problem, path = (match["problem"], match["path"]) if match else (text, "")
    missing = re.fullmatch(r"Object missing required field `(.*)`", problem)
    if missing:
        path = f"{path}.{missing[1]}" if path else missing[1]
        problem = "required"
    problem = problem.replace("`", "")
    if not path:  # a __post_init__ rule, which names its field itself
        param = problem.split(":", 1)[0] if ":" in problem else None
        return problem, param
    problem = problem[:1].lower() + problem[1:]
    return f"{path}: {problem}", re.split(r"[.\[]", path, maxsplit=1)[0]


def _json_type(obj: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(obj), "a number"
    )


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    """vLLM's error shape (`{"error": {message, type, param, code}}`, code = the HTTP
    status), so a client sees the same whether the bridge or a backend refused it."""

    error: ErrorInfo


_encoder = msgspec.json.Encoder()


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    info = ErrorInfo(message, _ERROR_TYPES.get(status, "Error"), param, status)
    return _encoder.encode(ErrorBody(info))
