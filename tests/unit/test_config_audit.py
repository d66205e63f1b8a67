"""Audit of config loading: host:port values the clients could never dial, YAML that
crashed the loader or read as another number, endless timeouts, two listeners on one
port, and passwords quoted in error messages. Each case fails when the config loads,
naming the key and the layer (file line, variable, override) it came from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from kvmesh.common.config import ConfigError, KvmeshConfig, load_config
from kvmesh.common.transport.tcp_address import host_ports

KVMESH = Path(sys.executable).parent / "kvmesh"
SECRET = "hunter2pw"


def load_error(*args: object, **kwargs: object) -> ConfigError:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)  # type: ignore[arg-type]
    return info.value


def remote(url: str) -> dict[str, object]:
    return {"engine.remote.enabled": True, "engine.remote.url": url}


def dialled(url: str) -> list[tuple[str, int]]:
    """The (host, port)s the worker's connector for url connects to (ValueError: none)."""
    scheme, _, rest = url.partition("://")
    if scheme in ("kvmesh", "redis-cluster"):
        return host_ports(rest.split("/", 1)[0].rpartition("@")[2], 7620)
    kw = Redis.from_url(url).connection_pool.connection_kwargs
    return [(kw["host"], kw.get("port", 6379))]


# --- remote.url: every host:port the connector will dial ------------------------------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis://host:abc", "port 'abc' is not a number"),
        (f"redis://user:{SECRET}@h:abc/0", "port 'abc' is not a number"),
        ("rediss://h:6379x", "port '6379x' is not a number"),
        ("redis://h:-1", "port '-1' is not a number"),
        ("redis://h:99999", "not in 1-65535"),
        ("redis://::1:6379", "IPv6 address in brackets"),  # redis-py cannot read it
        ("redis://h:6379/abc", "database number"),  # redis-py would use db 0
        (f"redis://user:{SECRET}@", "no host"),
        ("kvmesh://h:99999", "not in 1-65535"),
        ("kvmesh://h:0", "not in 1-65535"),
        ("kvmesh://h:\u00b2", "not a number"),
        ("kvmesh://[::1:7620", "IPv6 address] in the brackets"),
        ("kvmesh://::1", "IPv6 address in brackets"),
        ("kvmesh://bad host:7620", "holds a space"),
        ("kvmesh://a:1,b:2", "takes one host:port"),
        ("redis-cluster://a:7000,b:x", "port 'x' is not a number"),
        ("redis-cluster://a:7000,b:70000", "not in 1-65535"),
    ],
)
def test_a_remote_url_no_client_can_dial_is_refused(url: str, words: str) -> None:
    err = load_error(overrides=remote(url))
    assert err.key == "engine.remote.url"
    assert str(err.source) == "override engine.remote.url"
    assert words in str(err)
    assert SECRET not in str(err)


def test_a_bad_remote_port_names_the_file_line(tmp_path: Path) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_text(
        f"engine:\n  remote:\n    enabled: true\n    url: redis://u:{SECRET}@cache:637900\n"
    )
    err = load_error(path)
    assert err.key == "engine.remote.url" and f"{path}, line 4" in str(err)
    assert "port 637900 is not in 1-65535" in str(err) and SECRET not in str(err)


def test_a_password_cut_by_a_slash_is_not_quoted_in_the_problem() -> None:
    # The authority ends at the '/', so the "port" read is a piece of the password.
    err = load_error(overrides=remote("redis://u:abc/defghij@cache:6379/0"))
    assert "defghij" not in str(err) and "abc" not in str(err)


@pytest.mark.parametrize(
    "url",
    [
        "kvmesh://cache:7620",
        "kvmesh://cache",  # the cache-server's default port
        "kvmesh://[::1]:7620",
        "kvmesh://::1:7620",  # host_ports cuts the port at the last ':'
        "kvmesh://[fe80::1%eth0]:7620",
        "redis://[::1]:6379/0",
        "redis://redis-master.redis.svc/0",
        "redis://h:",
        f"redis://:{SECRET}@redis-master:6379/2",
        "redis://u:p@ss@host:6379/1",
        "redis://h:6379/0?password=x",
        "rediss://cache:6380/0?ssl_ca_certs=/etc/ca.pem",
        "redis-cluster://[::1]:7000,[fd00::2]:7001,10.0.0.3:7002,redis-3",
        "redis-cluster://fd00::2:7000,h:7001",
        f"redis-cluster://u:{SECRET}@a:7000,b:7001",
    ],
)
def test_remote_urls_the_clients_read_still_load(url: str) -> None:
    assert load_config(env={}, overrides=remote(url)).engine.remote.url == url
    assert all(0 < port <= 65535 for _, port in dialled(url))


