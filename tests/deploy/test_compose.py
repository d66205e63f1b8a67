"""compose.yaml for real: a private Docker daemon, the images built from this tree
without a registry (docker/build.sh), `docker compose up --wait`, completions through
the bridge, a repeat served from kvmesh, and a cache-server restart under load.

Slow the first time (debootstrap, wheels, two images: ~10 min on 2 cores); the build
reuses what it made before when nothing changed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtest.bridge import parse_metrics
from kvtest.waiting import wait_for

from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = [
    str(ROOT / ".tools/bin/docker-compose"),
    "--project-directory", str(ROOT),
    "-f", str(ROOT / "compose.yaml"),
    "-f", str(ROOT / "docker/compose/ci.yaml"),
]  # fmt: skip
BRIDGE = "http://127.0.0.1:7630"
WORKER_METRICS = "http://127.0.0.1:7640/metrics"
CACHESERVER_METRICS = "http://127.0.0.1:7622/metrics"

# Building images and starting vLLM in containers take minutes, not seconds.
pytestmark = pytest.mark.timeout(2400)


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> str:
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd[:4])}... exited {proc.returncode}:\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


@pytest.fixture(scope="module")
def docker_env() -> dict[str, str]:
    """The environment of docker commands: a private daemon (docker/dockerd.sh)."""
    for tool in ("dockerd", "debootstrap", "docker"):
        assert shutil.which(tool), f"{tool} missing: scripts/setup.sh installs it"
    assert (ROOT / ".tools/bin/docker-compose").is_file(), "run scripts/setup.sh"
    env = dict(os.environ)
    env["DOCKER_HOST"] = _run([str(ROOT / "docker/dockerd.sh")], env, 120).strip()
    _run([str(ROOT / "docker/build.sh")], env, 1800)
    return env


def _http(method: str, url: str, body: Any = None, timeout_s: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        raw = resp.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def complete(prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return _http("POST", BRIDGE + "/v1/completions", body)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(_http("GET", url, timeout_s=5))


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    return sum(
        v
        for k, v in values.items()
        if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())
    )


def hit_tokens() -> float:
    return metric(metrics(WORKER_METRICS), "kvmesh_tokens_hit_total")


@pytest.fixture(scope="module")
def mesh(docker_env: dict[str, str]) -> Iterator[dict[str, str]]:
    _run([*COMPOSE, "--profile", "pd", "down", "-v", "--remove-orphans"], docker_env, 120)
    try:
        _run([*COMPOSE, "up", "--wait", "--wait-timeout", "600"], docker_env, 700)
    except AssertionError:
        print(_run([*COMPOSE, "logs", "--tail", "60"], docker_env, 60))
        raise
    yield docker_env
    logs = subprocess.run(
        [*COMPOSE, "logs", "--tail", "40"], env=docker_env, capture_output=True, text=True
    )
    print(logs.stdout[-20000:])
    _run([*COMPOSE, "--profile", "pd", "down", "-v", "--remove-orphans"], docker_env, 180)


def test_compose_file_is_valid() -> None:
    # Needs no engine: compose checks the files and their interpolation on its own.
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"}
    _run([*COMPOSE, "config", "-q"], env, 60)
    _run([*COMPOSE[:-2], "--profile", "pd", "config", "-q"], env, 60)


def test_every_service_is_healthy(mesh: dict[str, str]) -> None:
    ps = _run([*COMPOSE, "ps", "--format", "json"], mesh, 60)
    rows = [json.loads(line) for line in ps.splitlines() if line.strip()]
    states = {row["Service"]: row["Health"] for row in rows}
    assert states == dict.fromkeys(
        ["controller", "lookup", "cacheserver", "worker", "bridge"], "healthy"
    )
    health = _http("GET", BRIDGE + "/health")
    assert health["status"] == "ok", health


# -- non-root ------------------------------------------------------------------------------
KVMESH_UID = 10001  # docker/Dockerfile's KVMESH_UID
IMAGES = ["kvmesh:0.1.0", "kvmesh-vllm:0.1.0"]
# The uids of every process in a container (its /proc), and the owner of each path
# given, as "uid:gid", or "missing".
PROC_UIDS = """
import glob, os, sys
uids = set()
for status in glob.glob("/proc/[0-9]*/status"):
    try:
        uids |= {line.split()[1] for line in open(status) if line.startswith("Uid:")}
    except OSError:
        pass  # a process that just ended
