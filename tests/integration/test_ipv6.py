"""kvmesh over IPv6, with real processes.

The controller, the lookup-server and the cache-server bound to ::1 only (IPv4 loopback
does not reach them): an engine registers with the controller and keeps chunks in the
cache-server by bracketed URLs, `kvmesh status` and `kvmesh doctor` find every service
from a config naming ::1, and `kvmesh events` follows the controller's feed there. P2P:
an engine in a network namespace that has IPv6 addresses only serves its L1 to an engine
on this host, bitwise equal, over the ZMQ channel and over NIXL.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import yaml
import zmq
from aiohttp import web
from click.testing import CliRunner
from kvtest.controller import build_engine, store, tokens
from kvtest.netns import veth_namespace
from kvtest.paged import make_cache
from kvtest.prom import sample_sum
from kvtest.remote import remote_engine
from kvtest.service_process import KvmeshService, KvtestProcess, free_port
from kvtest.waiting import wait_for

from kvmesh.common.observability.http import start_app
from kvmesh.common.protocol.lookup import engine_endpoint
from kvmesh.common.transport.tcp_address import (
    bind,
    bind_host,
    connect,
    ipv4_first,
    local_host,
    tcp_endpoint,
)
from kvmesh.services.cli.main import cli

LOOP6 = "::1"
NS_IP6, HOST_IP6 = "fd7e:{:x}::2", "fd7e:{:x}::1"


def test_addresses_are_bracketed_and_resolved_as_zmq_takes_them() -> None:
    assert tcp_endpoint("::1", 5) == "tcp://[::1]:5"
    assert tcp_endpoint("[fd00::2]", 5) == "tcp://[fd00::2]:5"
    assert tcp_endpoint("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    assert tcp_endpoint("cache.svc", 5) == "tcp://cache.svc:5"
    assert bind_host("::1") == "[::1]"
    assert [bind_host(h) for h in ("", "0.0.0.0", "*")] == ["*"] * 3
    assert [bind_host(h) for h in ("::", "[::]")] == ["[::]"] * 2
    # A name keeps its IPv4 address where it has one: clients of "localhost" look there.
    assert bind_host("localhost") == "127.0.0.1"
    assert [local_host(h) for h in ("::", "0.0.0.0", "::1")] == ["127.0.0.1"] * 2 + ["::1"]


@pytest.mark.parametrize(
    ("endpoint", "named", "reached_at"),
    [("tcp://127.0.0.1:0", "tcp://127.0.0.1:", ["127.0.0.1"]),
     ("tcp://[::1]:0", "tcp://[::1]:", ["[::1]"]),
     ("tcp://[::]:0", "tcp://[::]:", ["127.0.0.1", "[::1]"])],
)  # fmt: skip
def test_a_bind_is_of_its_address_family_and_reached_there(endpoint, named, reached_at) -> None:
    # IPv6 only where the address is IPv6: an IPv4 bind on an IPv6 socket would be
    # named tcp://[::ffff:127.0.0.1]:port, what a worker tells its peers.
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    clients = []
    try:
        bind(server, endpoint)
        bound = server.getsockopt_string(zmq.LAST_ENDPOINT)
        assert bound.startswith(named)
        for host in reached_at:
            client = ctx.socket(zmq.DEALER)
            clients.append(client)
            connect(client, f"tcp://{host}:{bound.rpartition(':')[2]}")
            client.send(b"hi")
            assert server.poll(5000), f"nothing from {host}"
            assert server.recv_multipart()[1] == b"hi"
    finally:
        for sock in (server, *clients):
            sock.close(0)
        ctx.term()


def test_localhost_reaches_a_service_on_127_0_0_1_where_hosts_names_ipv6_first(tmp_path) -> None:
    """/etc/hosts of Debian, Fedora and every Kubernetes pod also names ::1 localhost:
    a client socket with IPv6 on would dial ::1 only, never the service on 127.0.0.1.
    Run in a mount namespace of its own, with such a hosts file."""
    hosts = tmp_path / "hosts"
    hosts.write_text("::1 localhost ip6-localhost\n127.0.0.1 localhost\n")
    script = (
        "import zmq\n"
        "from kvmesh.common.transport.tcp_address import bind, connect\n"
        "ctx = zmq.Context()\n"
        "s, c = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)\n"
        "bind(s, 'tcp://127.0.0.1:0')\n"
        "connect(c, 'tcp://localhost:' + s.getsockopt_string(zmq.LAST_ENDPOINT).split(':')[-1])\n"
        "c.send(b'x')\n"
        "print('reached' if s.poll(3000) else 'not reached')\n"
        "s.close(0); c.close(0); ctx.term()\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c",
         f'mount --bind "{hosts}" /etc/hosts && exec "{sys.executable}" -c "$0"', script],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "reached"


def test_an_unbracketed_ipv6_lookup_endpoint_is_taken_with_its_port_last() -> None:
    # What a chart's "tcp://$(POD_IP):7610" makes of an IPv6 pod address.
    assert engine_endpoint("tcp://fd00::5:7610", "i", 1) == "tcp://[fd00::5]:7611"
    assert engine_endpoint("tcp://[fd00::5]:7610", "i", 0) == "tcp://[fd00::5]:7610"
    for bad in ("tcp://fd00::5", "tcp://fd00::5:x", "tcp://host:port"):
        with pytest.raises(ValueError, match="expected tcp://host:port"):
            engine_endpoint(bad, "i", 0)


@pytest.mark.parametrize(
    ("host", "dual_stack", "reached_at"),
    [("::", True, ["127.0.0.1", "[::1]"]), ("::", False, ["127.0.0.1"]),
     ("0.0.0.0", True, ["127.0.0.1"])],
    ids=["dual", "no-ipv6-kernel", "ipv4"],
)  # fmt: skip
async def test_an_http_server_on_every_address_answers_where_it_should(
    host, dual_stack, reached_at, monkeypatch
) -> None:
    # A kernel without IPv6: "::" falls back to every IPv4 address.
    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: dual_stack)

    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/ping", ping)
    runner, port = await start_app(app, host, 0, keepalive_s=1, shutdown_s=1)
    try:
        async with aiohttp.ClientSession() as http:
            for where in reached_at:
                async with http.get(f"http://{where}:{port}/ping", timeout=5) as resp:
                    assert resp.status == 200 and await resp.text() == "pong", where
        # 0.0.0.0 is every IPv4 address only: an IPv4 firewall covers it.
        if "[::1]" not in reached_at:
            with socket.socket(socket.AF_INET6) as s6:
                assert s6.connect_ex(("::1", port)) != 0
    finally:
        await runner.cleanup()


def test_of_a_name_s_addresses_ipv4_comes_first() -> None:
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 1, 0, 0))
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 1))
    assert ipv4_first([v6, v4]) is v4 and ipv4_first([v6]) is v6


def test_a_cache_server_on_every_address_serves_each_listener_on_both_families(tmp_path) -> None:
    cache = KvmeshService(
        "cacheserver", tmp_path, free_port(),
        {"host": "::", "max-memory": "16MiB", "max-value-size": "1MiB", "data": True, "lm": True,
         "metrics-port": free_port()},
    )  # fmt: skip
    with cache.start(60):
        info = cache.ready_info
        for key in ("port", "data_port", "lm_port", "metrics_port"):
            for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                with socket.socket(family) as s:
                    s.settimeout(5)
                    assert s.connect_ex((host, info[key])) == 0, (key, host)


def _refused_on_ipv4(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def mesh6(tmp_path_factory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ipv6")
    ports = {
        name: free_port() for name in ("controller", "http", "events", "replay", "cache_metrics")
    }
    controller = KvmeshService(
        "controller", tmp, ports["controller"],
        {"host": LOOP6, "http-port": ports["http"], "heartbeat-misses": 3},
    )  # fmt: skip
    controller.env["KVMESH_CONTROLLER__EVENTS_PORT"] = str(ports["events"])
    controller.env["KVMESH_CONTROLLER__EVENTS_REPLAY_PORT"] = str(ports["replay"])
    started: list[KvmeshService] = []
    try:
        started.append(controller.start(60))
        url = tcp_endpoint(LOOP6, controller.port)
        lookup = KvmeshService(
            "lookup", tmp, free_port(), {"host": LOOP6, "controller-url": url, "chunk-size": 8}
        )
        started.append(lookup.start(60))
        cache = KvmeshService(
            "cacheserver", tmp, free_port(),
            {"host": LOOP6, "max-memory": "64MiB", "max-value-size": "1MiB", "data": True,
             "metrics-port": ports["cache_metrics"]},
        )  # fmt: skip
        started.append(cache.start(60))
        yield {"tmp": tmp, "controller": controller, "url": url, "lookup": lookup,
               "cache": cache, "http": ports["http"], "events": ports["events"],
               "replay": ports["replay"], "cache_metrics": ports["cache_metrics"]}  # fmt: skip
    finally:
        for p in reversed(started):
            p.stop()


def test_services_bound_to_ipv6_loopback_only(mesh6) -> None:
    for name in ("controller", "lookup", "cache"):
        assert _refused_on_ipv4(mesh6[name].port), f"{name} answers on 127.0.0.1"
        with socket.create_connection((LOOP6, mesh6[name].port), timeout=2):
            pass


def test_an_engine_registers_and_uses_the_cache_server_by_bracketed_urls(mesh6) -> None:
    eng = build_engine("inst-v6", mesh6["url"])
    try:
        keys = store(eng, tokens(32, 3))
        code, out = _cli(
            "status", "--json", "--timeout", "3", "--controller", mesh6["url"],
            "--lookup-url", tcp_endpoint(LOOP6, mesh6["lookup"].port),
            "--cacheserver-url", tcp_endpoint(LOOP6, mesh6["cache"].port),
        )  # fmt: skip
        view = json.loads(out)
        assert code == 0 and view["all_up"], view["services"]
        assert any(w["instance_id"] == "inst-v6" for w in view["workers"])
        assert len(keys) == 4
    finally:
        eng.close()

    src, src_layers, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=8)
    dst, dst_layers, _ = make_cache("cpu", torch.float16, False, blocks=16, block_size=8)
    toks = tokens(64, 4)
    url = f"kvmesh://[{LOOP6}]:{mesh6['cache'].port}"
    writer = remote_engine(url, src, instance="w6")
    try:
        assert writer.store(toks, torch.arange(64)) == 64
        assert writer.storage.tier("remote").flush(10)
    finally:
        writer.close()
    reader = remote_engine(url, dst, instance="r6")
    try:
        assert reader.lookup(toks, pin=False) == 64
        assert bool(reader.retrieve(toks, torch.arange(64)).all())
        assert reader.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == 64
        # The values came over the cache-server's data connections, on IPv6 too.
        metrics = f"http://[{LOOP6}]:{mesh6['cache_metrics']}/metrics"
        with urllib.request.urlopen(metrics, timeout=5) as resp:
            text = resp.read().decode()
        gets = sample_sum(text, "kvmesh_cacheserver_requests_total", listener="data", op="get")
        assert gets == 8  # 64 tokens, chunks of 8
        for got, want in zip(dst_layers, src_layers, strict=True):
            # Slots 0..63: the first 8 blocks of 8.
            assert torch.equal(got[:8].view(torch.int16), want[:8].view(torch.int16))
    finally:
        reader.close()


def test_status_doctor_and_events_find_services_named_by_an_ipv6_config(mesh6) -> None:
    tmp: Path = mesh6["tmp"]
    cfg = {
        "controller": {"host": LOOP6, "port": mesh6["controller"].port,
                       "http_port": mesh6["http"], "events_port": mesh6["events"],
                       "events_replay_port": mesh6["replay"]},
        "lookup": {"host": LOOP6, "port": mesh6["lookup"].port},
        "cacheserver": {"host": LOOP6, "port": mesh6["cache"].port},
    }  # fmt: skip
    path = tmp / "v6.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, out = _cli("status", "--json", "--timeout", "3", "--config", str(path))
    view = json.loads(out)
    assert code == 0 and view["all_up"], view["services"]
    assert view["services"]["controller"]["url"] == mesh6["url"]

    code, out = _cli("doctor", "--json", "--timeout", "3", "--config", str(path))
    checks = json.loads(out)["checks"]
    ports = [c for c in checks if c["name"] == "port" and "controller.port" in c["why"]]
    assert ports and ports[0]["level"] == "ok", ports
    assert f"[{LOOP6}]:{mesh6['controller'].port}" in ports[0]["why"]
    reach = [c for c in checks if c["name"] == "reach"]
    assert reach and all(c["level"] == "ok" for c in reach), reach

    # The events feed, by a bracketed host as well as a bare one.
    for host in (LOOP6, f"[{LOOP6}]"):
        code, out = _cli(
            "events", "--json", "--duration", "0.5", "--since", "0", "--controller", host,
            "--events-port", str(mesh6["events"]), "--replay-port", str(mesh6["replay"]),
        )  # fmt: skip
        items = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        # The replay answered within --duration: the feed was reached (an unreachable
        # one prints a "lost" line: the replay cut by --duration).
        assert code == 0 and not [i for i in items if i["kind"] == "lost"], out


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def netns6() -> Iterator[tuple[str, str]]:
    """A network namespace with IPv6 addresses only: (name, its address)."""
    with veth_namespace("kv6ns", HOST_IP6, NS_IP6, 64) as ns:
        yield ns


def _node(tmp: Path, prefix: list[str], **cfg: Any) -> KvtestProcess:
    node = KvtestProcess(
        f"node {cfg['name']}", "p2p", [json.dumps(cfg)],
        log=tmp / f"node-{cfg['name']}.log", ready_line="{", prefix=prefix,
    )  # fmt: skip
    node.launch()
    return node


@pytest.mark.parametrize("channel", ["zmq", "nixl"])
def test_p2p_from_an_engine_in_an_ipv6_only_namespace(tmp_path, netns6, channel) -> None:
    ns, ns_ip = netns6
    no_v4 = subprocess.run(
        ["ip", "netns", "exec", ns, "ip", "-4", "addr", "show", "scope", "global"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert no_v4.stdout.strip() == ""
    a = _node(tmp_path, ["ip", "netns", "exec", ns], name="a", seed=1, channel=channel,
              host=ns_ip)  # fmt: skip
    b = _node(tmp_path, [], name="b", channel=channel)
    try:
        info = a.wait_ready(30)
        assert "error" not in info, info
        assert info["endpoint"].startswith(f"tcp://[{ns_ip}]:")
        assert "error" not in b.wait_ready(30)
        stored = a(op="store", seed=7, n=80)
        assert stored["stored"] == 80
        b(op="locate", keys=stored["keys"], endpoint=info["endpoint"])
        got = wait_for(
            lambda: (r := b(op="retrieve", seed=7, n=80))["loaded"] == 80 and r,
            20, "B reads A's chunks over IPv6",
        )  # fmt: skip
        assert got["kv"] == stored["kv"] and got["p2p_tokens"] == 80
    finally:
        for node in (b, a):
            node.stop()