def test_the_refused_urls_are_ones_the_clients_fail_on() -> None:
    """Not stricter than the clients where they would have worked: each of these
    fails only later, when the worker's connector first dials."""
    for url in ("redis://host:abc", "redis://h:99999", "redis://::1:6379", "rediss://h:1x"):
        with pytest.raises(ValueError):
            dialled(url)
    for url in ("kvmesh://h:abc", "redis-cluster://a:1,b:x"):
        with pytest.raises(ValueError):
            dialled(url)


# --- other host:port keys ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("bridge.decoders", [{"url": "http://d1:abc"}]),
        ("bridge.decoders", [{"url": "http://d1:99999"}]),
        ("bridge.prefillers", [{"url": f"http://admin:{SECRET}@p1:80x"}]),
        ("bridge.decoders", [{"url": "http://d1:8200", "kv_endpoints": ["tcp://d1:abc"]}]),
        ("bridge.decoders", [{"url": "http://d1:8200", "kv_endpoints": ["tcp://d1:76500"]}]),
        ("lookup.controller_url", "tcp://[::1:7600"),
        ("lookup.controller_url", "ipc://   "),
    ],
)
def test_other_host_port_keys_are_checked(key: str, value: object) -> None:
    err = load_error(overrides={key: value})
    assert err.key.startswith(key)
    assert SECRET not in str(err)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("bridge.decoders", [{"url": "http://[::1]:8200", "kv_endpoints": ["tcp://[::1]:7650"]}]),
        ("bridge.decoders", [{"url": "https://d1/", "kv_endpoints": ["tcp://fd00::5:7650"]}]),
        ("lookup.controller_url", "tcp://[::1]:7600"),
        ("lookup.controller_url", "tcp://::1:7600"),
        ("bridge.lookup_url", "tcp://[fd00::1]:7610"),
    ],
)
def test_ipv6_endpoints_with_and_without_brackets_load(key: str, value: object) -> None:
    assert load_config(env={}, overrides={key: value})


# --- secrets in messages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"env": {"KVMESH_ENGINE__REMOTE": f"redis://u:{SECRET}@h:6379"}}, "engine.remote"),
        ({"overrides": {"engine.remote.url": [f"redis://u:{SECRET}@h:6379"]}}, "engine.remote.url"),
        (
            {"overrides": {"bridge.prefillers": [{"url": f"http://a:{SECRET}@p:8000"}] * 2}},
            "bridge.prefillers",
        ),
        (
            {
                "overrides": {
                    "bridge.lookup_url": "tcp://l:7610",
                    "bridge.decoders": [{"url": f"http://a:{SECRET}@d:8000"}],
                }
            },
            "bridge.decoders",
        ),
        (
            {"overrides": {"bridge.prefillers": [{"url": f"htp://a:{SECRET}@p"}]}},
            "bridge.prefillers",
        ),
        ({"overrides": {"lookup.controller_url": f"tcp://u:{SECRET}@h"}}, "lookup.controller_url"),
    ],
)
def test_errors_never_quote_a_password(kwargs: dict, key: str) -> None:
    err = load_error(**kwargs)
    assert err.key.startswith(key)
    assert SECRET not in str(err) and "***" in str(err)


# --- YAML files ------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"\x00\x01engine:\n", b"engine:\n  model_name: a\x1b[0m\n"])
def test_a_file_with_control_characters_is_a_config_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_bytes(data)
    err = load_error(path)
    assert str(path) in str(err) and "not allowed in YAML" in str(err)
    assert "line " in str(err)