print(" ".join(sorted(uids)))
for path in sys.argv[1:]:
    try:
        st = os.stat(path)
        print(f"{st.st_uid}:{st.st_gid}", os.access(path, os.W_OK))
    except FileNotFoundError:
        print("missing")
"""
# service -> the directories it writes: its volume (the image's /var/lib/kvmesh, whose
# ownership a new named volume copies), what the process made there at start (the disk
# tier, the spill, vLLM's VLLM_CACHE_ROOT), and the worker's HOME (a tmpfs of kvmesh's).
WRITES = {
    "controller": ["/var/lib/kvmesh"],
    "lookup": [],
    "cacheserver": ["/var/lib/kvmesh", "/var/lib/kvmesh/spill"],
    "worker": [
        "/var/lib/kvmesh",
        "/var/lib/kvmesh/disk",
        "/var/lib/kvmesh/vllm-cache",
        "/home/kvmesh",
    ],
    "bridge": [],
}


def test_images_run_as_non_root(docker_env: dict[str, str]) -> None:
    for image in IMAGES:
        user = _run(["docker", "image", "inspect", "--format", "{{.Config.User}}", image],
                    docker_env, 60).strip()  # fmt: skip
        assert user == f"{KVMESH_UID}:{KVMESH_UID}", (image, user)
        out = _run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "id", image],
                   docker_env, 120)  # fmt: skip
        assert out.split()[:2] == [f"uid={KVMESH_UID}(kvmesh)", f"gid={KVMESH_UID}(kvmesh)"], out
        home = _run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", image,
                     "-c", 'echo "$HOME"; stat -c %u "$HOME" /var/lib/kvmesh'],
                    docker_env, 120).split()  # fmt: skip
        assert home == ["/home/kvmesh", str(KVMESH_UID), str(KVMESH_UID)], (image, home)


def test_every_container_runs_as_kvmesh_and_writes_its_volume(mesh: dict[str, str]) -> None:
    for service, paths in WRITES.items():
        out = _run([*COMPOSE, "exec", "-T", service, "python", "-c", PROC_UIDS, *paths],
                   mesh, 60).splitlines()  # fmt: skip
        # Every process, PID 1 (compose's init) and vLLM's or kvmesh's included.
        assert out[0] == str(KVMESH_UID), (service, out)
        for path, owner in zip(paths, out[1:], strict=True):
            assert owner == f"{KVMESH_UID}:{KVMESH_UID} True", (service, path, owner)
        cid = _run([*COMPOSE, "ps", "-q", service], mesh, 60).strip()
        host = _run(["docker", "inspect", "--format",
                     "{{json .HostConfig.CapDrop}} {{json .HostConfig.SecurityOpt}}", cid],
                    mesh, 60).split()  # fmt: skip
        assert [json.loads(h) for h in host] == [["ALL"], ["no-new-privileges:true"]], service


# -- read-only root filesystem --------------------------------------------------------------
# For each directory given: whether a new file could be made there ("written", or the
# errno's name), and the mount point holding it ("/": the container's root filesystem).
WRITE_PROBE = """
import errno, os, sys
points = [line.split()[4] for line in open("/proc/self/mountinfo")]
for path in sys.argv[1:]:
    name = os.path.join(path, f".kvmesh-write-probe-{os.getpid()}")
    try:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(name)
        result = "written"
    except OSError as exc:
        result = errno.errorcode[exc.errno]
    mount = max((p for p in points if path == p or path.startswith(p.rstrip("/") + "/")), key=len)
    print(path, result, mount)
