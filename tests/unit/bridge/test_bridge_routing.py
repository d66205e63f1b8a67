"""KV-aware routing: which backend a lookup answer chooses, and what goes to /tokenize."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kvmesh.common.config import config_from_dict
from kvmesh.services.bridge.backends import Backend, BackendPool
from kvmesh.services.bridge.prefix_lookup import (
    LookupFailed,
    PrefixLookup,
    prompt_token_ids,
    tokenize_body,
)
from kvmesh.services.bridge.proxy import Proxy
from kvmesh.services.bridge.routing import PrefixHits, choose, whole_prompt_tokens
from kvmesh.services.bridge.stats import BridgeStats
from kvmesh.services.bridge.transfers import TransferTable

MIN = 256


def backends(n: int, role: str = "decoder") -> list[Backend]:
    return [
        Backend(role, f"http://{role[0]}{i}:1", ["tcp://x:1"], instance_id=f"{role[0]}{i}")  # type: ignore[arg-type]
        for i in range(n)
    ]


@contextlib.contextmanager
def load(backend: Backend, n: int) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for _ in range(n):
            stack.enter_context(backend.busy())
        yield


def pick(least: Backend, pool: list[Backend], hits: PrefixHits | None, **kw: int):
    kw = {"min_tokens": MIN, "max_extra_inflight": 4, **kw}
    return choose(least, pool, hits, **kw)


def test_without_hits_the_least_loaded_pick_stands() -> None:
    a, b = backends(2)
    assert pick(b, [a, b], None).backend is b
    choice = pick(b, [a, b], PrefixHits(1000))
    assert (choice.backend, choice.by, choice.hit_tokens) == (b, "load", 0)


def test_the_longest_cached_prefix_wins_over_load() -> None:
    a, b, c = backends(3)
    hits = PrefixHits(1024, {"d0": 512, "d1": 768})
    with load(b, 2):
        choice = pick(c, [a, b, c], hits)
    assert (choice.backend, choice.by, choice.hit_tokens) == (b, "kv", 768)


def test_equal_hits_go_to_the_less_loaded_then_to_the_least_loaded_pick() -> None:
    a, b, c = backends(3)
    hits = PrefixHits(1024, {"d0": 512, "d1": 512})
    with load(a, 1):
        assert pick(c, [a, b, c], hits).backend is b
    assert pick(b, [a, b, c], hits).backend is b
    assert pick(a, [a, b, c], hits).backend is a


def test_a_hit_below_the_minimum_does_not_count() -> None:
    a, b = backends(2)
    choice = pick(b, [a, b], PrefixHits(1024, {"d0": 255, "d1": 0}))
    assert (choice.backend, choice.by) == (b, "load")
    assert pick(b, [a, b], PrefixHits(1024, {"d0": 256})).backend is a


def test_a_much_busier_holder_loses_to_the_least_loaded() -> None:
    a, b = backends(2)
    hits = PrefixHits(1024, {"d0": 1024})
    with load(a, 4):
        assert pick(b, [a, b], hits).backend is a  # 4 more in flight: still worth it
    with load(a, 5):
        choice = pick(b, [a, b], hits)
        assert (choice.backend, choice.by) == (b, "load")
        assert pick(b, [a, b], hits, max_extra_inflight=5).backend is a


def test_down_backends_and_unknown_instances_never_win() -> None:
    a, b, c = backends(3)
    anonymous = Backend("decoder", "http://anon:1")
    hits = PrefixHits(1024, {"d0": 1024, "": 1024})
    a.mark(False, "refused")
    choice = pick(c, [a, b, c, anonymous], hits)
    assert (choice.backend, choice.by) == (c, "load")


def test_nearly_the_whole_prompt() -> None:
    assert whole_prompt_tokens(PrefixHits(1025), MIN) == 770  # misses at most 255
    assert whole_prompt_tokens(PrefixHits(300), MIN) == MIN


# -- the proxy's choice (no sockets: _choose reads the pools only) -------------------------


def proxy(prefillers: int, decoders: int, **bridge: object) -> Proxy:
    cfg = config_from_dict({"bridge": bridge}).bridge
    pools = BackendPool(backends(prefillers, "prefiller")), BackendPool(backends(decoders))
    return Proxy(cfg, None, *pools, TransferTable(), BridgeStats())  # type: ignore[arg-type]


def routes(p: Proxy) -> dict[tuple[str, str], float]:
    return {k: c._value.get() for k, c in p.stats.routes.items()}


def test_without_prefillers_the_decoder_holding_the_prompt_gets_it() -> None:
    p = proxy(0, 2)
    d0 = p.decoders.backends[0]
    with load(d0, 2):
        decoder, prefiller, reason = p._choose(PrefixHits(1024, {"d0": 768}))
    assert (decoder.backend, decoder.by, prefiller, reason) == (d0, "kv", None, "no_prefiller")
    assert routes(p)[("decoder", "kv")] == 1
    decoder, _, _ = p._choose(None)
    assert decoder.by == "load"


def test_with_prefillers_the_prefiller_holding_the_prompt_prefills() -> None:
    p = proxy(2, 2)
    p1 = p.prefillers.backends[1]
    for _ in range(3):  # the round-robin of equals would otherwise reach p1 only every other time
        decoder, prefiller, reason = p._choose(PrefixHits(1024, {"p1": 512, "d0": 256}))
        assert prefiller is not None and (prefiller.backend, prefiller.by) == (p1, "kv")
        assert decoder.by == "load" and reason == ""
    assert routes(p)[("prefiller", "kv")] == 3


def test_a_decoder_holding_nearly_the_whole_prompt_skips_the_prefill() -> None:
    p = proxy(2, 2)
    d1 = p.decoders.backends[1]
    decoder, prefiller, reason = p._choose(PrefixHits(1025, {"d1": 1024, "p0": 1024}))
    assert (decoder.backend, decoder.by, prefiller, reason) == (d1, "kv", None, "decoder_cached")
    # Missing 513 tokens: the prefiller holding as much prefills, the decoder decodes.
    decoder, prefiller, reason = p._choose(PrefixHits(1537, {"d1": 1024, "p0": 1024}))
    assert prefiller is not None and prefiller.by == "kv" and reason == ""


# -- what the lookup reads of a request ---------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        (["hello"], "hello"),
        ([1, 2, 3], [1, 2, 3]),
        ([[1, 2, 3]], [1, 2, 3]),
    ],
)
def test_prompt_forms(prompt: object, expected: object) -> None:
    assert prompt_token_ids("completions", {"prompt": prompt}) == expected


def test_several_prompts_are_not_looked_up() -> None:
    for prompt in (["a", "b"], [[1], [2]]):
        with pytest.raises(LookupFailed) as info:
            prompt_token_ids("completions", {"prompt": prompt})
        assert info.value.reason == "batch"


def test_tokenize_bodies_render_as_the_request_would() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "add_special_tokens": False}
    assert msgspec.json.decode(tokenize_body("completions", body, "hi")) == {
        "model": "m",
        "prompt": "hi",
        "add_special_tokens": False,
    }
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"x": 1},
        "temperature": 0,
        "add_generation_prompt": False,
    }
    assert msgspec.json.decode(tokenize_body("chat", chat, None)) == {
        "messages": chat["messages"],
        "chat_template_kwargs": {"x": 1},
        "add_generation_prompt": False,
    }


async def test_tenant_requests_skip_the_lookup_and_leave_its_warning_state() -> None:
    """A request with a cache_salt (or a kvmesh tenant) is not looked up: the registry
    counts no tenant's chunks. Such requests between failing lookups must not make the
    once-per-reason warning repeat (20 salted/unsalted pairs logged 20 warnings)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there: every lookup times out
    cfg = config_from_dict(
        {"bridge": {"lookup_url": f"tcp://127.0.0.1:{port}", "lookup_timeout_s": 0.05}}
    ).bridge
    ids = list(range(600))
    salted = {"prompt": ids, "cache_salt": "alice"}
    tenant = {"prompt": ids, "kv_transfer_params": {"kvmesh": {"tenant": "bob"}}}
    async with aiohttp.ClientSession() as session, PrefixLookup(cfg, session) as lookup:
        with capture_logs() as logs:
            for body in (salted, {"prompt": ids}, tenant, {"prompt": ids}) * 3:
                with pytest.raises(LookupFailed) as failed:
                    await lookup.hits("completions", body, None, {})
                assert failed.value.reason == ("lookup_timeout" if len(body) == 1 else "tenant")
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["reason"] == "lookup_timeout"


