"""`kvmesh status`, `kvmesh doctor` and `python -m benchmarks.load`, against real
processes on loopback (a controller, a lookup-server, a cache-server; an engine built in
this process registers with the controller). No vLLM.

status: a registered worker is listed with its chunks and L1 use; the cache-server's
stats show; a service that is not running is shown down (exit 3), within the deadline;
a worker that never answers the health fan-out is still listed, its L1 use unknown.
doctor: a misspelt key, an unwritable disk path and a port held by a stranger each
fail (exit 1); a good config naming the running services passes (exit 0), the ports
they hold counted as theirs. load: a short run with few clients has no error.
Under CURVE (the services keyed): status and doctor with a listed client key see
everything; with no key, an unlisted key or the wrong server key they fail within the
deadline and say which (the handshake as the client saw it), not just "no answer".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
import zmq
from click.testing import CliRunner
from kvtest.controller import ControllerProcess, build_engine, store, tokens
from kvtest.service_process import KvmeshService, free_port
from kvtest.waiting import wait_for

from kvmesh.common.protocol import controller as cproto
from kvmesh.services.cli.main import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("status")
    controller = ControllerProcess(tmp, snapshot=False).start()
    lookup = cache = eng = None
    try:
        lookup = KvmeshService(
            "lookup", tmp, free_port(), {"controller-url": controller.url, "chunk-size": 8}
        ).start(60)
        cache = KvmeshService(
            "cacheserver", tmp, free_port(), {"max-memory": "64MiB", "max-value-size": "1MiB"}
        ).start(60)
        eng = build_engine("inst-status", controller.url)
        keys = store(eng, tokens(32, 5))
        yield {"controller": controller, "lookup": lookup, "cache": cache, "keys": keys}
    finally:
        if eng is not None:
            eng.close()
        for p in (cache, lookup, controller):
            if p is not None:
                p.stop()


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def status_json(mesh: dict[str, Any], *extra: str) -> tuple[int, dict[str, Any]]:
    code, out = run_cli(
        "status", "--json", "--timeout", "3",
        "--controller", mesh["controller"].url,
        "--lookup-url", f"tcp://127.0.0.1:{mesh['lookup'].port}",
        *extra,
    )  # fmt: skip
    return code, json.loads(out)


def test_status_lists_the_registered_worker_and_its_chunks(mesh):
    cache_url = f"tcp://127.0.0.1:{mesh['cache'].port}"

    def listed() -> Any:
        code, view = status_json(mesh, "--cacheserver-url", cache_url)
        insts = [i for i in view["instances"] if i["instance_id"] == "inst-status"]
        return (code, view) if insts and insts[0]["chunks"].get("l1") == 4 else None

    code, view = wait_for(listed, 20, "the worker's 4 L1 chunks in status")
    assert code == 0 and view["all_up"], view["services"]
    (w,) = [w for w in view["workers"] if w["instance_id"] == "inst-status"]
    assert w["rank"] == 0 and w["chunks"] == {"l1": 4}
    # The health fan-out reached the engine: its L1 holds 4 chunks' bytes.
    assert w["health"]["l1_chunks"] == 4 and w["health"]["l1_used_bytes"] > 0
    (inst,) = [i for i in view["instances"] if i["instance_id"] == "inst-status"]
    assert inst["ranks"] == [0] and inst["l1_used_bytes"] == w["health"]["l1_used_bytes"]
    cs = view["services"]["cacheserver"]
    assert cs["up"] and cs["keys"] == 0 and cs["max_memory"] == 64 << 20

    code, text = run_cli(
        "status", "--timeout", "3", "--controller", mesh["controller"].url,
        "--lookup-url", f"tcp://127.0.0.1:{mesh['lookup'].port}", "--cacheserver-url", cache_url,
    )  # fmt: skip
    assert code == 0, text
    assert "inst-status" in text and "L1 CHUNKS" in text and "DOWN" not in text


def test_status_shows_a_down_service_as_down_within_the_deadline(mesh):
    dead = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    engine = f"eng=http://127.0.0.1:{free_port()}/metrics"
    code, view = status_json(mesh, "--cacheserver-url", dead, "--metrics", engine)
    took = time.monotonic() - t0
    assert code == 3 and not view["all_up"]
    cs = view["services"]["cacheserver"]
    assert cs == {"url": dead, "up": False, "error": cs["error"]} and cs["error"]
    assert view["services"]["controller"]["up"] and view["services"]["lookup"]["up"]
    assert view["engines"][0]["up"] is False
    assert took < 10, f"status took {took:.1f}s with a 3s deadline"

    code, text = run_cli("status", "--timeout", "1", "--controller", dead, "--lookup-url", dead,
                         "--cacheserver-url", dead)  # fmt: skip
    assert code == 3
    assert text.count("DOWN") == 3 and "Traceback" not in text


def test_status_lists_a_worker_that_does_not_answer_health_within_the_deadline(mesh):
    """A registered worker that never answers commands: the health fan-out runs out of
    time, but the worker list (and the controller being up) still shows."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(mesh["controller"].url)
    try:
        for msg in (
            cproto.Hello(1, cproto.PROTOCOL_VERSION, "mute"),
            cproto.Register(2, "inst-mute", 0, 1, ["0123456789abcdef"], "", 60.0),
        ):
            sock.send(cproto.encode(msg))
            assert sock.poll(10_000), f"no reply to {msg!r}"
            reply = cproto.decode_reply(sock.recv())
        assert isinstance(reply, cproto.RegisterReply), reply
        t0 = time.monotonic()
        code, view = status_json(mesh, "--cacheserver-url", f"tcp://127.0.0.1:{mesh['cache'].port}")
        took = time.monotonic() - t0
        assert code == 0 and view["services"]["controller"]["up"], view["services"]
        mute = [w for w in view["workers"] if w["instance_id"] == "inst-mute"]
        assert len(mute) == 1 and mute[0]["health"] is None
        (inst,) = [i for i in view["instances"] if i["instance_id"] == "inst-mute"]
        assert inst["l1_used_bytes"] is None
        assert took < 10, f"status took {took:.1f}s with a 3s deadline"
    finally:
        sock.close(0)
        ctx.term()


