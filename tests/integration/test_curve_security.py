"""ZMQ CURVE and the HTTP admin token, with real services: a controller, a lookup-server
(itself a keyed client of the controller) and a cache-server, all keyed from one config.

A correctly keyed client registers, looks up, reads and runs admin commands; a client
with no key or with a key the servers do not list gets nothing from any of them, and
each refusal shows in the service's kvmesh_<service>_auth_failures_total. A wrong HTTP
token gets 401, the right one 200; a missing key file stops a service at start-up,
naming the key and the path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner
from kvtest.controller import ControllerProcess
from kvtest.remote import free_port
from kvtest.service_process import KvmeshService
from kvtest.waiting import wait_for

from kvmesh.common.config import load_config
from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.cacheserver_client import CacheServerClient
from kvmesh.common.transport.cacheserver_errors import CacheServerUnavailable
from kvmesh.common.transport.controller_client import ControllerConnection, ControllerUnavailable
from kvmesh.common.transport.curve import CurveKeys, apply_client, load_curve
from kvmesh.common.transport.lookup_service_client import (
    LookupServiceClient,
    LookupServiceError,
    LookupServiceUnavailable,
)
from kvmesh.services.cli.main import cli

REFUSED_S = 0.6  # a refused client hears nothing: how long to wait for that nothing
TOKEN = "s3cret-admin-token"


class Mesh:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        keys = tmp / "keys"
        runner = CliRunner()
        for name in ("server", "admin", "lookup", "intruder"):
            out = runner.invoke(cli, ["keys", "generate", str(keys), "--name", name])
            assert out.exit_code == 0, out.output
        assert (keys / "admin.key_secret").stat().st_mode & 0o777 == 0o600
        allowed = tmp / "allowed"
        allowed.mkdir()
        for name in ("admin", "lookup"):  # the intruder's key is not handed out
            shutil.copy(keys / f"{name}.key", allowed)
        (tmp / "token").write_text(TOKEN + "\n")
        self.config = tmp / "kvmesh.yaml"
        self.write_config(self.config, client="lookup")
        self.admin_config = tmp / "admin.yaml"
        self.write_config(self.admin_config, client="admin")
        self.intruder_config = tmp / "intruder.yaml"
        self.write_config(self.intruder_config, client="intruder")
        self.admin = self.keys(self.admin_config)
        self.intruder = self.keys(self.intruder_config)

    def write_config(self, path: Path, *, client: str) -> None:
        keys = self.tmp / "keys"
        path.write_text(
            "security:\n"
            f"  server_key: {keys / 'server.key_secret'}\n"
            f"  client_key: {keys / client}.key_secret\n"
            f"  allowed_clients: {self.tmp / 'allowed'}\n"
            f"  http_token_file: {self.tmp / 'token'}\n"
        )

    @staticmethod
    def keys(config: Path) -> CurveKeys:
        keys = load_curve(load_config(config, env={}).security, client=True)
        assert keys is not None
        return keys


def _service(module: str, mesh: Mesh, options: dict[str, object]) -> KvmeshService:
    svc = KvmeshService(module, mesh.tmp, free_port(), options)
    svc.env["KVMESH_CONFIG"] = str(mesh.config)
    return svc


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, dict]]:
    m = Mesh(tmp_path_factory.mktemp("curve"))
    controller = ControllerProcess(m.tmp, snapshot=False)
    controller.env["KVMESH_CONFIG"] = str(m.config)
    cache = _service(
        "cacheserver",
        m,
        {"metrics-port": free_port(), "max-memory": "64MiB", "max-value-size": "1MiB"},
    )
    cache_metrics = cache.cmd[cache.cmd.index("--metrics-port") + 1]
    lookup_metrics = free_port()
    procs = [controller, cache]
    try:
        for p in procs:
            p.launch()
        controller.wait_ready()
        # The lookup-server follows the controller at once: it starts once that serves.
        lookup = _service(
            "lookup",
            m,
            {"controller-url": controller.url, "metrics-port": lookup_metrics},
        )
        procs.append(lookup)
        lookup.launch()
        for p in (cache, lookup):
            p.wait_ready()
        yield (
            m,
            {
                "controller": controller,
                "lookup": lookup,
                "cache": cache,
                "metrics": {
                    "controller": f"{controller.http}/metrics",
                    "lookup": f"http://127.0.0.1:{lookup_metrics}/metrics",
                    "cacheserver": f"http://127.0.0.1:{cache_metrics}/metrics",
                },
            },
        )
    finally:
        for p in reversed(procs):
            p.stop()


def refusals(url: str, service: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:  # /metrics needs no token
        text = r.read().decode()
    pattern = rf'^kvmesh_{service}_auth_failures_total\{{[^}}]*reason="(\w+)"[^}}]*\}} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def _register(url: str, keys: CurveKeys | None) -> proto.RegisterReply:
    async def main() -> proto.RegisterReply:
        conn = ControllerConnection(url, timeout_s=REFUSED_S, client="test", curve=keys)
        try:
            await conn.connect()
            msg = proto.Register(conn.next_rid(), "curve-test", 0, 1, ["00000000000000aa"])
            return await conn.request(msg, proto.RegisterReply)
        finally:
            await conn.close()

    return asyncio.run(main())


def _lookup(url: str, keys: CurveKeys | None) -> object:
    async def main() -> object:
        async with LookupServiceClient(url, timeout_s=REFUSED_S, name="t", curve=keys) as c:
            await c.hello()
            # Answered from the controller's registry: the lookup-server's own keyed
            # link to the controller works too.
            best = await c.best_instances(hashes=[b"\x01" * 16])
            try:
                return await c.lookup("no-such-instance", [1, 2, 3])
            except LookupServiceError as exc:  # an answer: the server heard us
                return (best, exc)

    return asyncio.run(main())


def _get(port: int, keys: CurveKeys | None) -> object:
    async def main() -> object:
        client = CacheServerClient(
            f"tcp://127.0.0.1:{port}", timeout_s=REFUSED_S, curve=keys, data_connections=4
        )
        try:
            await client.connect()
            await client.put("k", b"value")
            value = await client.get_into("k", lambda meta, nbytes: None)
            # The data connection is plain TCP: a CURVE server never offers it.
            assert not client.data_path
            return None if value is None else bytes(value.data)
        finally:
            await client.close()

    return asyncio.run(main())


def _admin(controller_url: str, config: Path | None) -> tuple[int, str]:
    """`kvmesh admin workers` (in this process: the CLI is a client like any other)."""
    args = ["admin", "--url", controller_url, "--timeout", str(REFUSED_S)]
    if config is not None:
        args += ["--config", str(config)]
    out = CliRunner().invoke(cli, [*args, "workers"], env={"KVMESH_CONFIG": None})
    return out.exit_code, out.output


def test_keyed_client_is_served_and_others_are_refused_and_counted(mesh) -> None:
    m, s = mesh
    controller, lookup, cache = s["controller"], s["lookup"], s["cache"]
    lookup_url = f"tcp://127.0.0.1:{lookup.port}"

    assert _register(controller.url, m.admin).worker_id
    assert _lookup(lookup_url, m.admin) is not None
    assert _get(cache.port, m.admin) == b"value"

    for keys in (None, m.intruder):
        with pytest.raises(ControllerUnavailable):
            _register(controller.url, keys)
        with pytest.raises(LookupServiceUnavailable):
            _lookup(lookup_url, keys)
        with pytest.raises(CacheServerUnavailable):
            _get(cache.port, keys)

    # The refused clients above may have closed before a busy machine got to their
    # handshake: two more stay connected (and retrying) until each refusal is counted.
    ports = {"controller": controller.port, "lookup": lookup.port, "cacheserver": cache.port}
    for service, url in s["metrics"].items():
        endpoint = f"tcp://127.0.0.1:{ports[service]}"
        with _knocking(endpoint, None), _knocking(endpoint, m.intruder):
            wait_for(
                lambda url=url, service=service: (
                    (c := refusals(url, service)) and c["no_key"] >= 1 and c["unknown_key"] >= 1
                ),
                timeout=10,
                what=f"{service} refusals counted",
            )


@contextlib.contextmanager
def _knocking(endpoint: str, keys: CurveKeys | None) -> Iterator[None]:
    """A client that keeps trying to connect (and send) while the block runs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    apply_client(sock, keys, endpoint)
    sock.connect(endpoint)
    sock.send(b"hello?", zmq.NOBLOCK)
    try:
        yield
    finally:
        sock.close(0)
        ctx.term()