async def test_a_tokenize_refused_for_the_request_is_not_a_backend_failure() -> None:
    """/tokenize answering 4xx (an unknown model, a bad message) is the request's own
    fault: counted apart (tokenize_refused) and not a once-per-reason warning, so
    alternating bad and good requests do not log one warning each."""

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") != "good":
            return web.json_response({"error": "no such model"}, status=404)
        return web.json_response({"tokens": list(range(600)), "count": 600})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # the lookup-server: nothing listens, lookups time out
    cfg = config_from_dict(
        {"bridge": {"lookup_url": f"tcp://127.0.0.1:{dead}", "lookup_timeout_s": 0.05}}
    ).bridge
    backend = Backend("decoder", f"http://127.0.0.1:{port}", ["tcp://x:1"], instance_id="d0")
    try:
        async with aiohttp.ClientSession() as session, PrefixLookup(cfg, session) as lookup:
            with capture_logs() as logs:
                for model in ("bad", "good") * 3:
                    body = {"model": model, "prompt": "some text to tokenize"}
                    with pytest.raises(LookupFailed) as failed:
                        await lookup.hits("completions", body, backend, {})
                    expected = "tokenize_refused" if model == "bad" else "lookup_timeout"
                    assert failed.value.reason == expected
    finally:
        await runner.cleanup()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [w["reason"] for w in warnings] == ["lookup_timeout"]
