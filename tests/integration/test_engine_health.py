"""The engine's metrics port (engine.metrics_port + rank): /health reports what the engine
did and what its tiers and controller link are, true to real processes (a disk tier on
a real directory, a real cache-server for the remote tier, a real controller); /metrics
still parses as Prometheus text; other paths 404; close() frees the port. And every
kind of kvmesh process answers GET /health with 200 and a JSON status."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
import zmq
from kvtest import p2p
from kvtest.bridge import BridgeProcess
from kvtest.controller import ControllerProcess
from kvtest.http_backend import HttpBackend
from kvtest.paged import make_cache
from kvtest.remote import CacheServerProcess
from kvtest.service_process import KvmeshService, free_port
from kvtest.waiting import wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.common.config import (
    DiskConfig,
    EngineConfig,
    EngineControllerConfig,
    L1Config,
    P2PConfig,
    PDConfig,
    RemoteConfig,
)
from kvmesh.common.observability import Metrics
from kvmesh.common.observability.metrics import serve_metrics
from kvmesh.common.protocol import p2p as proto
from kvmesh.services.worker.engine import KVEngine

CHUNK = 8
# A loaded 2-core box: the remote monitor needs a few failed pings to call it down.
SETTLE_S = 30.0


def http(url: str, method: str = "GET") -> tuple[int, bytes, str]:
    """(status, body, content type) of one request, error statuses included."""
    req = urllib.request.Request(url, method=method, data=b"x" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def health(port: int) -> dict[str, Any]:
    status, body, ctype = http(f"http://127.0.0.1:{port}/health")
    # 200 even when degraded: a liveness probe must not restart vLLM for a cache outage.
    assert status == 200 and ctype == "application/json", (status, body)
    return json.loads(body)


def port_free(port: int) -> bool:
    """Nothing listens, and a new engine could bind it (with SO_REUSEADDR, as the
    server does: the connections this test made may sit in TIME_WAIT)."""
    with socket.socket() as sock:
        sock.settimeout(5)
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def engine_config(port: int, **sections: Any) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="health-test",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        metrics_port=port,
        **sections,
    )


def test_health_is_true_to_the_tiers_the_controller_and_the_chunks(tmp_path: Path) -> None:
    port = free_port()
    with (
        CacheServerProcess(tmp_path) as cache,
        ControllerProcess(tmp_path, snapshot=False) as controller,
    ):
        cfg = engine_config(
            port,
            disk=DiskConfig(enabled=True, path=str(tmp_path / "disk"), max_size=64 << 20),
            remote=RemoteConfig(enabled=True, url=cache.url, health_interval_s=0.1, timeout_s=1.0),
            controller=EngineControllerConfig(
                enabled=True, url=controller.url, heartbeat_s=0.2, timeout_s=1.0
            ),
        )
        view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
        eng = KVEngine("health", 0, cfg, view)
        try:
            report = wait_for(
                lambda: (h := health(port))["status"] == "ok" and h,
                SETTLE_S,
                "status ok (remote up, registered)",
            )
            assert (report["instance"], report["rank"], report["closed"]) == ("health", 0, False)
            assert report["tiers"] == {
                "disk": {"state": "ok", "reason": ""},
                "remote": {"state": "up", "reason": ""},
            }
            assert report["controller"] == {
                "configured": True,
                "registered": True,
                "url": controller.url,
            }
            assert report["pd"] == {"role": "none", "sending": 0, "receiving": 0}
            assert report["events"]["buffer_dropped"] == 0
            assert report["events"]["controller_dropped"] == 0
            assert report["l1"]["chunks"] == 0 and report["l1"]["used_bytes"] == 0
            assert report["l1"]["capacity_bytes"] == eng.pool.capacity_bytes > 0
            assert report["problems"] == []

            stored = eng.store(list(range(3 * CHUNK)), torch.arange(3 * CHUNK))
            assert stored == 3 * CHUNK
            l1 = health(port)["l1"]
            assert l1["chunks"] == 3
            assert l1["used_bytes"] == 3 * eng.layout.chunk_nbytes(CHUNK)

            cache.kill()
            report = wait_for(
                lambda: (h := health(port))["tiers"]["remote"]["state"] == "down" and h,
                SETTLE_S,
                "remote down",
            )
            assert report["status"] == "degraded"
            assert report["tiers"]["remote"]["reason"]
            assert report["tiers"]["disk"]["state"] == "ok"
            assert any(p.startswith("tier remote down") for p in report["problems"])
            assert report["l1"]["chunks"] == 3  # L1 keeps serving through the outage

            cache.start()
            report = wait_for(
                lambda: (h := health(port))["status"] == "ok" and h,
                SETTLE_S,
                "status ok after the cache-server restarted",
            )
            assert report["tiers"]["remote"]["state"] == "up" and report["problems"] == []

            status, body, ctype = http(f"http://127.0.0.1:{port}/metrics")
            assert status == 200 and ctype.startswith("text/plain")
            samples = {
                s.name: s.value
                for family in text_string_to_metric_families(body.decode())
                for s in family.samples
            }
            assert samples["kvmesh_l1_chunks"] == 3
            # prometheus_client's negotiation: OpenMetrics for a client that asks.
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/metrics",
                headers={"Accept": "application/openmetrics-text; version=1.0.0"},
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                ctype = resp.headers["Content-Type"]
                assert ctype.startswith("application/openmetrics-text")
                assert resp.read().rstrip().endswith(b"# EOF")

            assert http(f"http://127.0.0.1:{port}/healthz")[0] == 200
            assert http(f"http://127.0.0.1:{port}/health", "HEAD")[:2] == (200, b"")
            assert http(f"http://127.0.0.1:{port}/metrics", "HEAD")[:2] == (200, b"")
            assert http(f"http://127.0.0.1:{port}/")[0] == 404
            assert http(f"http://127.0.0.1:{port}/metricsx")[0] == 404
            assert http(f"http://127.0.0.1:{port}/health", "POST")[0] == 405
        finally:
            eng.close()
        assert port_free(port)


def test_health_is_degraded_without_the_controller_or_a_usable_disk(tmp_path: Path) -> None:
    """Nobody listens at the controller's address and the disk's directory is a file:
    degraded, with both reasons, and still 200."""
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    port = free_port()
    cfg = engine_config(
        port,
        disk=DiskConfig(enabled=True, path=str(blocker), max_size=64 << 20),
        controller=EngineControllerConfig(
            enabled=True, url=f"tcp://127.0.0.1:{free_port()}", heartbeat_s=0.2, timeout_s=0.5
        ),
    )
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
    eng = KVEngine("lonely", 0, cfg, view)
    try:
        report = health(port)
        assert report["status"] == "degraded"
        assert report["tiers"]["disk"]["state"] == "degraded"
        assert report["tiers"]["disk"]["reason"]
        assert report["controller"]["configured"] and not report["controller"]["registered"]
        assert len(report["problems"]) == 2, report["problems"]
    finally:
        eng.close()
    assert port_free(port)


def test_health_counts_a_decoders_pd_receive_buffers() -> None:
    """A prefiller (a raw DEALER here) allocates receive buffers on a decoder: /health
    shows the decoder's role and one transfer in flight until it is cancelled."""
    port = free_port()
    cfg = EngineConfig(
        chunk_size=p2p.CHUNK,
        model_name="health-pd",
        l1=L1Config(max_size=4 << 20, reserve=0, alloc_timeout_s=0.2),
        p2p=P2PConfig(channel="zmq", timeout_s=2.0),
        pd=PDConfig(role="receiver", timeout_s=30.0),
        metrics_port=port,
        close_flush_s=0,
    )
    decoder = KVEngine("decoder", 0, cfg, p2p.kv_cache(None))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger, sock.rcvtimeo = 0, 10_000

    def ask(msg: object) -> object:
        sock.send_multipart([proto.encode(msg)])
        return proto.decode_reply(sock.recv_multipart()[:1])

    try:
        sock.connect(decoder.p2p_endpoint)
        assert health(port)["pd"] == {"role": "receiver", "sending": 0, "receiving": 0}
        tokens = p2p.prompt(8, 2 * p2p.CHUNK)
        alloc = proto.AllocChunks(
            rid=1,
            version=proto.PROTOCOL_VERSION,
            transfer_id="health",
            keys=[k.to_str() for _, _, k in decoder.chunks(tokens)],
            chunk_shape=list(decoder.layout.chunk_shape(p2p.CHUNK)),
            dtype="float16",
            fmt=int(decoder.chunk_format),
            last_tokens=p2p.CHUNK,
            deadline=time.time() + 30.0,
        )
        reply = ask(alloc)
        assert isinstance(reply, proto.AllocChunksReply) and len(reply.slots) == 2
        assert health(port)["pd"]["receiving"] == 1
        cancel = proto.CancelChunks(2, proto.PROTOCOL_VERSION, reply.alloc_id)
        assert ask(cancel) == proto.CancelChunksReply(2, True)
        assert health(port)["pd"]["receiving"] == 0
    finally:
        sock.close(0)
        ctx.term()
        decoder.close()


