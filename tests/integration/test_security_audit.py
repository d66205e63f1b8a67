"""Security audit findings, each checked against real processes or a real engine.

- Secret files (CURVE secret keys, the HTTP token) readable by every user are still
  accepted, but `kvmesh serve` says so on start, naming the key and the path, never
  the secret; files readable only by their owner (or group: Kubernetes' 0440) say
  nothing.
- The engine's default ipc lookup directory (/tmp/kvmesh-<uid>, or $KVMESH_IPC_DIR)
  has a predictable name: one another user created first is refused, since that user
  could swap the socket for theirs and receive the scheduler's lookups; one of ours
  that is open to others is closed to 0700 before the socket is bound.
- An engine `tenant_salt` holding a NUL is refused: engine salt "a" with request tenant
  "b" is salt "a\\0b" inside, so such an engine would share its chunks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from click.testing import CliRunner
from kvtest.p2p import engine_config, kv_cache
from kvtest.service_process import KvmeshService, free_port

from kvmesh.common.config.schema import P2PConfig
from kvmesh.common.protocol import lookup as lookup_proto
from kvmesh.services.cli.main import cli
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.lookup_server import LookupServerError, attach_lookup_server

TOKEN = "audit-token-value-1234"
WARNING = "secret file's mode lets every user of this host read it"


def _security(tmp: Path, mode: int) -> Path:
    """A keyed config whose server secret and token files have mode."""
    keys = tmp / "keys"
    for name in ("server", "client"):
        out = CliRunner().invoke(cli, ["keys", "generate", str(keys), "--name", name])
        assert out.exit_code == 0, out.output
    allowed = tmp / "allowed"
    allowed.mkdir()
    shutil.copy(keys / "client.key", allowed)
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    for secret in (keys / "server.key_secret", keys / "client.key_secret", token):
        secret.chmod(mode)
    config = tmp / "kvmesh.yaml"
    config.write_text(
        "security:\n"
        f"  server_key: {keys / 'server.key_secret'}\n"
        f"  client_key: {keys / 'client.key_secret'}\n"
        f"  allowed_clients: {allowed}\n"
        f"  http_token_file: {token}\n"
    )
    return config


def _controller_log(tmp: Path, config: Path) -> str:
    svc = KvmeshService("controller", tmp, free_port(), {"http-port": free_port()})
    svc.env["KVMESH_CONFIG"] = str(config)
    svc.start(60)
    svc.stop()
    return svc.log.read_text()


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o440])
def test_world_readable_secret_files_are_warned_about(tmp_path: Path, mode: int) -> None:
    log = _controller_log(tmp_path, _security(tmp_path, mode))
    warned = [line for line in log.splitlines() if WARNING in line]
    if mode & stat.S_IROTH:
        assert any("security.server_key" in line for line in warned), log
        assert any("security.http_token_file" in line for line in warned), log
        assert any(str(tmp_path / "token") in line for line in warned), log
    else:
        assert warned == [], log
    assert TOKEN not in log  # the warning names the file, never what it holds


def test_the_warning_keeps_out_of_a_clients_json_output(tmp_path: Path) -> None:
    """`kvmesh status --json` with a world-readable client key: the warning goes to
    stderr, stdout stays one JSON document."""
    config = _security(tmp_path, 0o644)
    cli_args = ["status", "--config", str(config), "--json", "--timeout", "0.3"]
    cli_args += ["--controller", f"tcp://127.0.0.1:{free_port()}"]
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli.main", *cli_args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert isinstance(json.loads(out.stdout), dict), out.stdout
    assert WARNING in out.stderr and "security.client_key" in out.stderr, out.stderr


@pytest.fixture
def ipc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The built-in default directory (/tmp/kvmesh-<uid>), moved under tmp_path."""
    path = tmp_path / "ipc"
    monkeypatch.delenv("KVMESH_IPC_DIR", raising=False)
    monkeypatch.setattr(lookup_proto, "builtin_ipc_dir", lambda: path)
    yield path


@contextlib.contextmanager
def _engine(name: str, salt: str = "") -> Iterator[KVEngine]:
    cfg = msgspec.structs.replace(
        engine_config("zmq"), p2p=P2PConfig(enabled=False), tenant_salt=salt
    )
    eng = KVEngine(name, 0, cfg, kv_cache(None))
    try:
        yield eng
    finally:
        eng.close()


def test_default_ipc_dir_open_to_others_is_made_private(ipc_dir: Path) -> None:
    ipc_dir.mkdir()
    ipc_dir.chmod(0o777)
    with _engine("ipc-open") as eng:
        server = attach_lookup_server(eng)
        assert server.endpoint.startswith(f"ipc://{ipc_dir}/")
        assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's directory")
def test_default_ipc_dir_of_another_user_is_refused(ipc_dir: Path) -> None:
    ipc_dir.mkdir()
    ipc_dir.chmod(0o777)
    os.chown(ipc_dir, 65534, 65534)  # nobody's, as if nobody had created it first
    with _engine("ipc-theirs") as eng:
        with pytest.raises(LookupServerError, match="not a directory owned by this user"):
            attach_lookup_server(eng)
        assert list(ipc_dir.iterdir()) == []  # no socket was bound there


def test_an_ipc_dir_the_operator_named_is_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$KVMESH_IPC_DIR is the operator's: a shared sticky 1777 directory (like
    /dev/shm, or a pod's emptyDir) keeps its mode and takes the socket."""
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("KVMESH_IPC_DIR", str(shared))
    with _engine("ipc-env") as eng:
        server = attach_lookup_server(eng)
        assert server.endpoint.startswith(f"ipc://{shared}/")
        assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_a_subdirectory_of_the_default_dir_is_checked_too(ipc_dir: Path) -> None:
    ipc_dir.mkdir()
    ipc_dir.chmod(0o777)
    with _engine("ipc-sub") as eng:
        attach_lookup_server(eng, f"ipc://{ipc_dir}/sub/lk.sock")
        assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700


def test_explicit_ipc_endpoint_is_left_as_configured(tmp_path: Path, ipc_dir: Path) -> None:
    """Only the default directory is checked: an endpoint the operator named is theirs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with _engine("ipc-explicit") as eng:
        server = attach_lookup_server(eng, f"ipc://{shared}/lk.sock")
        assert server.endpoint == f"ipc://{shared}/lk.sock"
        assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_an_engine_salt_with_a_nul_is_refused() -> None:
    """Engine salt "a" with request tenant "b" keys its chunks as salt "a\\0b" would:
    such an engine salt (YAML "a\\0b" loads as it is) must not start, or its chunks
    in every tier would be another deployment's tenant "b"'s."""
    prompt = torch.arange(64)
    with _engine("salt-a", salt="a") as salted:
        theirs = [k for _, _, k in salted.chunks(prompt, tenant="b")]
        try:
            with _engine("salt-nul", salt="a\x00b") as nul:
                assert [k for _, _, k in nul.chunks(prompt)] != theirs
        except ValueError as exc:
            assert "tenant_salt" in str(exc)