# -- doctor -------------------------------------------------------------------------------


def doctor(tmp_path: Path, config: dict[str, Any]) -> tuple[int, list[dict[str, str]]]:
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = run_cli("doctor", "--config", str(path), "--json", "--timeout", "2")
    report = json.loads(out)
    assert report["ok"] == (code == 0)
    return code, report["checks"]


def failures(checks: list[dict[str, str]]) -> list[str]:
    return [c["why"] for c in checks if c["level"] == "fail"]


def off_ports() -> dict[str, Any]:
    """Free ports for every service: the defaults may be in use on a shared machine."""
    return {
        "controller": {"port": free_port()},
        "lookup": {"port": free_port()},
        "cacheserver": {"port": free_port()},
        "bridge": {"port": free_port()},
    }


def good_config(mesh: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    return {
        **off_ports(),
        # The running services' own ports: held, by them.
        "lookup": {"port": mesh["lookup"].port, "controller_url": mesh["controller"].url},
        "cacheserver": {"port": mesh["cache"].port},
        "engine": {
            "l1": {"max_size": "64MiB", "reserve": "0"},
            "disk": {"enabled": True, "path": str(disk), "max_size": "16MiB"},
            "controller": {"enabled": True, "url": mesh["controller"].url},
            "remote": {"enabled": True, "url": f"kvmesh://127.0.0.1:{mesh['cache'].port}"},
        },
    }


def test_doctor_passes_a_good_config(mesh, tmp_path):
    code, checks = doctor(tmp_path, good_config(mesh, tmp_path))
    assert code == 0, failures(checks)
    whys = [c["why"] for c in checks if c["level"] == "ok"]
    assert any(f"lookup.port 127.0.0.1:{mesh['lookup'].port} is held by the running lookup" in w
               for w in whys), whys  # fmt: skip
    assert any(w.startswith("engine.controller.url") and "answers" in w for w in whys), whys
    assert any(w.startswith("engine.remote.url") and "answers" in w for w in whys), whys
    assert any("exists and is writable" in w for w in whys), whys
    names = {"config", "port", "nixl", "native", "disk", "memory", "reach"}
    assert {c["name"] for c in checks} >= names
    assert [c["level"] for c in checks if c["name"] == "native"] == ["ok"] * 3, checks


def test_doctor_fails_a_misspelt_key(tmp_path):
    code, checks = doctor(tmp_path, {"engine": {"l1": {"max_sise": "1GiB"}}})
    assert code == 1
    assert any("max_sise" in w for w in failures(checks)), checks


def test_doctor_fails_an_unwritable_disk_path(tmp_path):
    if os.geteuid() == 0:
        path = "/sys/kernel"  # root writes anywhere chmod allows; not in sysfs
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        path = str(ro)
    config = {**off_ports(), "engine": {"disk": {"enabled": True, "path": path}}}
    code, checks = doctor(tmp_path, config)
    assert code == 1
    assert any("not writable" in w and path in w for w in failures(checks)), checks


def test_doctor_fails_a_port_held_by_a_stranger(tmp_path):
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        port = stranger.getsockname()[1]
        config = {**off_ports(), "cacheserver": {"port": port}}
        code, checks = doctor(tmp_path, config)
    assert code == 1
    assert any(f"cacheserver.port 127.0.0.1:{port} is taken" in w for w in failures(checks)), checks


# -- load -----------------------------------------------------------------------------------


def test_load_benchmark_short_run_has_no_error():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.load", "--seconds", "3", "--clients", "8", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == 0 and result["clients"] == 8
    for op in ("lookup", "get"):
        assert result["ops"][op]["ops"] > 0 and result["ops"][op]["p99_ms"] > 0


# -- under CURVE --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def curve_mesh(tmp_path_factory):
    """A controller, lookup-server and cache-server with CURVE on (one config, the
    services' own client key), and a keyed engine registered with the controller.
    Configs for the CLI: admin (a listed key), intruder (a key no server lists),
    wrongserver (a listed key, but another server key), nokey (no security: section)."""
    from kvmesh.common.config import load_config
    from kvmesh.common.transport.curve import load_curve

    tmp = tmp_path_factory.mktemp("status-curve")
    keys, allowed = tmp / "keys", tmp / "allowed"
    for name in ("server", "services", "admin", "intruder", "other"):
        out = CliRunner().invoke(cli, ["keys", "generate", str(keys), "--name", name])
        assert out.exit_code == 0, out.output
    allowed.mkdir()
    for name in ("services", "admin"):
        (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())

    def security(client: str, server: str = "server.key_secret") -> dict[str, str]:
        return {
            "server_key": str(keys / server),
            "client_key": str(keys / f"{client}.key_secret"),
            "allowed_clients": str(allowed),
        }

    services_cfg = tmp / "services.yaml"
    services_cfg.write_text(yaml.safe_dump({"security": security("services")}))
    controller = ControllerProcess(tmp, snapshot=False)
    controller.env["KVMESH_CONFIG"] = str(services_cfg)
    procs = [controller]
    eng = None
    try:
        controller.start()
        lookup = KvmeshService(
            "lookup", tmp, free_port(), {"controller-url": controller.url, "chunk-size": 8}
        )
        cache = KvmeshService(
            "cacheserver", tmp, free_port(), {"max-memory": "64MiB", "max-value-size": "1MiB"}
        )
        for p in (lookup, cache):
            p.env["KVMESH_CONFIG"] = str(services_cfg)
            procs.append(p)
            p.start(60)
        curve = load_curve(load_config(services_cfg, env={}).security, server=True, client=True)
        eng = build_curve_engine("inst-curve", controller.url, curve)
        store(eng, tokens(32, 6))
        ports = {
            "controller": {"port": controller.port, "http_port": controller.http_port},
            "lookup": {"port": lookup.port},
            "cacheserver": {"port": cache.port},
        }
        configs = {}
        for name, sec in (("admin", security("admin")), ("intruder", security("intruder")),
                          ("wrongserver", security("admin", "other.key")),
                          ("nokey", None)):  # fmt: skip
            path = tmp / f"{name}.yaml"
            path.write_text(yaml.safe_dump({**ports, **({"security": sec} if sec else {})}))
            configs[name] = path
        yield {"controller": controller, "lookup": lookup, "cache": cache, "configs": configs,
               "security": security}  # fmt: skip
    finally:
        if eng is not None:
            eng.close()
        for p in reversed(procs):
            p.stop()


def build_curve_engine(instance: str, url: str, curve):
    from kvtest.controller import engine_config
    from kvtest.paged import make_cache

    from kvmesh.services.worker import controller_client as cc
    from kvmesh.services.worker.engine import KVEngine

    view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
    eng = KVEngine(instance, 0, engine_config(url), view, curve=curve)
    assert cc.wait_registered(eng.controller_client, 10.0), "keyed engine did not register"
    return eng


def curve_status(m: dict[str, Any], config: str, *extra: str) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    code, out = run_cli("status", "--config", str(m["configs"][config]), "--timeout", "2", *extra)
    took = time.monotonic() - t0
    return code, (json.loads(out) if "--json" in extra else {"text": out}), took


def test_status_with_the_right_key_sees_everything(curve_mesh):
    def listed() -> Any:
        code, view, _ = curve_status(curve_mesh, "admin", "--json")
        insts = [i for i in view["instances"] if i["instance_id"] == "inst-curve"]
        return (code, view) if insts and insts[0]["chunks"].get("l1") == 4 else None

    code, view = wait_for(listed, 20, "the keyed worker's 4 L1 chunks in status")
    assert code == 0 and view["all_up"], view["services"]
    for name in ("controller", "lookup", "cacheserver"):
        assert view["services"][name]["up"], (name, view["services"][name])
    # The health fan-out reached the keyed engine through the keyed controller.
    (w,) = [w for w in view["workers"] if w["instance_id"] == "inst-curve"]
    assert w["health"]["l1_chunks"] == 4


@pytest.mark.parametrize(
    ("config", "why"),
    [("nokey", "requires CURVE and this client has no key"),
     ("intruder", "refused this client's key"),
     ("wrongserver", "the handshake failed")],
)  # fmt: skip
def test_status_without_the_right_key_says_why_within_the_deadline(curve_mesh, config, why):
    code, view, took = curve_status(curve_mesh, config, "--json")
    assert code == 3 and not view["all_up"]
    for name in ("controller", "lookup", "cacheserver"):
        s = view["services"][name]
        assert not s["up"] and why in s["error"], (name, s)
    # 2 s deadline, then a short handshake probe: no hang on a box under load.
    assert took < 10, f"status took {took:.1f}s with a 2s deadline"

    code, text, _ = curve_status(curve_mesh, config)
    assert code == 3
    assert text["text"].count("DOWN") == 3 and why in text["text"], text["text"]
    assert "Traceback" not in text["text"]


def curve_doctor(m: dict[str, Any], tmp_path: Path, client: str | None):
    config = good_config(
        {"controller": m["controller"], "lookup": m["lookup"], "cache": m["cache"]}, tmp_path
    )
    if client is not None:
        config["security"] = m["security"](client)
    t0 = time.monotonic()
    code, checks = doctor(tmp_path, config)
    return code, checks, time.monotonic() - t0


def test_doctor_with_the_right_key_passes(curve_mesh, tmp_path):
    code, checks, _ = curve_doctor(curve_mesh, tmp_path, "admin")
    assert code == 0, failures(checks)
    whys = [c["why"] for c in checks if c["level"] == "ok"]
    port = curve_mesh["lookup"].port
    assert any(f"lookup.port 127.0.0.1:{port} is held by the running lookup" in w
               for w in whys), whys  # fmt: skip
    assert any(w.startswith("engine.controller.url") and "answers" in w for w in whys), whys
    assert any(w.startswith("engine.remote.url") and "answers" in w for w in whys), whys


@pytest.mark.parametrize(
    ("client", "why"),
    [(None, "requires CURVE and this client has no key"),
     ("intruder", "refused this client's key")],
)  # fmt: skip
def test_doctor_without_the_right_key_fails_saying_why(curve_mesh, tmp_path, client, why):
    code, checks, took = curve_doctor(curve_mesh, tmp_path, client)
    assert code == 1
    fails = failures(checks)
    for what in ("engine.controller.url", "engine.remote.url"):
        (line,) = [f for f in fails if f.startswith(what)]
        assert "does not answer" in line and why in line, line
    assert took < 30, f"doctor took {took:.1f}s with a 2s deadline"