def test_every_kind_of_kvmesh_process_answers_health(tmp_path: Path) -> None:
    decoder = HttpBackend("fail").start()  # answers its own /health 200
    controller = ControllerProcess(tmp_path, snapshot=False)
    cache = CacheServerProcess(tmp_path, metrics=True)
    lookup_metrics = free_port()
    bridge = BridgeProcess(
        tmp_path,
        prefillers=[decoder.url],
        decoders=[(decoder.url, ["tcp://127.0.0.1:7650"])],
        metrics_port=free_port(),
    )
    engine_port = free_port()
    procs: list[Any] = [controller, cache, bridge]
    eng: KVEngine | None = None
    try:
        bridge.launch()  # the slowest to start: meanwhile the others
        controller.start()
        cache.start()
        lookup = KvmeshService(
            "lookup",
            tmp_path,
            free_port(),
            {"controller-url": controller.url, "chunk-size": CHUNK, "metrics-port": lookup_metrics},
        )
        procs.append(lookup)
        lookup.start(60)
        bridge.wait_ready()
        view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
        eng = KVEngine("every", 0, engine_config(engine_port), view)
        urls = {
            "controller": f"{controller.http}/health",
            "lookup-server": f"http://127.0.0.1:{lookup_metrics}/health",
            "cache-server": f"http://127.0.0.1:{cache.metrics_port}/health",
            "bridge": f"{bridge.url}/health",
            "bridge metrics port": f"http://127.0.0.1:{bridge.ready_info['metrics_port']}/health",
            "engine": f"http://127.0.0.1:{engine_port}/health",
        }
        for name, url in urls.items():
            # The bridge answers 503 until its first check of the decoder.
            _, body, ctype = wait_for(
                lambda url=url: (r := http(url))[0] == 200 and r, SETTLE_S, f"{name} 200"
            )
            assert ctype.startswith("application/json"), (name, ctype)
            assert json.loads(body)["status"] == "ok", (name, body)
    finally:
        if eng is not None:
            eng.close()
        for proc in reversed(procs):
            proc.stop()
        decoder.stop()


def test_a_failing_health_report_is_a_500_and_the_port_keeps_serving() -> None:
    def broken() -> dict[str, Any]:
        raise KeyError("tier")

    servers = [serve_metrics(Metrics(), 0, health=broken), serve_metrics(Metrics(), 0)]
    try:
        bad, plain = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        status, body, ctype = http(f"{bad}/health")
        assert status == 500 and ctype == "application/json"
        assert json.loads(body) == {"status": "error", "error": "KeyError: 'tier'"}
        assert http(f"{bad}/metrics")[0] == 200
        assert json.loads(http(f"{plain}/health")[1]) == {"status": "ok"}
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