def test_config_check_on_a_binary_file_exits_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVMESH_")}
    proc = subprocess.run(
        [str(KVMESH), "config", "check", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_a_duplicate_key_inside_a_list_item_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_text("engine:\n  tiers:\n    - plugin: a.b:one\n      plugin: a.b:two\n")
    err = load_error(path)
    assert err.key == "engine.tiers[0].plugin"
    assert "duplicate key (first written on line 3)" in str(err) and "line 4" in str(err)


@pytest.mark.parametrize(
    ("text", "key", "read_as"),
    [
        ("controller:\n  port: 07600\n", "controller.port", "3968"),
        ("engine:\n  chunk_size: 0256\n", "engine.chunk_size", "174"),
        ("engine:\n  l1:\n    max_size: 0100\n", "engine.l1.max_size", "64"),
        ("engine:\n  chunk_size: 1:00\n", "engine.chunk_size", "60"),
    ],
)
def test_a_leading_zero_int_in_a_file_is_not_silently_octal(
    tmp_path: Path, text: str, key: str, read_as: str
) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_text(text)
    err = load_error(path)
    assert err.key == key and f"reads as {read_as}" in str(err)
    assert f"{path}, line {text.count(chr(10))}" in str(err)


def test_a_leading_zero_int_in_the_environment_is_not_silently_octal() -> None:
    err = load_error(env={"KVMESH_CONTROLLER__PORT": "07600"})
    assert err.key == "controller.port" and "reads as 3968" in str(err)
    assert "env KVMESH_CONTROLLER__PORT" in str(err)


def test_ints_that_read_the_same_either_way_still_load(tmp_path: Path) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_text("controller:\n  port: 0\n  metrics_port: 00\nengine:\n  chunk_size: 1_024\n")
    cfg = load_config(path, env={"KVMESH_ENGINE__MODEL_NAME": "0123"})
    assert (cfg.controller.port, cfg.engine.chunk_size) == (0, 1024)
    assert cfg.engine.model_name == "0123"  # a string key takes the text as written


# --- floats ----------------------------------------------------------------------------------


ENDLESS = [
    ({"overrides": {"engine.pin_timeout_s": float("inf")}}, "engine.pin_timeout_s", "override"),
    ({"env": {"KVMESH_CACHESERVER__STALL_TIMEOUT_S": ".inf"}}, "cacheserver.stall_timeout_s",
     "env"),
    ({"env": {"KVMESH_ENGINE__CLOSE_FLUSH_S": ".inf"}}, "engine.close_flush_s", "env"),
    ({"overrides": {"engine.remote.presence_ttl_s": float("nan")}}, "engine.remote.presence_ttl_s",
     "override"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "key", "source"), ENDLESS)
def test_an_endless_duration_is_refused(kwargs: dict, key: str, source: str) -> None:
    err = load_error(**kwargs)
    assert err.key == key and err.source.kind == source
    assert "must be a finite number" in str(err)


def test_an_endless_duration_in_a_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "kvmesh.yaml"
    path.write_text("lookup:\n  worker_timeout_s: .inf\n")
    err = load_error(path)
    assert err.key == "lookup.worker_timeout_s" and f"{path}, line 2" in str(err)


# --- listeners of one service ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "other"),
    [
        ({"controller.http_port": 7600}, "controller.http_port", "port"),
        ({"controller.metrics_port": 7600}, "controller.metrics_port", "port"),
        (
            {"controller.events_port": 9000, "controller.events_replay_port": 9000},
            "controller.events_replay_port",
            "events_port",
        ),
        ({"lookup.metrics_port": 7610}, "lookup.metrics_port", "port"),
        ({"bridge.metrics_port": 7630}, "bridge.metrics_port", "port"),
        ({"cacheserver.data_port": 7620}, "cacheserver.data_port", "port"),
        ({"cacheserver.lm_enabled": True, "cacheserver.port": 7621}, "cacheserver.lm_port", "port"),
    ],
)
def test_two_listeners_of_one_service_on_one_port_are_refused(
    overrides: dict, key: str, other: str
) -> None:
    err = load_error(overrides=overrides)
    assert err.key == key and f"must differ from {other}" in str(err)


def test_listeners_that_are_off_or_unused_may_share_a_port() -> None:
    cfg = load_config(
        env={},
        overrides={
            # metrics_port is not used while http_port is set (one HTTP server).
            "controller.http_port": 8000,
            "controller.metrics_port": 8000,
            "cacheserver.port": 7621,  # lm_port's default, while lm is off
            "cacheserver.data_enabled": False,
            "cacheserver.data_port": 7621,
        },
    )
    assert cfg.cacheserver.port == 7621
    assert KvmeshConfig() == load_config(env={})


@pytest.mark.parametrize(
    "overrides",
    [
        {"cacheserver.max_value_size": 0},
        {"cacheserver.max_value_size": "0B", "cacheserver.max_memory": 0},
    ],
)
def test_a_cache_server_that_refuses_every_value_is_refused(overrides: dict) -> None:
    """MemoryStore.put refuses every value over max_value_size: with 0, every put."""
    err = load_error(overrides=overrides)
    assert err.key == "cacheserver.max_value_size" and "must be > 0" in str(err)


def test_a_stall_timeout_past_what_zmq_takes_is_refused() -> None:
    """`kvmesh serve cacheserver` with stall_timeout_s 3000000 died at start with
    OverflowError: its milliseconds go into a zmq option, a C int."""
    err = load_error(env={"KVMESH_CACHESERVER__STALL_TIMEOUT_S": "3000000"})
    assert err.key == "cacheserver.stall_timeout_s" and "must be at most 2147483" in str(err)
    assert "env KVMESH_CACHESERVER__STALL_TIMEOUT_S" in str(err)
    cfg = load_config(env={"KVMESH_CACHESERVER__STALL_TIMEOUT_S": "2147483"})
    assert cfg.cacheserver.stall_timeout_s == 2147483


# --- found by review --------------------------------------------------------------------


def test_a_merge_key_in_a_list_item_is_no_duplicate(tmp_path: Path) -> None:
    # PyYAML rewrites `<<: *p` in place into the keys it brings; read after that, the
    # item's own url and instance_id looked written twice.
    path = tmp_path / "merge.yaml"
    path.write_text(
        "bridge:\n  prefillers:\n"
        "    - &p {url: 'http://p1:8100', instance_id: p1}\n"
        "    - <<: *p\n      url: 'http://p2:8100'\n      instance_id: p2\n"
    )
    cfg = load_config(path, env={})
    assert [(b.url, b.instance_id) for b in cfg.bridge.prefillers] == [
        ("http://p1:8100", "p1"),
        ("http://p2:8100", "p2"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "engine:\n  tiers: &t [*t]\n",
        "bridge:\n  prefillers: [&p {url: 'http://p:1', x: *p}]\n",
        "engine: &e\n  l1: *e\n",
        "&top {engine: *top}\n",
    ],
)
def test_an_anchor_holding_itself_is_a_config_error_not_a_recursion(tmp_path, text) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text(text)
    err = load_error(path)
    assert str(path) in str(err)
    assert "expected" in str(err) or "alias inside its own anchor" in str(err)


def test_a_finite_stall_timeout_too_large_for_milliseconds_is_refused() -> None:
    err = load_error(overrides={"cacheserver.stall_timeout_s": 1.0e308})
    assert err.key == "cacheserver.stall_timeout_s" and "at most" in str(err)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("bridge.prefillers", [{"url": f"http://admin:{SECRET[:4]}/{SECRET[4:]}@p1:8100"}]),
        ("bridge.prefillers", [{"url": f"http://admin:{SECRET[:4]}#{SECRET[4:]}@p1:8100"}]),
        (
            "bridge.decoders",
            [{"url": "http://d:8200", "kv_endpoints": [f"tcp://u:{SECRET[:4]}/x@d1:7650"]}],
        ),
    ],
)
def test_a_password_holding_a_slash_or_hash_is_not_quoted(key: str, value: object) -> None:
    err = load_error(overrides={key: value})
    assert SECRET[:4] not in str(err) and SECRET[4:] not in str(err), str(err)


def test_a_cluster_list_ending_in_a_comma_loads_as_the_connector_reads_it() -> None:
    url = "redis-cluster://h1:7000,h2:7001,"
    assert load_config(env={}, overrides=remote(url)).engine.remote.url == url
    assert dialled(url) == [("h1", 7000), ("h2", 7001)]
