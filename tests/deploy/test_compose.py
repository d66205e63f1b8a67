"""compose.yaml for real: a private Docker daemon, the images built from this tree
without a registry (docker/build.sh), `docker compose up --wait`, completions through
the bridge, a repeat served from kvmesh, and a cache-server restart under load.

Slow the first time (debootstrap, wheels, two images: ~10 min on 2 cores); the build
reuses what it made before when nothing changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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
    prompt = prompt_tokens(1200, seed=12)
    before = hit_tokens()
    complete(prompt)

    def stored_remotely() -> bool:
        values = metrics(CACHESERVER_METRICS)
        name = "kvmesh_cacheserver_requests_total"
        return metric(values, name, op="put") + metric(values, name, op="mput") > 0

    wait_for(stored_remotely, 60)
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
