"""docker/compose/curve.yaml, rendered by `docker compose config` (no daemon, no
image): every container of compose.yaml, the pd profile's included, mounts the keys
directory read-only and points kvmesh.yaml's security: section at it; without the
override nothing is keyed. The keys made as the override's comment says load with
kvmesh's own loader, from the config and environment each container gets.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from deploy_helm import image_env, written_paths

from kvmesh.common.config import load_config
from kvmesh.common.protocol.lookup import engine_endpoint
from kvmesh.common.transport.curve import load_curve
from kvmesh.services.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_BIN = ROOT / ".tools/bin/docker-compose"
CURVE = ROOT / "docker/compose/curve.yaml"
KEYS = "/etc/kvmesh-keys"
SERVICES = {"controller", "lookup", "cacheserver", "worker", "prefiller", "bridge"}


def compose_config(*files: Path, keys_dir: Path | None = None) -> dict[str, Any]:
    assert COMPOSE_BIN.is_file(), "run scripts/install_deploy_tools.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "DOCKER_"))}
    if keys_dir is not None:
        env["KVMESH_KEYS_DIR"] = str(keys_dir)
    args = [str(COMPOSE_BIN), "--project-directory", str(ROOT), "-f", str(ROOT / "compose.yaml")]
    for f in files:
        args += ["-f", str(f)]
    proc = subprocess.run(
        [*args, "--profile", "pd", "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def make_keys(keys: Path) -> None:
    """The steps docker/compose/curve.yaml's comment gives."""
    for name in ("server", "client"):
        out = CliRunner().invoke(cli, ["keys", "generate", str(keys), "--name", name])
        assert out.exit_code == 0, out.output
    (keys / "allowed").mkdir()
    (keys / "allowed" / "client.key").write_bytes((keys / "client.key").read_bytes())
    (keys / "http-token").write_text("s3cret\n")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    keys = tmp_path_factory.mktemp("compose") / "keys"
    make_keys(keys)
    return keys, compose_config(CURVE, keys_dir=keys)


def test_every_container_mounts_the_keys_read_only(keyed) -> None:
    keys, services = keyed
    assert set(services) == SERVICES
    for name, svc in services.items():
        mounts = {v["target"]: v for v in svc["volumes"]}
        assert mounts[KEYS]["source"] == str(keys), name
        assert mounts[KEYS]["read_only"] is True, name
        # The override adds; the config file and data volumes stay.
        assert "/etc/kvmesh/kvmesh.yaml" in mounts, name
        env = svc["environment"]
        assert env["KVMESH_SECURITY__SERVER_KEY"] == f"{KEYS}/server.key_secret", name
        assert env["KVMESH_SECURITY__ALLOWED_CLIENTS"] == f"{KEYS}/allowed", name
    assert services["prefiller"]["environment"]["KVMESH_ENGINE__PD__ROLE"] == "sender"


def test_without_the_override_nothing_is_keyed() -> None:
    for name, svc in compose_config().items():
        assert not any(v["target"] == KEYS for v in svc.get("volumes", [])), name
        assert not any(k.startswith("KVMESH_SECURITY") for k in svc.get("environment") or {})
    cfg = load_config(ROOT / "docker/compose/kvmesh.yaml", env={})
    assert not cfg.security.curve and not cfg.security.http_token_file


def test_each_container_loads_its_keys(keyed) -> None:
    """kvmesh.yaml plus each container's environment, the mount's path mapped to the
    keys made here: CURVE on, every process able to serve and to connect."""
    keys, services = keyed
    for name, svc in services.items():
        env = {k: str(v).replace(KEYS, str(keys)) for k, v in svc["environment"].items()}
        cfg = load_config(ROOT / "docker/compose/kvmesh.yaml", env=env)
        assert cfg.security.curve, name
        curve = load_curve(cfg.security, server=True, client=True)
        assert curve is not None and len(curve.allowed) == 1, name
        assert curve.client_public in curve.allowed  # the containers accept each other
        assert Path(cfg.security.http_token_file).read_text().strip() == "s3cret"


