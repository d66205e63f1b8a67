"""The bridge (`kvmesh serve bridge`) as a real process in front of a real vLLM on CPU.

One plain vLLM (no connector) serves the whole module; three bridges sit in front:

- `fallback`: its prefiller is a port where nothing listens, its decoder the vLLM:
  every request falls back to the decoder prefilling itself;
- `pd`: prefiller and decoder are the same vLLM behind recording stand-ins
  (kvtest/http_backend.py), so the exact prefill and decode requests are checked on a
  real round trip (plain vLLM ignores the kvmesh keys);
- `faults`: stand-ins a test switches to hang, fail or drop, with 1 s deadlines.

Answers through the bridge must equal what vLLM answers directly (greedy, prefix
cache off, one request at a time).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kvtest.bridge import BridgeProcess, kvmesh_command, post_chunked, request
from kvtest.http_backend import HttpBackend
from kvtest.vllm_server import VllmServer, free_port
from kvtest.waiting import wait_for

from kvmesh.services.cli.admin_cmd import admin

KV_ENDPOINT = "tcp://127.0.0.1:7650"
PROMPT = " ".join(f"item {i} is {i * 7 % 13} apples and {i % 5} pears;" for i in range(40))
COMPLETION = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
CHAT = {
    "messages": [{"role": "user", "content": PROMPT}],
    "max_completion_tokens": 6,
    "temperature": 0,
}


@dataclass
class Mesh:
    vllm: VllmServer
    fallback: BridgeProcess
    pd: BridgeProcess
    faults: BridgeProcess
    rec_p: HttpBackend
    rec_d: HttpBackend
    fault_p: HttpBackend
    fault_d: HttpBackend


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("bridge")
    vllm = VllmServer(tiny_model, work, args=["--no-enable-prefix-caching"])
    vllm.launch()  # ~30-70 s: everything else starts meanwhile
    rec_p = HttpBackend("forward", vllm.url).start()
    rec_d = HttpBackend("forward", vllm.url).start()
    fault_p = HttpBackend("hang").start()
    fault_d = HttpBackend("forward", vllm.url).start()
    nothing = f"http://127.0.0.1:{free_port()}"
    bridges = [
        BridgeProcess(
            work, name="fallback", prefillers=[nothing], decoders=[(vllm.url, [KV_ENDPOINT])],
            max_body_bytes="64KiB", metrics_port=free_port(), console_script=True,
        ),
        BridgeProcess(
            work, name="pd", prefillers=[rec_p.url], decoders=[(rec_d.url, [KV_ENDPOINT])]
        ),
        BridgeProcess(
            work, name="faults", prefillers=[fault_p.url],
            decoders=[(fault_d.url, [KV_ENDPOINT])], prefill_timeout_s=1, decode_timeout_s=1,
        ),
    ]  # fmt: skip
    try:
        for b in bridges:
            b.launch()
        for b in bridges:
            b.wait_ready()
        vllm.wait_ready()
        yield Mesh(vllm, *bridges, rec_p, rec_d, fault_p, fault_d)
    finally:
        for b in bridges:
            b.stop()
        for s in (rec_p, rec_d, fault_p, fault_d):
            s.stop()
        vllm.stop()
    for b in bridges:
        assert b.proc is not None and b.proc.returncode == 0, b.describe("did not stop cleanly")


def direct(mesh: Mesh, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return mesh.vllm.post(path, body)


def token_ids(answer: dict[str, Any]) -> list[int]:
    return answer["choices"][0]["token_ids"]


def streamed_token_ids(events: list[Any]) -> list[int]:
    return [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]


def fallbacks(bridge: BridgeProcess) -> dict[str, float]:
    prefix = "kvmesh_bridge_fallbacks_total{reason="
    return {k[len(prefix) + 1 : -2]: v for k, v in bridge.metrics().items() if k.startswith(prefix)}


def requests_total(bridge: BridgeProcess, endpoint: str, outcome: str) -> float:
    key = f'kvmesh_bridge_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}}'
    return bridge.metrics()[key]


BAD = [
    (b"{not json", "completions", 400, "not valid JSON"),
    (b"[1, 2]", "completions", 400, "must be a JSON object"),
    (b'{"prompt": "x", "model": 7}', "completions", 400, "model"),
    (b'{"model": "m"}', "completions", 400, "prompt"),
    (b'{"prompt": [1, "a"]}', "completions", 400, "prompt"),
    (b'{"prompt": "x", "max_tokens": "8"}', "completions", 400, "max_tokens"),
    (b'{"prompt": "x", "stream": "yes"}', "completions", 400, "stream"),
    (b'{"messages": "hello"}', "chat", 400, "messages"),
    (b'{"messages": [{"content": "x"}]}', "chat", 400, "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "chat", 400, "max_to"),
    (json.dumps({"prompt": "x" * 70_000}).encode(), "completions", 413, "limit of 65536 bytes"),
]  # fmt: skip
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def test_bad_requests_get_4xx_naming_the_problem_and_the_bridge_stays_up(mesh: Mesh) -> None:
    bridge = mesh.fallback
    for body, endpoint, status, words in BAD:
        got, answer = bridge.post(PATHS[endpoint], body)
        assert got == status, (body[:80], answer)
        assert words in answer["error"]["message"], (body[:80], answer)
        assert answer["error"]["code"] == status
    # A chunked body has no Content-Length to refuse up front.
    got, raw = post_chunked(bridge.url + "/v1/completions", [b'{"prompt": "', b"x" * 70_000, b'"}'])
    assert got == 413 and b"limit of 65536 bytes" in raw
    for path, status in (("/v1/completions", 405), ("/v2/nothing", 404)):
        got, raw = bridge.get(path)
        assert got == status and json.loads(raw)["error"]["code"] == status
    got, raw = bridge.get("/health")
    assert got == 200, raw
    health = json.loads(raw)
    assert health["decoders"][0]["state"] == "up"
    assert health["prefillers"][0]["state"] == "down"
    assert requests_total(bridge, "completions", "bad_request") >= 8
    assert bridge.alive()


def test_fallback_answers_equal_the_decoder_s_own(mesh: Mesh) -> None:
    bridge = mesh.fallback
    before = sum(fallbacks(bridge).values())
    want = direct(mesh, "/v1/completions", COMPLETION)
    got, answer = bridge.post("/v1/completions", COMPLETION)
    assert got == 200, answer
    assert token_ids(answer) == token_ids(want) and len(token_ids(want)) == 8
    assert answer["choices"][0]["text"] == want["choices"][0]["text"]
    events = bridge.stream("/v1/completions", {**COMPLETION, "stream": True})
    assert streamed_token_ids(events) == token_ids(want)
    # The prefiller was found dead: by the health check (prefiller_down) or by a
    # refused connection (connect), depending on which came first.
    after = fallbacks(bridge)
    assert after["connect"] + after["prefiller_down"] == before + 2, after
    assert requests_total(bridge, "completions", "ok") >= 2


def test_metrics_port_serves_metrics_and_health(mesh: Mesh) -> None:
    port = mesh.fallback.ready_info["metrics_port"]
    assert port and port != mesh.fallback.port
    got, raw = request(f"http://127.0.0.1:{port}/metrics")
    assert got == 200 and b"kvmesh_bridge_requests_total" in raw
    assert request(f"http://127.0.0.1:{port}/health")[0] == 200
    # Only the probes there: no proxying on the scrapers' port.
    assert request(f"http://127.0.0.1:{port}/v1/models")[0] == 404


def test_models_come_from_the_decoder(mesh: Mesh) -> None:
    got, raw = mesh.fallback.get("/v1/models")
    assert got == 200
    _, want = request(mesh.vllm.url + "/v1/models")
    assert [m["id"] for m in json.loads(raw)["data"]] == [m["id"] for m in json.loads(want)["data"]]


def test_pd_requests_follow_the_contract(mesh: Mesh) -> None:
    bridge, rec_p, rec_d = mesh.pd, mesh.rec_p, mesh.rec_d
    params = {"kvmesh": {"tenant": "acme"}, "someone_else": {"k": 1}}
    want = direct(mesh, "/v1/completions", COMPLETION)
    body = {**COMPLETION, "kv_transfer_params": params}
    got, answer = bridge.post("/v1/completions", body)
    assert got == 200, answer
    assert token_ids(answer) == token_ids(want)
    prefill, decode = rec_p.requests[-1], rec_d.requests[-1]
    tid = prefill.body["kv_transfer_params"]["kvmesh"]["pd"]["transfer_id"]
    assert len(tid) == 32 and int(tid, 16) >= 0
    assert prefill.body == {
        **COMPLETION,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "kvmesh": {"tenant": "acme", "pd": {"transfer_id": tid, "endpoints": [KV_ENDPOINT]}},
            "someone_else": {"k": 1},
        },
    }
    assert decode.body == {
        **body,
        "kv_transfer_params": {
            "kvmesh": {"tenant": "acme", "pd": {"transfer_id": tid}},
            "someone_else": {"k": 1},
        },
    }
    assert prefill.headers["X-Request-Id"] == decode.headers["X-Request-Id"] == tid

    # Streaming: the prefill never streams; the decode streams as the client asked.
    stream = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    events = bridge.stream("/v1/completions", stream)
    assert streamed_token_ids(events) == token_ids(want)
    assert events[-1]["usage"]["completion_tokens"] == 8
    prefill, decode = rec_p.requests[-1], rec_d.requests[-1]
    assert prefill.body["stream"] is False and "stream_options" not in prefill.body
    assert decode.body["stream"] is True and decode.body["stream_options"] == {
        "include_usage": True
    }

    want_chat = direct(mesh, "/v1/chat/completions", CHAT)
    got, answer = bridge.post("/v1/chat/completions", CHAT)
    assert got == 200, answer
    text = answer["choices"][0]["message"]["content"]
    assert text == want_chat["choices"][0]["message"]["content"]
    prefill = rec_p.requests[-1]
    assert prefill.body["max_tokens"] == prefill.body["max_completion_tokens"] == 1

    assert sum(fallbacks(bridge).values()) == 0
    metrics = bridge.metrics()
    assert metrics['kvmesh_bridge_prefill_seconds_count{result="ok"}'] == 3
    assert metrics["kvmesh_bridge_decode_first_byte_seconds_count"] == 3
    assert requests_total(bridge, "chat", "ok") == 1


def test_prefill_failures_fall_back_and_decoder_failures_are_502_or_504(mesh: Mesh) -> None:
    bridge, fault_p, fault_d = mesh.faults, mesh.fault_p, mesh.fault_d
    want = direct(mesh, "/v1/completions", COMPLETION)
    for mode, reason in (("hang", "timeout"), ("fail", "status")):
        fault_p.mode, fault_d.mode = mode, "forward"
        t0 = time.monotonic()
        got, answer = bridge.post("/v1/completions", COMPLETION)
        assert got == 200, answer
        assert token_ids(answer) == token_ids(want)
        assert "kv_transfer_params" not in fault_d.requests[-1].body  # no pd: prefill here
        assert fallbacks(bridge)[reason] == 1
        if mode == "hang":
            assert 0.9 < time.monotonic() - t0 < 10
    fault_p.mode = "fail"
    for mode, status, error_type in (
        ("hang", 504, "GatewayTimeoutError"),
        ("drop", 502, "BadGatewayError"),
    ):
        fault_d.mode = mode
        for stream in (False, True):
            got, answer = bridge.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert got == status, answer
            assert (
                answer["error"]["type"] == error_type and fault_d.url in answer["error"]["message"]
            )
    assert requests_total(bridge, "completions", "decoder_timeout") == 2
    assert requests_total(bridge, "completions", "decoder_failed") == 2
    assert bridge.alive() and bridge.get("/health")[0] == 200


def test_admin_transfers_lists_requests_in_flight(mesh: Mesh) -> None:
    bridge = mesh.faults
    # The console script, as an operator runs it (it starts slowly: run it meanwhile).
    script = subprocess.Popen(
        [*kvmesh_command(), "admin", "transfers", "--bridge", bridge.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    mesh.fault_p.mode = mesh.fault_d.mode = "hang"
    done: list[int] = []
    client = threading.Thread(
        target=lambda: done.append(bridge.post("/v1/completions", COMPLETION)[0])
    )
    client.start()
    runner = CliRunner()
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 10
    while client.is_alive() and time.monotonic() < deadline:
        result = runner.invoke(admin, ["transfers", "--bridge", bridge.url, "--json"])
        assert result.exit_code == 0, result.output
        for row in json.loads(result.output):
            seen[row["phase"]] = row
        time.sleep(0.05)
    client.join(10)
    assert done == [504]
    assert set(seen) == {"prefill", "decode"}, seen
    row = seen["decode"]
    assert row["prefiller"] == mesh.fault_p.url and row["decoder"] == mesh.fault_d.url
    assert row["endpoint"] == "completions" and row["fallback"] == "timeout"
    assert row["transfer_id"] == seen["prefill"]["transfer_id"] and row["age_s"] >= 0.9

    stdout, stderr = script.communicate(timeout=60)
    assert script.returncode == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].split() == [
        "TRANSFER", "ENDPOINT", "PHASE", "AGE_S", "PREFILLER", "DECODER", "FALLBACK", "ROUTE"
    ]  # fmt: skip
    assert lines[-1] == f"{len(lines) - 2} in flight", stdout
    dead = runner.invoke(admin, ["transfers", "--bridge", f"http://127.0.0.1:{free_port()}"])
    assert dead.exit_code == 3 and "did not answer" in dead.output


def test_health_is_503_while_no_decoder_answers(mesh: Mesh) -> None:
    bridge = mesh.faults
    mesh.fault_d.mode = "down"
    got, raw = bridge.get("/health")
    assert got == 503, raw
    health = json.loads(raw)
    assert health["status"] == "unavailable" and health["decoders"][0]["state"] == "down"
    # A decoder's own error answer reaches the client as it is.
    mesh.fault_p.mode = "fail"
    got, answer = bridge.post("/v1/completions", COMPLETION)
    assert got == 503 and answer["error"]["message"] == "stand-in down"
    mesh.fault_d.mode = "forward"
    assert bridge.get("/health")[0] == 200


def test_a_client_going_away_ends_its_request(mesh: Mesh) -> None:
    bridge = mesh.faults
    mesh.fault_p.mode, mesh.fault_d.mode = "hang", "forward"
    cancelled = requests_total(bridge, "completions", "cancelled")
    host, port = "127.0.0.1", bridge.port
    # Gone during the prefill.
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(COMPLETION), JSON)
    wait_for(lambda: len(transfers(bridge)) == 1, 10, "one transfer listed")
    conn.close()
    wait_for(lambda: not transfers(bridge), 10, "no transfer listed")
    # Gone in the middle of a streamed answer from the real decoder.
    mesh.fault_p.mode = "fail"
    long = {**COMPLETION, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(long), JSON)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()
    wait_for(lambda: not transfers(bridge), 10, "no transfer listed")
    wait_for(
        lambda: requests_total(bridge, "completions", "cancelled") == cancelled + 2,
        10,
        "both cancellations counted",
    )
    assert bridge.get("/health")[0] == 200


JSON = {"Content-Type": "application/json"}


def transfers(bridge: BridgeProcess) -> list[dict[str, Any]]:
    got, raw = bridge.get("/transfers")
    assert got == 200
    return json.loads(raw)