def test_admin_cli_needs_the_key(mesh) -> None:
    m, s = mesh
    url = s["controller"].url
    code, output = _admin(url, m.admin_config)
    assert code == 0, output
    for config in (None, m.intruder_config):
        code, output = _admin(url, config)
        assert code == 3, output
        assert "did not answer" in output


def test_http_admin_needs_the_token(mesh) -> None:
    _, s = mesh
    base = s["controller"].http

    def status(path: str, token: str | None, method: str = "GET") -> int:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        data = b"{}" if method == "POST" else None
        req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status("/workers", None) == 401
    assert status("/workers", "wrong") == 401
    assert status("/clear", "wrong", "POST") == 401
    assert status("/workers", TOKEN) == 200
    assert status("/clear", TOKEN, "POST") == 200
    # Probes and scrapers carry no token.
    assert status("/metrics", None) == 200
    assert status("/health", None) == 200


def test_missing_key_file_stops_the_service_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "server.key_secret"
    config = tmp_path / "bad.yaml"
    config.write_text(f"security:\n  server_key: {missing}\n  allowed_clients: {tmp_path}\n")
    env = {**os.environ, "KVMESH_CONFIG": str(config)}
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cacheserver", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert "security.server_key" in out.stderr and str(missing) in out.stderr, out.stderr


