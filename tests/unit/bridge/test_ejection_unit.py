"""Passive ejection's rules (services/bridge/backends.py) one at a time, on Backend and
BackendPool objects, and the bridge's own connect failures (out of file descriptors)
through an in-process bridge whose outgoing connector fails as the kernel would."""

from __future__ import annotations

import errno
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from kvtest.http_backend import HttpBackend

from kvmesh.common.config import config_from_dict
from kvmesh.services.bridge import backends as backends_module
from kvmesh.services.bridge.backends import (
    EJECT_AFTER_FAILURES,
    EJECT_MAX_S,
    Backend,
    BackendPool,
    judge_status,
    local_failure,
    pool_trace,
    probe,
)
from kvmesh.services.bridge.prefix_lookup import LookupFailed, PrefixLookup
from kvmesh.services.bridge.routing import PrefixHits, choose
from kvmesh.services.bridge.server import BridgeServer
from kvmesh.services.bridge.stats import BridgeStats

KV = "tcp://127.0.0.1:7650"


def pool(n: int, stats: BridgeStats | None = None) -> BackendPool:
    return BackendPool(
        [Backend("decoder", f"http://h{i}:1", stats=stats, instance_id=f"h{i}") for i in range(n)]
    )


def eject_then_cool_down(pool: BackendPool, backend: Backend) -> None:
    """Eject `backend`, its cooldown already over: back on probation at the next look."""
    backend.eject("test", now=time.monotonic() - 10 * EJECT_MAX_S)
    assert not backend.ejected() and backend.probation


def test_two_thousand_ejections_in_a_row_keep_the_cooldown_at_its_max() -> None:
    """2**1024 does not fit a float: the 1025th ejection raised OverflowError (out of
    the request paths) and the backend could never be ejected again."""
    p = pool(2)
    bad = p.backends[0]
    for _ in range(2000):
        eject_then_cool_down(p, bad)
        # Through the pool as a request's failure would: on probation, ejected at once.
        p.record(bad, "answered 502")
        assert bad.ejected()
        assert bad.ejected_until is not None
        assert bad.ejected_until - time.monotonic() <= EJECT_MAX_S
    assert bad.ejections == 4000
    assert bad.eject("again") == EJECT_MAX_S


def test_a_backend_on_probation_takes_one_trial_request_at_a_time() -> None:
    """Back from its cooldown it has nothing in flight: least-loaded picking sent it
    every new request until its first result came back (a burst to a backend that
    may still be broken). One trial at a time while another backend can take them."""
    p = pool(2)
    bad, good = p.backends
    eject_then_cool_down(p, bad)
    with good.busy(), good.busy():
        trial = p.pick(include_down=False)
        assert trial is bad  # its one trial: it is the least loaded
        with bad.busy():
            picked = {p.pick(include_down=False) for _ in range(6)}
            assert picked == {good}, [b.url for b in picked if b is not None]
            # The only one left in rotation: it still takes requests.
            good.mark(False, "refused")
            assert p.pick(include_down=False) is bad
            good.mark(True)
        # The trial's result is in (a success): a backend like any other.
        p.record(bad)
        with bad.busy():
            assert not bad.probation
            assert p.pick(include_down=False) is bad


def test_kv_routing_sends_no_second_trial_to_a_backend_on_probation() -> None:
    p = pool(2)
    bad, good = p.backends
    eject_then_cool_down(p, bad)
    hits = PrefixHits(1000, {"h0": 1000})
    with bad.busy():
        got = choose(good, p.backends, hits, min_tokens=256, max_extra_inflight=4)
        assert got.backend is good and got.by == "load"
    got = choose(good, p.backends, hits, min_tokens=256, max_extra_inflight=4)
    assert got.backend is bad and got.by == "kv"  # no trial in flight: it may have one


def test_results_from_before_the_ejection_or_during_it_are_ignored() -> None:
    """Requests sent before an ejection end after it: their failures made the next
    ejection's reason count 8 in a row, and a success among them reset the backoff to
    its start while the backend was still ejected."""
    p = pool(2)
    bad = p.backends[0]
    before = bad.generation
    for _ in range(EJECT_AFTER_FAILURES):
        p.record(bad, "answered 502", generation=before)
    assert bad.ejected() and bad.ejections == 1
    # Late results of requests sent before, arriving while it is ejected.
    for _ in range(5):
        p.record(bad, "answered 502", generation=before)
    p.record(bad, generation=before)
    assert bad.failures == 0 and bad.ejections == 1
    # ... and after its cooldown, while it is on probation.
    eject_then_cool_down(p, bad)  # the second ejection, cooled down at once
    assert bad.ejections == 2
    p.record(bad, generation=before)
    assert bad.probation and bad.ejections == 2, "a stale success ended the probation"
    p.record(bad, "answered 502", generation=before)
    assert not bad.ejected() and bad.failures == 0
    # Its trial, sent now, decides.
    p.record(bad, generation=bad.generation)
    assert not bad.probation and bad.ejections == 0


def test_what_counts_toward_ejection() -> None:
    """502/503/504 are failures; a 500 (vLLM's answer to some bad requests) or another
    5xx is neither; a 2xx or a 4xx is a success (the backend works)."""
    assert judge_status(200) == "" and judge_status(404) == "" and judge_status(400) == ""
    for status in (502, 503, 504):
        assert judge_status(status) == f"answered {status}"
    for status in (500, 501, 505):
        assert judge_status(status) is None


