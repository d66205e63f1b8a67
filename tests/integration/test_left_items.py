"""Left items of the transport, plugin and Redis audit (H32), each against real
processes: a redis-server killed under traffic and started again on its port, and
plugin tiers (a real module on the Python path) whose factory or plain methods hang."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens
from kvtest.remote import RedisProcess, remote_engine

TIMEOUT_S = 1.0  # the remote tier's deadline in the Redis test
SLACK_S = 1.5  # a loaded CI machine's stall on top of it


def _caches():
    src = make_cache("cpu", torch.float16, True, blocks=32, block_size=4)
    dst = make_cache("cpu", torch.float16, False, blocks=32, block_size=4)
    return src, dst


def _dbsize(port: int) -> int:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "dbsize"], capture_output=True, text=True, timeout=5
    )
    return int(out.stdout.strip() or -1)


class _Traffic(threading.Thread):
    """Gets through b's remote tier, one after another until stopped: b's L1 is cleared
    before each, so every chunk is asked of Redis. Records each retrieve's duration and
    whatever escapes it."""

    def __init__(self, engine, prompts: list[list[int]]) -> None:
        super().__init__(daemon=True)
        self.engine, self.prompts = engine, prompts
        self.stop = threading.Event()
        self.slowest = 0.0
        self.gets = 0
        self.hits = 0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            i += 1
            try:
                self.engine.clear(tier="l1")
                t0 = time.monotonic()
                mask = self.engine.retrieve(prompt, torch.arange(len(prompt)))
                self.slowest = max(self.slowest, time.monotonic() - t0)
                self.gets += 1
                self.hits += int(mask.sum())
            except BaseException as exc:  # what the test says must never happen
                self.errors.append(exc)


@pytest.mark.parametrize("outage_s", [0.0, 1.5], ids=["restart", "outage"])
def test_redis_killed_under_traffic_then_restarted_serves_again(tmp_path, outage_s) -> None:
    node = RedisProcess(tmp_path).start()
    (src_view, src_layers, kind), (dst_view, dst_layers, _) = _caches()
    prompts = [list(range(i * 100, i * 100 + 32)) for i in range(8)]
    a = remote_engine(node.url, src_view, instance="w", timeout_s=TIMEOUT_S)
    b = remote_engine(node.url, dst_view, instance="r", timeout_s=TIMEOUT_S)
    remote = b.storage.tier("remote")
    traffic = _Traffic(b, prompts)
    try:
        for p in prompts:
            assert a.store(p, torch.arange(32)) == 32
        assert a.storage.tier("remote").flush(5)
        traffic.start()
        deadline = time.monotonic() + 10
        while traffic.hits < 32 * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert traffic.hits >= 32 * 4, "no gets served by Redis before the kill"
        # SIGKILL mid-traffic: requests in flight see their connection cut.
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(5)
        time.sleep(outage_s)
        during = traffic.gets
        node = RedisProcess(tmp_path, node.port).start()  # empty: nothing was saved
        time.sleep(0.5)  # gets against the new, empty server: misses
        traffic.stop.set()
        traffic.join(TIMEOUT_S + SLACK_S + 5)
        assert not traffic.is_alive(), "a retrieve hung"
        assert traffic.errors == []
        assert traffic.gets > during, "no retrieve ended after the restart"
        assert traffic.slowest < TIMEOUT_S + SLACK_S, f"a retrieve took {traffic.slowest:.2f}s"
        # The same engines, not restarted: stores and gets go through Redis again.
        assert remote.wait_ready(10) and a.storage.tier("remote").wait_ready(10)
        prompt = list(range(7000, 7032))
        slots = torch.randperm(128)[:32]
        deadline = time.monotonic() + 10
        while True:  # the writer's first put after the restart may fall in its down spell
            assert a.store(prompt, slots) in (0, 32)
            assert a.storage.tier("remote").flush(5)
            if _dbsize(node.port) == 4 or time.monotonic() > deadline:
                break
            a.clear(prompt, tier="l1")
            time.sleep(0.2)
        assert _dbsize(node.port) == 4
        b.clear(tier="l1")
        dst = torch.randperm(128)[:32]
        assert bool(b.retrieve(prompt, dst).all())
        want = slot_tokens(src_layers, kind)[:, slots]
        got = slot_tokens(dst_layers, kind)[:, dst]
        assert torch.equal(bits(want), bits(got))
        assert b.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) >= 32
    finally:
        traffic.stop.set()
        a.close()
        b.close()
        node.kill()


def test_redis_restarted_between_requests_costs_no_request(tmp_path) -> None:
    """Pooled connections to a redis-server that was killed and started again are dead;
    the first put and get on each are sent again on a fresh one (RedisConnector's
    `_once_more`), not failed: no miss, no failed put, the store not marked down. No
    health ping runs meanwhile (interval 60 s), so only the requests meet the cut."""
    node = RedisProcess(tmp_path).start()
    (src_view, src_layers, kind), (dst_view, dst_layers, _) = _caches()
    opts = {"timeout_s": TIMEOUT_S, "health_interval_s": 60.0}
    a = remote_engine(node.url, src_view, instance="w2", **opts)
    b = remote_engine(node.url, dst_view, instance="r2", **opts)
    wr, rd = a.storage.tier("remote"), b.storage.tier("remote")
    try:
        # Connections into both pools: a's puts, b's gets (misses).
        first = list(range(100, 132))
        assert a.store(first, torch.arange(32)) == 32 and wr.flush(5)
        assert bool(b.retrieve(first, torch.arange(32)).all())
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(5)
        node = RedisProcess(tmp_path, node.port).start()
        put_errors = wr.stats.metrics.value("remote_puts_total", {"result": "error"})
        prompt = list(range(7000, 7032))
        slots, dst = torch.randperm(128)[:32], torch.randperm(128)[:32]
        assert a.store(prompt, slots) == 32 and wr.flush(5)
        assert wr.stats.metrics.value("remote_puts_total", {"result": "error"}) == put_errors
        assert _dbsize(node.port) == 4, "a put was lost to a dead pooled connection"
        b.clear(tier="l1")
        assert bool(b.retrieve(prompt, dst).all()), "a get was lost to a dead pooled connection"
        assert torch.equal(
            bits(slot_tokens(src_layers, kind)[:, slots]),
            bits(slot_tokens(dst_layers, kind)[:, dst]),
        )
        assert wr.up and rd.up
    finally:
        a.close()
        b.close()
        node.kill()


# -- plugin tiers that hang ---------------------------------------------------------------
PLUGINS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "plugins")
BLOCKS = 64


@pytest.fixture
def hanging(monkeypatch: pytest.MonkeyPatch):
    """The kvmesh_hanging_plugin module (tests/plugins), its factory hung until the
    test sets RELEASE, and the factory deadline short."""
    from kvmesh.common import plugins

    monkeypatch.syspath_prepend(PLUGINS)
    import kvmesh_hanging_plugin as mod

    monkeypatch.setattr(plugins, "FACTORY_TIMEOUT_S", 1.0)
    mod.RELEASE.clear()
    mod.CLOSED.clear()
    try:
        yield mod
    finally:
        mod.RELEASE.set()


def _plugin_engine(instance: str, factory: str):
    from kvmesh.common.config import EngineConfig, L1Config, TierPluginConfig
    from kvmesh.services.worker.engine import KVEngine

    view, layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    cfg = EngineConfig(
        chunk_size=8,
        model_name="plugin-hang",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        tiers=[TierPluginConfig(plugin=f"kvmesh_hanging_plugin:{factory}", name="t")],
    )
    return KVEngine(instance, 0, cfg, view), layers, kind


def _within(seconds: float, fn, *args):
    """fn(*args) on a thread: (its result or exception, seconds taken); fails the test
    when it has not returned after `seconds` (a hang)."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["value"] = exc
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds}s"
    return out["value"], out["took"]


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_plugin_factory_that_hangs_fails_the_start_naming_it(hanging) -> None:
    from kvmesh.common.plugins import PluginError

    err, took = _within(10, _plugin_engine, "hang-start", "make_tier_slowly")
    assert isinstance(err, PluginError), err
    assert "kvmesh_hanging_plugin:make_tier_slowly" in str(err)
    assert "did not start within 1s" in str(err)
    assert took < 4, took
    # The tier the factory builds after all is nobody's: it is closed.
    hanging.RELEASE.set()
    assert _wait_for(lambda: hanging.CLOSED == ["t"]), hanging.CLOSED