def test_each_worker_announces_endpoints_other_containers_reach() -> None:
    """What a vLLM container's engine serves to other containers must be at its own
    service name, on a port no other container takes (docker/compose/ci.yaml puts them
    all on one host network):
    - its lookup endpoint, asked by the lookup-server in its own container: the
      default ipc:// socket would lie in the worker's own /tmp (every lookup of it
      would answer 0);
    - its P2P host, whose bound address the engine registers with the controller for
      its peers: 0.0.0.0 would send a peer in another container to itself."""
    services = compose_config()
    lookups, p2p_ports = {}, {}
    for name in ("worker", "prefiller"):
        env = {k: str(v) for k, v in (services[name].get("environment") or {}).items()}
        cfg = load_config(ROOT / "docker/compose/kvmesh.yaml", env=env)
        lookups[name] = engine_endpoint(cfg.engine.lookup_endpoint, name, 0)
        assert lookups[name].startswith(f"tcp://{name}:"), (name, lookups[name])
        assert cfg.engine.p2p.enabled and cfg.engine.p2p.host == name, name
        p2p_ports[name] = cfg.engine.p2p.port
        # The connector's instance id: what the lookup-server is asked about.
        transfer = next(a for a in services[name]["command"] if "kv_connector" in a)
        extra = json.loads(transfer.split("=", 1)[1])["kv_connector_extra_config"]
        assert extra["instance_id"] == name
    ports = [e.rsplit(":", 1)[1] for e in lookups.values()]
    assert len(set(ports)) == len(ports), lookups
    assert len(set(p2p_ports.values())) == len(p2p_ports), p2p_ports
    # The bridge pushes the prompt's KV to the worker's P2P port, by name.
    cfg = load_config(ROOT / "docker/compose/kvmesh.yaml", env={})
    assert cfg.bridge.decoders[0].kv_endpoints == [f"tcp://worker:{p2p_ports['worker']}"]


VLLM_SERVICES = {"worker", "prefiller"}


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def test_every_container_is_read_only_and_writes_only_its_mounts() -> None:
    """read_only on every service, the pd profile's included, and each directory its
    process writes (deploy_helm.written_paths: its kvmesh.yaml, the image's environment
    and its own) on one of its volumes or tmpfs mounts, the innermost of which is
    writable. tests/deploy/test_compose.py checks the same with the mesh running."""
    services = compose_config()
    assert set(services) == SERVICES
    for name, svc in services.items():
        assert svc.get("read_only") is True, name
        tmpfs = {t.split(":", 1)[0]: t for t in svc.get("tmpfs", [])}
        assert "/tmp" in tmpfs, name
        mounts = {v["target"]: bool(v.get("read_only")) for v in svc.get("volumes", [])}
        mounts.update(dict.fromkeys(tmpfs, False))
        vllm = name in VLLM_SERVICES
        env = {**image_env("worker" if vllm else "services"),
               **{k: str(v) for k, v in (svc.get("environment") or {}).items()}}  # fmt: skip
        cfg = load_config(ROOT / "docker/compose/kvmesh.yaml", env=env)
        component = svc["command"][1] if not vllm else name
        for path, why in written_paths(component, vllm, cfg, env).items():
            holding = [m for m in mounts if _under(path, m)]
            assert holding, f"{name}: {path} ({why}) is on the read-only root filesystem"
            assert not mounts[max(holding, key=len)], f"{name}: {path} ({why}) is read-only"
    # The vLLM containers' HOME: a tmpfs of the images' user (docker/Dockerfile).
    for name in VLLM_SERVICES:
        (home,) = [t for t in services[name]["tmpfs"] if t.startswith("/home/kvmesh:")]
        assert "uid=10001" in home and "gid=10001" in home, home
