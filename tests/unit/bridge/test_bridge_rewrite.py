"""The prefill and decode requests the bridge derives from a client's request."""

from __future__ import annotations

import copy

from kvmesh.services.bridge.rewrite import decode_body, prefill_body

TID = "0123456789abcdef0123456789abcdef"
ENDPOINTS = ["tcp://10.0.0.2:7650", "tcp://10.0.0.2:7651"]


def test_prefill_of_a_completion_asks_one_token_without_stream() -> None:
    client = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 64,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {"5": 1},
    }
    out = prefill_body(client, chat=False, transfer_id=TID, endpoints=ENDPOINTS)
    assert out == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "logit_bias": {"5": 1},
        "kv_transfer_params": {"kvmesh": {"pd": {"transfer_id": TID, "endpoints": ENDPOINTS}}},
    }


def test_prefill_sets_max_tokens_even_when_the_client_did_not() -> None:
    out = prefill_body({"prompt": [1, 2, 3]}, chat=False, transfer_id=TID, endpoints=ENDPOINTS)
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "max_completion_tokens" not in out


def test_prefill_of_a_chat_caps_max_completion_tokens_only_when_set() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_mct = {"messages": messages, "max_completion_tokens": 50}
    out = prefill_body(with_mct, chat=True, transfer_id=TID, endpoints=ENDPOINTS)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    out = prefill_body({"messages": messages}, chat=True, transfer_id=TID, endpoints=ENDPOINTS)
    assert "max_completion_tokens" not in out


def test_prefill_lowers_min_tokens_which_vllm_refuses_above_max_tokens() -> None:
    out = prefill_body({"prompt": "x", "min_tokens": 8}, chat=False, transfer_id=TID, endpoints=[])
    assert out["min_tokens"] == 0


def test_client_kv_transfer_params_are_kept_on_both_sides() -> None:
    client = {
        "prompt": "x",
        "kv_transfer_params": {"kvmesh": {"tenant": "acme"}, "other_connector": {"a": 1}},
    }
    before = copy.deepcopy(client)
    pre = prefill_body(client, chat=False, transfer_id=TID, endpoints=ENDPOINTS)
    dec = decode_body(client, TID)
    assert pre["kv_transfer_params"] == {
        "kvmesh": {"tenant": "acme", "pd": {"transfer_id": TID, "endpoints": ENDPOINTS}},
        "other_connector": {"a": 1},
    }
    assert dec["kv_transfer_params"] == {
        "kvmesh": {"tenant": "acme", "pd": {"transfer_id": TID}},
        "other_connector": {"a": 1},
    }
    assert client == before, "the client's object must not change"


def test_decode_is_the_client_request_plus_the_transfer_id() -> None:
    client = {"prompt": "x", "max_tokens": 64, "stream": True, "stream_options": {"a": 1}}
    out = decode_body(client, TID)
    assert out == {**client, "kv_transfer_params": {"kvmesh": {"pd": {"transfer_id": TID}}}}


def test_fallback_decode_has_no_pd() -> None:
    client = {"prompt": "x", "max_tokens": 4}
    assert decode_body(client, None) == client
    tenant = {"prompt": "x", "kv_transfer_params": {"kvmesh": {"tenant": "acme"}}}
    assert decode_body(tenant, None) == tenant
    # A pd the client slipped in never reaches a decoder without a transfer.
    slipped = {"prompt": "x", "kv_transfer_params": {"kvmesh": {"tenant": "a", "pd": {"x": 1}}}}
    assert decode_body(slipped, None)["kv_transfer_params"] == {"kvmesh": {"tenant": "a"}}
    assert "pd" in slipped["kv_transfer_params"]["kvmesh"]


def test_prefill_copies_the_endpoint_list() -> None:
    endpoints = list(ENDPOINTS)
    out = prefill_body({"prompt": "x"}, chat=False, transfer_id=TID, endpoints=endpoints)
    endpoints.append("tcp://elsewhere:1")
    assert out["kv_transfer_params"]["kvmesh"]["pd"]["endpoints"] == ENDPOINTS