# -- a P2P server bound to a host name ----------------------------------------------------
@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """socket.getaddrinfo (the OS's resolver) with two test names: "slow.test" answers
    as localhost after 0.5 s, "nowhere.test" does not resolve, "hang.test" answers only
    after 30 s. The threads it ran on."""
    import socket

    real = socket.getaddrinfo
    asked: list[threading.Thread] = []

    def fake(host, *args, **kwargs):
        if host in ("slow.test", "nowhere.test", "hang.test"):
            asked.append(threading.current_thread())
        if host == "hang.test":
            time.sleep(30)  # a resolver that does not answer
        if host == "nowhere.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host == "slow.test":
            time.sleep(0.5)
            host = "localhost"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return asked


def _p2p_engine(host: str):
    from kvtest.p2p import engine_config, kv_cache

    from kvmesh.services.worker.engine import KVEngine

    return KVEngine(f"p2p-{host}", 0, engine_config(host=host), kv_cache(1))


def test_a_p2p_server_on_a_name_resolves_it_off_the_engines_loop(resolver) -> None:
    eng = _p2p_engine("slow.test")
    try:
        assert eng.p2p_endpoint.startswith("tcp://127.0.0.1:"), eng.p2p_endpoint
        assert resolver and not any(t is eng.loop._thread for t in resolver)
    finally:
        eng.close()


def test_a_p2p_server_on_a_name_that_does_not_resolve_says_so(resolver) -> None:
    from kvmesh.services.worker.p2p_server import P2PServerError

    with pytest.raises(P2PServerError, match=r"bind host 'nowhere.test' does not resolve"):
        _p2p_engine("nowhere.test")


def test_a_p2p_server_whose_resolver_hangs_fails_the_start_at_the_deadline(
    resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.common.transport import tcp_address
    from kvmesh.services.worker.p2p_server import P2PServerError

    monkeypatch.setattr(tcp_address, "RESOLVE_TIMEOUT_S", 0.5)
    err, took = _within(10, _p2p_engine, "hang.test")
    assert isinstance(err, P2PServerError), err
    assert "bind host 'hang.test': the resolver did not answer within 0.5s" in str(err)
    assert took < 4, took