def connector_error(code: int) -> aiohttp.ClientConnectorError:
    key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, OSError(code, "test"))


def test_local_connect_errors_are_told_apart() -> None:
    for code in (errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS):
        assert local_failure(connector_error(code)), code
    for code in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ECONNRESET):
        assert not local_failure(connector_error(code)), code
    assert not local_failure(aiohttp.ServerDisconnectedError())


class _OutOfFiles(aiohttp.TCPConnector):
    """A connector whose connects to `ports` fail as they do when the process is out
    of file descriptors (the socket() call fails with EMFILE; aiohttp wraps it)."""

    def __init__(self, ports: set[int]) -> None:
        super().__init__(limit=100)
        self.ports = ports

    async def _create_connection(self, req: ClientRequest, *rest: Any) -> Any:
        if req.url.port in self.ports:
            raise aiohttp.ClientConnectorError(
                req.connection_key, OSError(errno.EMFILE, "Too many open files")
            )
        return await super()._create_connection(req, *rest)


def out_of_files(ports: set[int]) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=_OutOfFiles(ports),
        auto_decompress=False,
        headers={"Accept-Encoding": "identity"},
        trace_configs=[pool_trace()],
    )


async def test_a_bridge_out_of_file_descriptors_blames_no_backend() -> None:
    """EMFILE on the bridge's own connect (nofile below its pool size, a connection
    storm) was a 502 "the decoder failed", marked the decoder down and counted toward
    its ejection. It is the bridge's saturation: 503 with Retry-After; the decoder
    stays up and in rotation; a failed prefill connect falls back, the prefiller not
    blamed either."""
    decoder, prefiller = HttpBackend("ok").start(), HttpBackend("ok").start()
    cfg = config_from_dict(
        {
            "bridge": {
                "port": 0,
                "health_interval_s": 60,  # no check marks them up again meanwhile
                "prefillers": [{"url": prefiller.url}],
                "decoders": [{"url": decoder.url, "kv_endpoints": [KV]}],
            }
        }
    ).bridge
    bridge = BridgeServer(cfg)
    await bridge.start()
    session = out_of_files({decoder.port, prefiller.port})
    try:
        await bridge.refresh_health()
        assert bridge.proxy is not None
        real = bridge.proxy.session
        bridge.proxy.session = session
        url = f"http://127.0.0.1:{bridge.port}/v1/completions"
        body = {"prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as client:
            for _ in range(EJECT_AFTER_FAILURES + 1):
                async with client.post(url, json=body) as resp:
                    text = await resp.text()
                    assert resp.status == 503, text
                    assert "saturated" in text and "Too many open files" in text
                    assert resp.headers["Retry-After"] == "1"
            for b in (bridge.decoders.backends[0], bridge.prefillers.backends[0]):
                assert b.state == "up" and b.failures == 0 and not b.ejected(), b.report()
            saturated = {"reason": "saturated"}
            fallbacks = bridge.stats.metrics.value("bridge_fallbacks_total", saturated)
            assert fallbacks == EJECT_AFTER_FAILURES + 1
            # Only the prefiller's connects fail: the decoder prefills itself.
            session.connector.ports = {prefiller.port}  # type: ignore[union-attr]
            async with client.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
            pre = bridge.prefillers.backends[0]
            assert pre.state == "up" and pre.failures == 0
        bridge.proxy.session = real
    finally:
        await session.close()
        await bridge.stop()
        decoder.stop()
        prefiller.stop()


async def test_a_tokenize_out_of_file_descriptors_leaves_the_backend_up() -> None:
    tokenizer = HttpBackend("ok").start()
    cfg = config_from_dict({"bridge": {"lookup_url": "tcp://127.0.0.1:9"}}).bridge
    backend = Backend("decoder", tokenizer.url)
    backend.mark(True)
    session = out_of_files({tokenizer.port})
    try:
        lookup = PrefixLookup(cfg, session)
        with pytest.raises(LookupFailed, match="Too many open files"):
            await lookup.tokenize(backend, b'{"prompt": "hi"}', {})
        assert backend.state == "up", backend.error
    finally:
        await session.close()
        tokenizer.stop()


def test_the_ejected_gauge_clears_when_the_pool_is_refreshed() -> None:
    stats = BridgeStats()
    p = pool(2, stats)
    bad = p.backends[0]
    bad.eject("test", now=time.monotonic() - 10 * EJECT_MAX_S)
    labels = {"role": "decoder", "backend": bad.url}
    assert stats.metrics.value("bridge_backend_ejected", labels) == 1
    p.refresh()
    assert stats.metrics.value("bridge_backend_ejected", labels) == 0 and bad.probation


def test_the_cooldown_constants_are_read_at_each_ejection(monkeypatch) -> None:
    """The integration tests shorten the cooldown in the bridge process this way."""
    monkeypatch.setattr(backends_module, "EJECT_BASE_S", 0.5)
    assert pool(1).backends[0].eject("test") == 0.5


async def test_a_health_check_the_bridge_could_not_send_leaves_the_state_alone() -> None:
    backend_http = HttpBackend("ok").start()
    up, down = Backend("decoder", backend_http.url), Backend("decoder", backend_http.url)
    up.mark(True)
    down.mark(False, "earlier")
    session = out_of_files({backend_http.port})
    try:
        await probe(session, up, 2.0)
        await probe(session, down, 2.0)
        assert (up.state, down.state, down.error) == ("up", "down", "earlier")
    finally:
        await session.close()
        backend_http.stop()
