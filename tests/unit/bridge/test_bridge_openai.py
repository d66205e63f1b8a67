"""What the bridge refuses itself, and the shape of its errors."""

from __future__ import annotations

import json

import pytest

from kvmesh.services.bridge.openai import BadRequest, error_json, parse_request


def refused(body: bytes | object, endpoint: str = "completions") -> BadRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as info:
        parse_request(raw, endpoint)  # type: ignore[arg-type]
    return info.value


KTP = "kv_transfer_params"
MCT = "max_completion_tokens"


@pytest.mark.parametrize(
    ("body", "endpoint", "param", "words"),
    [
        (b"{not json", "completions", None, "not valid JSON"),
        (b"", "completions", None, "not valid JSON"),
        ([1, 2], "completions", None, "must be a JSON object, got an array"),
        ("text", "chat", None, "got a string"),
        ({}, "completions", "prompt", "prompt: required"),
        ({"prompt": 5}, "completions", "prompt", "prompt"),
        ({"prompt": []}, "completions", "prompt", "prompt"),
        ({"prompt": [1, "a"]}, "completions", "prompt", "prompt"),
        ({"prompt": [True]}, "completions", "prompt", "prompt"),
        ({"prompt": [[1], []]}, "completions", "prompt", "prompt"),
        ({"prompt": "x", "model": 3}, "completions", "model", "model: expected str"),
        ({"prompt": "x", "max_tokens": "5"}, "completions", "max_tokens", "expected int"),
        ({"prompt": "x", "max_tokens": 0}, "completions", "max_tokens", ">= 1"),
        ({"prompt": "x", "max_tokens": 1.5}, "completions", "max_tokens", "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "completions", "stream", "expected bool"),
        ({"prompt": "x", KTP: []}, "completions", KTP, ""),
        ({"prompt": "x", KTP: {"kvmesh": 1}}, "completions", KTP, ""),
        ({"messages": "hi"}, "chat", "messages", "expected array"),
        ({"messages": []}, "chat", "messages", "length >= 1"),
        ({"messages": [{"content": "x"}]}, "chat", "messages", "messages[0].role: required"),
        ({"messages": [{"role": "user", "content": 3}]}, "chat", "messages", "content"),
        ({"messages": [{"role": "user"}], MCT: -1}, "chat", MCT, ""),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_problem(
    body: object, endpoint: str, param: str | None, words: str
) -> None:
    exc = refused(body, endpoint)
    assert exc.status == 400
    assert exc.param == param
    assert words in str(exc)


def test_a_client_may_not_choose_the_transfer() -> None:
    exc = refused({"prompt": "x", "kv_transfer_params": {"kvmesh": {"pd": {"transfer_id": "t"}}}})
    assert exc.param == "kv_transfer_params" and "set by the bridge" in str(exc)


def test_deeply_nested_bodies_are_refused_not_crashed_on() -> None:
    # msgspec raises RecursionError, not DecodeError, past its nesting limit.
    deep = b"[" * 100_000 + b"]" * 100_000
    for body, endpoint in (
        (b'{"prompt": "x", "extra": ' + deep + b"}", "completions"),
        (b'{"messages": [], "kv_transfer_params": {"kvmesh": {"a": ' + deep + b"}}}", "chat"),
        (deep, "completions"),
    ):
        exc = refused(body, endpoint)
        assert exc.status == 400 and exc.param is None
        assert str(exc) == "the body is not valid JSON: nested too deeply"


def test_valid_requests_come_back_whole() -> None:
    body = {
        "model": "m",
        "prompt": [[1, 2], [3]],
        "max_tokens": 3,
        "stream": None,
        "temperature": 0.5,
        "some_future_field": {"x": [1]},
        "kv_transfer_params": {"kvmesh": {"tenant": "t"}, "nixl": {"a": 1}},
    }
    assert parse_request(json.dumps(body).encode(), "completions") == body
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
        ],
        "max_completion_tokens": 7,
    }
    assert parse_request(json.dumps(chat).encode(), "chat") == chat
    for prompt in ("text", ["a", "b"], [1, 2, 3]):
        parse_request(json.dumps({"prompt": prompt}).encode(), "completions")


def test_error_body_has_the_openai_shape() -> None:
    body = json.loads(error_json(413, "too big", "prompt"))
    assert body == {
        "error": {
            "message": "too big",
            "type": "RequestEntityTooLargeError",
            "param": "prompt",
            "code": 413,
        }
    }
