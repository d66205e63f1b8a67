"""KV-aware routing end to end: two real vLLM servers on CPU (the tiny model, each with
the kvmesh connector under its own instance id, reporting to one controller), a
lookup-server reading that controller, and the bridge in front with `lookup_url` set.

- A long prompt computed by A (listed second) goes to A again through the bridge, even
  while A has a request in flight and B has none (the least loaded pick is B): the
  answer's KV came from A's cache, and the bridge counted a "kv" route.
- A chat request's prompt is found through the backend's /tokenize.
- A request with a cache_salt is routed by load: no tenant's chunks are in the registry.
- With the lookup-server stopped every request is still answered, by the least loaded
  backend, and counted as a lookup_timeout fallback; once it is back, routing is too.

vLLM's own prefix cache is off: a reused prompt is visible as kvmesh's hit_tokens.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from kvtest.bridge import BridgeProcess
from kvtest.controller import ControllerProcess
from kvtest.service_process import KvmeshService
from kvtest.vllm_server import VllmServer, free_port, kvmesh_transfer_config
from kvtest.waiting import wait_for

from kvmesh.common.transport.lookup_service_client import LookupServiceClient
from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

pytestmark = pytest.mark.timeout(900)

CHUNK = 256
PROMPT = prompt_tokens(1100, seed=21)  # 4 whole chunks and 76 tokens
COLD = prompt_tokens(1100, seed=22)


@dataclass
class Mesh:
    model: str
    a: VllmServer
    b: VllmServer
    lookup: KvmeshService
    bridge: BridgeProcess

    @property
    def lookup_url(self) -> str:
        return f"tcp://127.0.0.1:{self.lookup.port}"

    def best(self, tokens: list[int]) -> dict[str, int]:
        async def ask() -> dict[str, int]:
            async with LookupServiceClient(self.lookup_url, timeout_s=5.0, name="test") as c:
                return {h.instance_id: h.hit_tokens for h in await c.best_instances(tokens)}

        return asyncio.run(ask())

    def metric(self, name: str, **labels: str) -> float:
        for key, value in self.bridge.metrics().items():
            if key.split("{")[0] == f"kvmesh_bridge_{name}" and all(
                f'{k}="{v}"' in key for k, v in labels.items()
            ):
                return value
        return 0.0

    def transfers(self) -> list[dict[str, Any]]:
        status, raw = self.bridge.get("/transfers")
        assert status == 200
        return msgspec.json.decode(raw)

    def complete(self, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, answer = self.bridge.post("/v1/completions", body, timeout_s=120)
        assert status == 200, answer
        return answer


def hit_tokens(answer: dict[str, Any]) -> int:
    return answer["kv_transfer_params"]["kvmesh_result"]["hit_tokens"]


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("kvroute")
    controller = ControllerProcess(work, snapshot=False).start()
    lookup = KvmeshService(
        "lookup",
        work,
        free_port(),
        {"controller-url": controller.url, "chunk-size": CHUNK, "controller-timeout-s": 2.0},
    )
    servers = {}
    try:
        lookup.start(60.0)
        for name in ("a", "b"):
            engine = {
                "chunk_size": CHUNK,
                "l1": {"max_size": "64MiB", "reserve": 0},
                "controller": {
                    "enabled": True, "url": controller.url, "heartbeat_s": 0.5,
                    "timeout_s": 5.0, "event_flush_s": 0.02,
                },
            }  # fmt: skip
            servers[name] = VllmServer(
                tiny_model,
                work,
                name=f"vllm-{name}",
                kv_transfer_config=kvmesh_transfer_config(
                    "kv_both", {"engine": engine}, instance_id=f"vllm-{name}"
                ),
                args=["--no-enable-prefix-caching"],
            )
            servers[name].launch()
        for server in servers.values():
            server.wait_ready()
        a, b = servers["a"], servers["b"]
        # Deadlines far above the defaults: two vLLM servers share 2 cores here.
        bridge = BridgeProcess(
            work,
            prefillers=[],
            decoders=[],
            lookup_url=f"tcp://127.0.0.1:{lookup.port}",
            lookup_timeout_s=2.0,
            tokenize_timeout_s=10.0,
        )
        config = yaml.safe_load(bridge.config.read_text())
        # A second: the round-robin of idle backends starts with B.
        config["bridge"]["decoders"] = [
            {"url": b.url, "instance_id": "vllm-b"},
            {"url": a.url, "instance_id": "vllm-a"},
        ]
        bridge.config.write_text(yaml.safe_dump(config))
        bridge.launch()
        bridge.wait_ready()
        try:
            yield Mesh(str(tiny_model), a, b, lookup, bridge)
        finally:
            bridge.stop()
    finally:
        for server in servers.values():
            server.stop()
        lookup.stop()
        controller.stop()


def test_a_cached_prompt_goes_to_its_holder_even_when_it_is_busier(mesh: Mesh) -> None:
    # A computes the prompt (straight to A, not through the bridge) and registers it.
    first = mesh.a.complete({"model": mesh.model, "prompt": PROMPT, "max_tokens": 2})
    assert hit_tokens(first) == 0
    wait_for(lambda: mesh.best(PROMPT).get("vllm-a", 0) >= 4 * CHUNK, 30, "A's chunks listed")

    # A long answer through the bridge keeps A busy: routed to A by its cache.
    busy = threading.Thread(
        target=mesh.bridge.stream,
        args=("/v1/completions",),
        kwargs={
            "body": {
                "model": mesh.model, "prompt": PROMPT, "max_tokens": 2500, "temperature": 0,
                "ignore_eos": True, "stream": True,
            },
            "timeout_s": 600,
        },
        daemon=True,
    )  # fmt: skip
    busy.start()
    try:
        running = wait_for(lambda: mesh.transfers(), 60, "the busy request in flight")[0]
        assert running["decoder"] == mesh.a.url
        assert (running["route"], running["hit_tokens"]) == ("kv", 4 * CHUNK)
        assert running["prompt_tokens"] == len(PROMPT)

        # A has one request in flight, B none: by load alone B would get this one.
        kv_routes = mesh.metric("routes_total", role="decoder", by="kv")
        again = mesh.complete(PROMPT)
        assert hit_tokens(again) == 4 * CHUNK  # loaded from A's cache: it ran on A
        assert mesh.metric("routes_total", role="decoder", by="kv") == kv_routes + 1
        # ...and the busy one was still running when it was routed.
        assert [t["decoder"] for t in mesh.transfers()] == [mesh.a.url]
    finally:
        busy.join(600)
    assert not busy.is_alive()


def test_a_chat_prompt_is_found_through_tokenize(mesh: Mesh) -> None:
    words = " ".join(f"w{i % 97} x{i % 13}" for i in range(400))
    body = {
        "model": mesh.model,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 2,
        "temperature": 0,
    }
    tokens = mesh.a.post("/tokenize", {"model": mesh.model, "messages": body["messages"]})
    assert 4 * CHUNK < tokens["count"] < 3000, tokens["count"]
    status, first = mesh.bridge.post("/v1/chat/completions", body, timeout_s=120)
    assert status == 200, first
    held = wait_for(
        lambda: {k: v for k, v in mesh.best(tokens["tokens"]).items() if v >= 4 * CHUNK},
        30,
        "the chat prompt's chunks listed",
    )
    kv_routes = mesh.metric("routes_total", role="decoder", by="kv")
    # Idle backends take turns: without the lookup this one would go to the other one.
    for _ in range(2):
        status, again = mesh.bridge.post("/v1/chat/completions", body, timeout_s=120)
        assert status == 200, again
        assert hit_tokens(again) >= 4 * CHUNK, (held, again)
    assert mesh.metric("routes_total", role="decoder", by="kv") == kv_routes + 2


def test_a_salted_request_is_routed_by_load_not_by_other_tenants_chunks(mesh: Mesh) -> None:
    """The registry counts no tenant's chunks: a request with a cache_salt is not routed
    by the hits of the prompt's unsalted copies (it could not load them), and loads
    none wherever it lands."""
    mesh.a.complete({"model": mesh.model, "prompt": PROMPT, "max_tokens": 1})
    wait_for(lambda: mesh.best(PROMPT).get("vllm-a", 0) >= 4 * CHUNK, 30, "A's chunks listed")
    tenant = mesh.metric("route_fallbacks_total", reason="tenant")
    kv_routes = mesh.metric("routes_total", role="decoder", by="kv")
    body = {"model": mesh.model, "prompt": PROMPT, "max_tokens": 2, "cache_salt": "alice"}
    status, answer = mesh.bridge.post("/v1/completions", body, timeout_s=120)
    assert status == 200, answer
    assert hit_tokens(answer) == 0
    assert mesh.metric("route_fallbacks_total", reason="tenant") == tenant + 1
    assert mesh.metric("routes_total", role="decoder", by="kv") == kv_routes


def test_without_the_lookup_server_the_least_loaded_backend_answers(mesh: Mesh) -> None:
    mesh.lookup.stop()
    try:
        fallbacks = mesh.metric("route_fallbacks_total", reason="lookup_timeout")
        load_routes = mesh.metric("routes_total", role="decoder", by="load")
        for prompt in (PROMPT, COLD):
            answer = mesh.complete(prompt)
            assert answer["choices"][0]["text"] is not None
        assert mesh.metric("route_fallbacks_total", reason="lookup_timeout") == fallbacks + 2
        assert mesh.metric("routes_total", role="decoder", by="load") == load_routes + 2
    finally:
        mesh.lookup.start(60.0)
    # Back: the bridge's socket reconnects by itself.
    kv_routes = mesh.metric("routes_total", role="decoder", by="kv")
    wait_for(lambda: mesh.best(PROMPT).get("vllm-a", 0) >= 4 * CHUNK, 30, "the lookup back")
    for _ in range(2):
        assert hit_tokens(mesh.complete(PROMPT)) == 4 * CHUNK
    assert mesh.metric("routes_total", role="decoder", by="kv") == kv_routes + 2