def test_keys_files_are_checked(tmp_path: Path) -> None:
    """A public key file where a secret one is needed, and a file that is no key."""
    out = CliRunner().invoke(cli, ["keys", "generate", str(tmp_path), "--name", "s"])
    assert out.exit_code == 0, out.output
    (tmp_path / "junk.key").write_text("not a certificate\n")
    from kvmesh.common.config import ConfigError
    from kvmesh.common.config.schema import SecurityConfig

    public = SecurityConfig(server_key=str(tmp_path / "s.key"), allowed_clients=str(tmp_path))
    with pytest.raises(ConfigError, match=r"security.server_key.*s\.key.*secret"):
        load_curve(public, server=True)
    junk = SecurityConfig(server_key=str(tmp_path / "junk.key"))
    with pytest.raises(ConfigError, match=r"security.server_key.*junk\.key"):
        load_curve(junk)
    assert json.dumps(load_curve(SecurityConfig())) == "null"  # CURVE off


def _p2p_hello(endpoint: str, keys: CurveKeys | None) -> object:
    from kvmesh.common.protocol import p2p
    from kvmesh.common.transport.peer_conn import PeerConnections

    async def main() -> object:
        conns = PeerConnections(keys)
        try:
            conn = conns.get(endpoint)
            msg = p2p.Hello(conn.next_rid(), p2p.PROTOCOL_VERSION, "test")
            reply, _ = await conn.request(msg, REFUSED_S)
            return reply
        finally:
            conns.drop(endpoint)

    return asyncio.run(main())


def test_worker_p2p_server_needs_the_key(mesh) -> None:
    """The engine's P2P server (in this process: the engine is a library) serves a
    keyed peer only, and counts the others in kvmesh_worker_auth_failures_total."""
    from kvtest.p2p import engine_config, kv_cache

    from kvmesh.common.protocol import p2p
    from kvmesh.common.transport.peer_conn import PeerError
    from kvmesh.services.worker.engine import KVEngine

    m, _ = mesh
    server_keys = load_curve(load_config(m.config, env={}).security, server=True, client=True)
    engine = KVEngine("curve-p2p", 0, engine_config("zmq"), kv_cache(1), curve=server_keys)
    try:
        endpoint = engine.p2p_endpoint
        assert isinstance(_p2p_hello(endpoint, m.admin), p2p.HelloReply)
        for keys in (None, m.intruder):
            with pytest.raises(PeerError):
                _p2p_hello(endpoint, keys)

        def counted() -> bool:
            text = engine.stats.metrics.render().decode()
            found = {
                reason: float(value)
                for reason, value in re.findall(
                    r'^kvmesh_worker_auth_failures_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)$',
                    text,
                    re.MULTILINE,
                )
            }
            return found.get("no_key", 0) >= 1 and found.get("unknown_key", 0) >= 1

        wait_for(counted, timeout=5, what="worker refusals counted")
    finally:
        engine.close()


def test_bridge_transfers_needs_the_token() -> None:
    """The bridge's /transfers (admin-like: who talks to whom) takes the token; its
    /metrics and /health stay open."""
    import aiohttp

    from kvmesh.common.config import BridgeConfig
    from kvmesh.common.config.schema import DecoderConfig
    from kvmesh.services.bridge.client import BridgeError, fetch_transfers
    from kvmesh.services.bridge.server import BridgeServer

    async def main() -> None:
        cfg = BridgeConfig(port=0, decoders=[DecoderConfig(url="http://127.0.0.1:9")])
        bridge = BridgeServer(cfg, http_token=TOKEN)
        await bridge.start()
        base = f"http://127.0.0.1:{bridge.port}"
        try:
            assert await fetch_transfers(base, 5.0, TOKEN) == []
            for token in ("", "wrong"):
                with pytest.raises(BridgeError, match="401"):
                    await fetch_transfers(base, 5.0, token)
            async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as r:
                assert r.status == 200
        finally:
            await bridge.stop()

    asyncio.run(main())
