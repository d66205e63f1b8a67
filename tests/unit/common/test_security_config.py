"""The `security` section: its rule, key and token files read at start-up, the bearer
token check, and `kvmesh keys generate`. No sockets (tests/integration/
test_curve_security.py runs CURVE between real processes)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmesh.common.config import ConfigError, config_from_dict
from kvmesh.common.config.schema import SecurityConfig
from kvmesh.common.observability.http_auth import authorized, needs_token, read_http_token
from kvmesh.common.transport.curve import load_curve
from kvmesh.services.cli.main import cli


def _generate(where: Path, *names: str) -> None:
    for name in names:
        out = CliRunner().invoke(cli, ["keys", "generate", str(where), "--name", name])
        assert out.exit_code == 0, out.output


def test_half_configured_curve_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"security\.server_key: must be set"):
        config_from_dict({"security": {"client_key": "/k/c.key_secret"}})
    assert not config_from_dict({}).security.curve


def test_keys_generate_modes_and_no_overwrite(tmp_path: Path) -> None:
    _generate(tmp_path / "k", "a")
    assert stat.S_IMODE((tmp_path / "k" / "a.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k" / "a.key").stat().st_mode) == 0o644
    before = (tmp_path / "k" / "a.key_secret").read_bytes()
    again = CliRunner().invoke(cli, ["keys", "generate", str(tmp_path / "k"), "--name", "a"])
    assert again.exit_code == 1 and "--force" in again.output
    assert (tmp_path / "k" / "a.key_secret").read_bytes() == before
    forced = CliRunner().invoke(
        cli, ["keys", "generate", str(tmp_path / "k"), "--name", "a", "--force"]
    )
    assert forced.exit_code == 0
    assert (tmp_path / "k" / "a.key_secret").read_bytes() != before


def test_load_curve_roles(tmp_path: Path) -> None:
    _generate(tmp_path, "server", "client")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes((tmp_path / "client.key").read_bytes())
    # A client-only host needs just the server's public key.
    client_only = SecurityConfig(
        server_key=str(tmp_path / "server.key"), client_key=str(tmp_path / "client.key_secret")
    )
    keys = load_curve(client_only, client=True)
    assert keys is not None and keys.server_secret is None and keys.client_secret
    with pytest.raises(ConfigError, match=r"security\.server_key: .*server\.key: holds no secret"):
        load_curve(client_only, server=True)
    serving = SecurityConfig(
        server_key=str(tmp_path / "server.key_secret"), allowed_clients=str(allowed)
    )
    keys = load_curve(serving, server=True)
    assert keys is not None and keys.allowed == {keys_of(tmp_path / "client.key")}
    with pytest.raises(ConfigError, match=r"security\.client_key: \(unset\): required"):
        load_curve(serving, client=True)
    with pytest.raises(ConfigError, match=r"security\.allowed_clients: \(unset\)"):
        load_curve(SecurityConfig(server_key=serving.server_key), server=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    no_clients = SecurityConfig(server_key=serving.server_key, allowed_clients=str(empty))
    with pytest.raises(ConfigError, match=r"security\.allowed_clients: .*empty: holds no"):
        load_curve(no_clients, server=True)


def keys_of(path: Path) -> bytes:
    import zmq.auth

    return zmq.auth.load_certificate(str(path))[0]


def test_http_token(tmp_path: Path) -> None:
    assert read_http_token(SecurityConfig()) == ""
    with pytest.raises(ConfigError, match=r"security\.http_token_file: .*nope: no such"):
        read_http_token(SecurityConfig(http_token_file=str(tmp_path / "nope")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_http_token(SecurityConfig(http_token_file=str(tmp_path / "empty")))
    (tmp_path / "t").write_text("tok\n")
    token = read_http_token(SecurityConfig(http_token_file=str(tmp_path / "t")))
    assert token == "tok"
    assert authorized("Bearer tok", token) and authorized("bearer  tok", token)
    assert not authorized("Bearer nope", token) and not authorized(None, token)
    assert not authorized("Basic tok", token)
    assert authorized(None, "")  # no token configured: open
    assert not needs_token("GET", "/metrics") and not needs_token("GET", "/health")
    assert needs_token("POST", "/health") and needs_token("GET", "/workers")
