"""Endpoint keys are checked when the config loads (a typo would otherwise surface as a
zmq traceback or a hang later), and the CLI's own KVMESH_* variables are not taken for
mistyped config keys."""

from __future__ import annotations

import click
import pytest

from kvmesh.common.config import ConfigError, KvmeshConfig, load_config
from kvmesh.common.config.layers import ENV_RESERVED, is_config_var
from kvmesh.services.cli.main import cli


def _envvars(cmd: click.Command) -> set[str]:
    names = {
        v for p in cmd.params for v in ([p.envvar] if isinstance(p.envvar, str) else p.envvar or [])
    }
    for sub in getattr(cmd, "commands", {}).values():
        names |= _envvars(sub)
    return names


def test_every_cli_envvar_is_reserved() -> None:
    names = {n for n in _envvars(cli) if n.startswith("KVMESH_")}
    assert {"KVMESH_CONTROLLER_URL", "KVMESH_LOOKUP_URL", "KVMESH_BRIDGE_URL"} <= names
    for name in names:
        assert name in ENV_RESERVED and not is_config_var(name, KvmeshConfig)
        assert load_config(env={name: "tcp://127.0.0.1:7600"}) == KvmeshConfig()


def test_section_typos_are_still_reported() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(env={"KVMESH_CONTROLLER_PORT": "1"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("engine.controller.url", "ctl-host:7600"),
        ("engine.controller.url", "tcp://ctl-host"),
        ("engine.controller.url", "tcp://bad host:7600"),
        ("lookup.controller_url", "ctl-host:7600"),
        ("lookup.controller_url", "tcp://h:99999"),
        ("lookup.controller_url", "tcp://h:0"),  # nothing to connect to
        ("lookup.controller_url", "tcp://h:\u00b2"),  # a digit to isdigit(), not to int()
        ("lookup.controller_url", "http://h:7600"),
        ("engine.lookup_endpoint", "nope"),
        ("engine.lookup_endpoint", "ipc://"),
        ("bridge.lookup_url", "tcp://h"),
    ],
)
def test_bad_endpoints_name_the_key_and_the_forms(key: str, value: str) -> None:
    overrides = {key: value, "engine.controller.enabled": True}
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    err = info.value.issues[0]
    assert err.key == key
    assert "tcp://host:port or ipc://path" in str(err) and repr(value) in str(err)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("engine.controller.url", "tcp://ctl-host:7600"),
        ("engine.controller.url", "tcp://[::1]:7600"),
        ("engine.controller.url", "ipc:///run/kvmesh/ctl.sock"),
        ("lookup.controller_url", "tcp://10.0.0.5:7600"),
        ("engine.lookup_endpoint", "tcp://10.0.0.5:7660"),
        ("engine.lookup_endpoint", "ipc:///tmp/kvmesh/lk"),
        ("engine.lookup_endpoint", "tcp://h:{rank}"),
        ("engine.lookup_endpoint", "ipc:///tmp/lk-{rank}.sock"),
    ],
)
def test_good_endpoints_load(key: str, value: str) -> None:
    cfg = load_config(env={}, overrides={key: value, "engine.controller.enabled": True})
    assert cfg is not None


def test_a_disabled_controller_link_is_not_checked() -> None:
    assert load_config(env={}, overrides={"engine.controller.url": "unused"})