"""
# Outside every mount: / (root's: EACCES, not EROFS, on a writable root filesystem) and
# /var/cache/kvmesh (kvmesh's in both images, the chart's disk tier mount point, nothing
# mounted on it in compose: writable unless the root filesystem is read-only).
UNMOUNTED = ["/", "/var/cache/kvmesh"]


def test_root_filesystem_is_read_only(mesh: dict[str, str]) -> None:
    """compose.yaml's read_only: a write outside the mounts fails with EROFS in every
    container, and every directory a service writes (WRITES, /tmp) is a mount of its own
    that takes the write, while the mesh is up and serving (test_every_service_is_healthy)."""
    for service, paths in WRITES.items():
        cid = _run([*COMPOSE, "ps", "-q", service], mesh, 60).strip()
        ro = _run(["docker", "inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", cid],
                  mesh, 60).strip()  # fmt: skip
        assert ro == "true", service
        writable = [*paths, "/tmp"]
        out = _run([*COMPOSE, "exec", "-T", service, "python", "-c", WRITE_PROBE,
                    *UNMOUNTED, *writable], mesh, 60).splitlines()  # fmt: skip
        got = {}
        for line in out:
            path, result, mount = line.rsplit(" ", 2)
            got[path] = (result, mount)
        for path in UNMOUNTED:
            assert got[path][0] == "EROFS", (service, path, got[path])
        for path in writable:
            result, mount = got[path]
            assert result == "written", (service, path, result)
            assert mount != "/", (service, path, "on the root filesystem")


def test_repeat_of_a_long_prompt_is_served_from_kvmesh(mesh: dict[str, str]) -> None:
    prompt = prompt_tokens(2000, seed=11)
    before = hit_tokens()
    first = complete(prompt)
    assert first["choices"][0]["text"]
    assert hit_tokens() == before, "a new prompt cannot hit"
    second = complete(prompt)
    # 7 full 256-token chunks of 2000 tokens; vLLM always computes the last token.
    assert hit_tokens() - before >= 7 * 256
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_cacheserver_restart_under_load(mesh: dict[str, str]) -> None:
    errors: list[str] = []
    served = [0]
    stop = threading.Event()

    def load() -> None:
        seed = 100
        while not stop.is_set():
            seed += 1
            try:
                complete(prompt_tokens(600, seed=seed))
                served[0] += 1
            except (urllib.error.URLError, OSError) as exc:
                errors.append(repr(exc))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        wait_for(lambda: served[0] >= 2, 120)
        _run([*COMPOSE, "restart", "cacheserver"], mesh, 120)
        at_restart = served[0]
        wait_for(lambda: served[0] >= at_restart + 3, 180)
    finally:
        stop.set()
        thread.join(120)
    assert not errors, errors[:3]

    # Back up: the worker's remote tier writes to the new cache-server again, and a
    # repeat hits.
    _run([*COMPOSE, "exec", "-T", "cacheserver", "kvmesh", "probe",
          "http://127.0.0.1:7622/healthz"], mesh, 60)  # fmt: skip
    # The worker finds the store back at its next health ping: a prompt stored before
    # that has its remote puts dropped (result "down"), by design.
    wait_for(lambda: metric(metrics(WORKER_METRICS), "kvmesh_remote_up") >= 1, 60)
    prompt = prompt_tokens(1200, seed=12)
    before = hit_tokens()
    complete(prompt)

    def stored_remotely() -> bool:
        values = metrics(CACHESERVER_METRICS)
        name = "kvmesh_cacheserver_requests_total"
        return metric(values, name, op="put") + metric(values, name, op="mput") > 0

    try:
        wait_for(stored_remotely, 60)
    except AssertionError:
        worker = metrics(WORKER_METRICS)
        puts = {k: v for k, v in worker.items() if k.startswith("kvmesh_remote_puts_total")}
        raise AssertionError(f"no put reached the restarted cache-server; worker: {puts}") from None
    complete(prompt)
    assert hit_tokens() - before >= 4 * 256


def test_pd_profile_pushes_the_prompt_kv_from_the_prefiller(mesh: dict[str, str]) -> None:
    _run([*COMPOSE, "--profile", "pd", "up", "--wait", "--wait-timeout", "600", "prefiller"],
         mesh, 700)  # fmt: skip

    def prefiller_up() -> bool:
        health = _http("GET", BRIDGE + "/health")
        return all(p["state"] == "up" for p in health["prefillers"])

    wait_for(prefiller_up, 60)
    bridge = "http://127.0.0.1:7631/metrics"
    fallbacks = metric(metrics(bridge), "kvmesh_bridge_fallbacks_total")
    received = metric(metrics(WORKER_METRICS), "kvmesh_pd_received_chunks_total")
    before = hit_tokens()
    prompt = prompt_tokens(1500, seed=13)
    answer = complete(prompt)
    assert answer["choices"][0]["text"]
    assert metric(metrics(bridge), "kvmesh_bridge_fallbacks_total") == fallbacks
    # 1500 tokens: 5 full chunks and the last partial one, pushed by the prefiller and
    # loaded by the worker (the decoder) instead of computed.
    assert metric(metrics(WORKER_METRICS), "kvmesh_pd_received_chunks_total") - received >= 5
    assert hit_tokens() - before >= 5 * 256


# -- CURVE (docker/compose/curve.yaml) --------------------------------------------------
# Last in the module: it takes the mesh down and brings the keyed services up in its
# place (same host ports). Only the controller, the lookup-server and the cache-server:
# they hold every kvmesh socket an outside client talks to, and start in seconds where
# a vLLM worker takes minutes.
CURVE_SERVICES = ["controller", "lookup", "cacheserver"]
NS = "00112233445566ff"


def _kvmesh(args: list[str], keys: Path | None) -> subprocess.CompletedProcess[str]:
    """The host venv's `kvmesh ARGS`, keyed as an admin's client (keys/admin.*) or not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "DOCKER_"))}
    env["KVMESH_CONFIG"] = ""
    if keys is not None:
        env["KVMESH_SECURITY__SERVER_KEY"] = str(keys / "server.key")
        env["KVMESH_SECURITY__CLIENT_KEY"] = str(keys / "admin.key_secret")
    exe = str(Path(sys.executable).with_name("kvmesh"))
    return subprocess.run(
        [exe, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def curve_mesh(
    docker_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[str], Path]]:
    keys = tmp_path_factory.mktemp("compose-curve") / "keys"
    # The steps of curve.yaml's comment, plus an outside client's pair (admin) in allowed/.
    for name in ("server", "client", "admin"):
        res = _kvmesh(["keys", "generate", str(keys), "--name", name], None)
        assert res.returncode == 0, res.stderr
    (keys / "allowed").mkdir()
    for name in ("client", "admin"):
        shutil.copy(keys / f"{name}.key", keys / "allowed")
    (keys / "http-token").write_text("compose-test-token\n")
    # curve.yaml's step for the containers' user: the secret files are 0600, the
    # containers run as uid 10001 (they read nothing they do not own).
    for path in [keys, *keys.rglob("*")]:
        os.chown(path, KVMESH_UID, KVMESH_UID)
    env = {**docker_env, "KVMESH_KEYS_DIR": str(keys)}
    compose = [*COMPOSE, "-f", str(ROOT / "docker/compose/curve.yaml")]
    _run([*compose, "--profile", "pd", "down", "-v", "--remove-orphans"], env, 180)
    try:
        _run([*compose, "up", "--wait", "--wait-timeout", "120", *CURVE_SERVICES], env, 180)
    except AssertionError:
        print(_run([*compose, "logs", "--tail", "60"], env, 60))
        raise
    yield compose, keys
    logs = subprocess.run(
        [*compose, "logs", "--tail", "40"], env=env, capture_output=True, text=True
    )
    print(logs.stdout[-20000:])
    _run([*compose, "--profile", "pd", "down", "-v", "--remove-orphans"], env, 180)


def test_curve_override_keeps_the_mesh_to_keyed_clients(
    curve_mesh: tuple[list[str], Path], docker_env: dict[str, str]
) -> None:
    compose, keys = curve_mesh
    env = {**docker_env, "KVMESH_KEYS_DIR": str(keys)}
    ps = _run([*compose, "ps", "--format", "json"], env, 60)
    rows = [json.loads(line) for line in ps.splitlines() if line.strip()]
    assert {r["Service"]: r["Health"] for r in rows} == dict.fromkeys(CURVE_SERVICES, "healthy")
    endpoints = [
        "--controller", "tcp://127.0.0.1:7600",
        "--lookup-url", "tcp://127.0.0.1:7610",
        "--cacheserver-url", "tcp://127.0.0.1:7620",
        "--timeout", "5",
    ]  # fmt: skip

    # The admin's key is in allowed/: every service answers it.
    keyed = _kvmesh(["status", "--json", *endpoints], keys)
    assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    services = json.loads(keyed.stdout)["services"]
    assert {name: s["up"] for name, s in services.items()} == dict.fromkeys(CURVE_SERVICES, True)

    # No key: each service is down, and status says CURVE refused it, not just "no answer".
    from kvmesh.common.transport.handshake_probe import NO_CLIENT_KEY

    unkeyed = _kvmesh(["status", "--json", *endpoints], None)
    assert unkeyed.returncode == 3, unkeyed.stdout + unkeyed.stderr
    services = json.loads(unkeyed.stdout)["services"]
    for name in CURVE_SERVICES:
        assert not services[name]["up"], name
        assert NO_CLIENT_KEY in services[name]["error"], services[name]

    asyncio.run(_feed_reaches_a_keyed_subscriber(keys))


async def _feed_reaches_a_keyed_subscriber(keys: Path) -> None:
    """A worker's stored chunks (sent as an engine sends them, keyed) reach a keyed
    subscriber on the published feed port, and the replay port answers it."""
    from kvmesh.common.config import load_config
    from kvmesh.common.protocol import controller as proto
    from kvmesh.common.protocol import kv_events as kv
    from kvmesh.common.transport.controller_client import ControllerConnection
    from kvmesh.common.transport.curve import load_curve
    from kvmesh.common.transport.kv_events_client import Delivery, KvEventsSubscriber

    security = {
        "KVMESH_SECURITY__SERVER_KEY": str(keys / "server.key"),
        "KVMESH_SECURITY__CLIENT_KEY": str(keys / "admin.key_secret"),
    }
    curve = load_curve(load_config(None, env=security).security, client=True)
    assert curve is not None
    sub = KvEventsSubscriber("tcp://127.0.0.1:7602", "tcp://127.0.0.1:7603", curve=curve)
    async with sub:
        # The controller publishes nothing until it has read a subscription.
        def subscribed() -> bool:
            return (
                _http("GET", "http://127.0.0.1:7601/health", timeout_s=5)["event_feed"]["topics"]
                >= 1
            )

        await asyncio.to_thread(wait_for, subscribed, 30)
        worker = ControllerConnection("tcp://127.0.0.1:7600", timeout_s=30, curve=curve)
        await worker.connect()
        try:
            reg = await worker.request(
                proto.Register(worker.next_rid(), "compose-test", 0, 1, [NS], "", 60.0),
                proto.RegisterReply,
            )
            stored = [f"{NS}-{i:032x}" for i in range(3)]
            worker.send(proto.KVEventBatch(0, reg.worker_id, 1, [(1, k, "l1") for k in stored]))
            got: list[tuple[str, str]] = []
            async with asyncio.timeout(30):
                async for item in sub:
                    if isinstance(item, Delivery) and isinstance(item.payload, kv.EventBatch):
                        got += [(e.op, e.key) for e in item.payload.events]
                    if len(got) >= len(stored):
                        break
            assert got == [("stored", k) for k in stored]
            entries, _epoch, last_seq = await sub.replay(0)
            assert entries and last_seq >= entries[-1][0]
        finally:
            await worker.close()
