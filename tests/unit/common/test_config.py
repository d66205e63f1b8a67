"""kvmesh.common.config: sizes, layering, and errors that name the key and its source."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.common.config import (
    ByteSize,
    CacheServerConfig,
    ConfigError,
    EngineConfig,
    KvmeshConfig,
    L1Config,
    RuleError,
    config_from_dict,
    config_to_dict,
    format_size,
    load_config,
    load_section,
    parse_size,
    section_from_dict,
)

GiB = 1024**3
MiB = 1024**2


def write(tmp_path: Path, text: str, name: str = "kvmesh.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(*args: object, **kwargs: object) -> ConfigError:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)  # type: ignore[arg-type]
    return info.value


# --- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 1000**3),
        ("512MiB", 512 * MiB),
        ("1.5 GiB", 3 * GiB // 2),
        ("64k", 64 * 1024),
        ("100", 100),
        ("100B", 100),
        ("1kB", 1000),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("2T", 2 * 1024**4),
        ("3Gi", 3 * GiB),
        ("1.1GB", 1_100_000_000),  # exact, not a float rounding of it
        ("0", 0),
        (" 7 mb ", 7_000_000),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size_valid(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["x", "5XB", "GB", "", "1.2.3", "-1", "-1GiB", "5 G B", -1, True])
def test_parse_size_invalid(bad: str | int) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (5 * GiB, "5GiB"),
        (5 * 1000**3, "5GB"),
        (1536 * 1024, "1.5MiB"),
        (1536, "1536B"),  # a tie in length goes to plain bytes
        (100, "100B"),
        (0, "0B"),
    ],
)
def test_format_size_picks_shortest_exact_spelling(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(min_value=0, max_value=2**70))
def test_format_then_parse_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["B", "kB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"]),
)
def test_unit_multiples_round_trip(count: int, unit: str) -> None:
    n = parse_size(f"{count}{unit}")
    assert parse_size(format_size(n)) == n


def test_bytesize_is_an_int() -> None:
    size = ByteSize("2GiB")
    assert isinstance(size, int)
    assert size == 2 * GiB
    assert size // 2 == GiB
    assert repr(size) == "ByteSize('2GiB')"
    with pytest.raises(ValueError):
        ByteSize(-5)


# --- defaults and structs --------------------------------------------------------------


def test_empty_and_comment_only_files_give_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == KvmeshConfig()
    assert load_config(write(tmp_path, "# nothing yet\n", "c.yaml"), env={}) == KvmeshConfig()


def test_section_with_everything_commented_out_is_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  # chunk_size: 512\nlogging:\n")
    assert load_config(path, env={}) == KvmeshConfig()


def test_defaults() -> None:
    cfg = KvmeshConfig()
    assert cfg.engine.chunk_size == 256
    assert cfg.engine.l1.max_size == 5 * GiB
    assert cfg.engine.l1.reserve == 2 * GiB
    assert cfg.cacheserver.max_value_size == 256 * MiB
    ports = {cfg.controller.port, cfg.lookup.port, cfg.cacheserver.port, cfg.bridge.port}
    assert len(ports) == 4
    assert cfg.controller.host == "127.0.0.1"


def test_config_is_frozen() -> None:
    cfg = KvmeshConfig()
    with pytest.raises(AttributeError):
        cfg.engine.chunk_size = 1  # type: ignore[misc]


def test_cross_field_rules_apply_to_direct_construction() -> None:
    with pytest.raises(RuleError):
        CacheServerConfig(max_memory=ByteSize("1GiB"), max_value_size=ByteSize("2GiB"))
    with pytest.raises(RuleError):
        L1Config(max_size=ByteSize(0))
    with pytest.raises(RuleError, match="L1 cannot be turned off"):
        L1Config(enabled=False, max_size=ByteSize(0))


# --- precedence ------------------------------------------------------------------------


def test_file_env_override_precedence(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "engine:\n  chunk_size: 100\n  model_name: from-file\n  l1:\n    max_size: 1GiB\n",
    )
    env = {"KVMESH_ENGINE__CHUNK_SIZE": "200", "KVMESH_ENGINE__L1__MAX_SIZE": "2GiB"}
    overrides = {"engine.chunk_size": 300}

    only_file = load_config(path, env={})
    assert (only_file.engine.chunk_size, only_file.engine.l1.max_size) == (100, GiB)

    with_env = load_config(path, env=env)
    assert (with_env.engine.chunk_size, with_env.engine.l1.max_size) == (200, 2 * GiB)

    everything = load_config(path, env=env, overrides=overrides)
    assert everything.engine.chunk_size == 300
    assert everything.engine.l1.max_size == 2 * GiB
    assert everything.engine.model_name == "from-file"
    assert everything.engine.l1.eviction_policy == "lru"  # untouched default


def test_env_defaults_to_os_environ_and_kvmesh_config_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "controller:\n  port: 9000\n")
    monkeypatch.setenv("KVMESH_CONFIG", str(path))
    monkeypatch.setenv("KVMESH_LOGGING__LEVEL", "debug")
    cfg = load_config()
    assert cfg.controller.port == 9000
    assert cfg.logging.level == "debug"


def test_env_values_are_yaml_scalars_except_for_string_fields() -> None:
    cfg = load_config(
        env={
            "KVMESH_ENGINE__LAYERWISE": "true",
            "KVMESH_ENGINE__PIN_TIMEOUT_S": "2.5",
            "KVMESH_ENGINE__MODEL_NAME": "1.0",
            "KVMESH_ENGINE__TENANT_SALT": "yes",
            "kvmesh_logging__json": "false",  # names are case-insensitive
        }
    )
    assert cfg.engine.layerwise is True
    assert cfg.engine.pin_timeout_s == 2.5
    assert cfg.engine.model_name == "1.0"
    assert cfg.engine.tenant_salt == "yes"
    assert cfg.logging.json is False


def test_non_config_kvmesh_vars_are_ignored() -> None:
    cfg = load_config(env={"KVMESH_HOME": "/x", "KVMESH_DEBUG_DUMP": "1", "PATH": "/bin"})
    assert cfg == KvmeshConfig()


def test_overrides_accept_nested_mappings() -> None:
    cfg = load_config(env={}, overrides={"engine": {"l1": {"max_size": "1GiB"}}, "bridge.port": 1})
    assert cfg.engine.l1.max_size == GiB
    assert cfg.bridge.port == 1


def test_load_section() -> None:
    engine = load_section(EngineConfig, env={}, overrides={"engine.chunk_size": 64})
    assert isinstance(engine, EngineConfig)
    assert engine.chunk_size == 64


# --- errors name the key and the source ----------------------------------------------


def test_misspelt_key_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  chunk_sise: 512\n")
    err = load_error(path)
    message = str(err)
    assert "engine.chunk_sise" in message
    assert str(path) in message
    assert "line 2" in message
    assert "did you mean engine.chunk_size" in message
    assert err.key == "engine.chunk_sise"
    assert err.source.kind == "file"


def test_misspelt_section_in_file(tmp_path: Path) -> None:
    err = load_error(write(tmp_path, "cacheservr:\n  port: 1\n"))
    assert "cacheservr" in str(err)
    assert "did you mean cacheserver" in str(err)


def test_every_unknown_key_and_a_bad_value_are_reported_together(tmp_path: Path) -> None:
    text = "engine:\n  chunk_sise: 1\n  l1:\n    max_sise: 1\nbridge:\n  port: -1\n"
    path = write(tmp_path, text)
    err = load_error(path)
    assert [issue.key for issue in err.issues] == [
        "engine.chunk_sise",
        "engine.l1.max_sise",
        "bridge.port",
    ]


def test_wrong_type_via_env_names_the_variable() -> None:
    err = load_error(env={"KVMESH_ENGINE__CHUNK_SIZE": "lots"})
    assert err.key == "engine.chunk_size"
    assert "env KVMESH_ENGINE__CHUNK_SIZE" in str(err)
    assert "expected int" in str(err)
    assert "'lots'" in str(err)


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("KVMESH_ENGINE__CHUNK_SISE", "KVMESH_ENGINE__CHUNK_SIZE"),
        ("KVMESH_ENGINE_CHUNK_SIZE", "KVMESH_ENGINE__CHUNK_SIZE"),  # one "_" too few
        ("KVMESH_ENGINE__L1_MAX_SIZE", "KVMESH_ENGINE__L1__MAX_SIZE"),
        ("KVMESH_ENGIN__CHUNK_SIZE", "KVMESH_ENGINE__CHUNK_SIZE"),
        ("KVMESH_LOGGING_LEVEL", "KVMESH_LOGGING__LEVEL"),
    ],
)
def test_misspelt_env_var_fails_with_suggestion(name: str, suggestion: str) -> None:
    err = load_error(env={name: "1"})
    assert f"env {name}" in str(err)
    assert f"did you mean {suggestion}?" in str(err)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("engine.chunk_size", 0, ">= 1"),
        ("engine.max_inflight_io", -3, ">= 1"),
        ("controller.port", 70000, "<= 65535"),
        ("engine.metrics_port", -1, ">= 0"),
        ("engine.pin_timeout_s", 0, "> 0"),
        ("engine.l1.max_size", "-1GiB", "negative"),
        ("engine.l1.reserve", "lots", "invalid size"),
        ("engine.l1.max_size", True, "boolean"),
        ("engine.hash_algorithm", "blake2", "did you mean 'blake3'"),
        ("logging.level", "verbose", "expected one of"),
        ("engine.layerwise", "sometimes", "expected bool"),
        ("engine.l1", 5, "expected object"),
    ],
)
def test_impossible_values_name_key_and_override(key: str, value: object, words: str) -> None:
    err = load_error(overrides={key: value})
    assert err.key == key
    assert str(err.source) == f"override {key}"
    assert words in str(err)


def test_impossible_value_in_file_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "lookup:\n  host: 0.0.0.0\n  port: 70000\n")
    err = load_error(path)
    assert err.key == "lookup.port"
    assert f"{path}, line 3" in str(err)


def test_cross_field_rule_names_both_sources(tmp_path: Path) -> None:
    path = write(tmp_path, "cacheserver:\n  max_memory: 100MiB\n")
    err = load_error(path)
    assert err.key == "cacheserver.max_value_size"
    assert err.source.kind == "default"
    assert "max_memory" in str(err)
    assert f"{path}, line 2" in str(err)


def test_l1_rule(tmp_path: Path) -> None:
    err = load_error(overrides={"engine.l1.max_size": 0})
    assert err.key == "engine.l1.max_size"
    # Off, the engine failed at start (a pool of 0 bytes) or kept using the pool.
    err = load_error(overrides={"engine.l1": {"enabled": False, "max_size": "1GiB"}})
    assert err.key == "engine.l1.enabled" and "cannot be turned off" in str(err)


def test_peer_idle_s_must_outlast_a_read(tmp_path: Path) -> None:
    """A peer's connection closed as idle in the middle of a read would fail it."""
    path = write(tmp_path, "engine:\n  p2p:\n    timeout_s: 5\n")
    err = load_error(path, overrides={"engine.p2p.peer_idle_s": 2})
    assert err.key == "engine.p2p.peer_idle_s"
    assert str(err.source) == "override engine.p2p.peer_idle_s"
    assert "timeout_s (5" in str(err) and f"{path}, line 3" in str(err)
    assert load_config(env={}, overrides={"engine.p2p.peer_idle_s": 6})


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  chunk_size: 1\n  l1: [1,\n")
    err = load_error(path)
    assert str(path) in str(err)
    assert "YAML syntax error" in str(err)
    assert "line " in str(err)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    err = load_error(path)
    assert str(path) in str(err)
    assert "top level must be a mapping" in str(err)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    err = load_error(path)
    assert str(path) in str(err)
    assert "not found" in str(err)


def test_duplicate_key_in_file(tmp_path: Path) -> None:
    err = load_error(write(tmp_path, "engine:\n  chunk_size: 1\n  chunk_size: 2\n"))
    assert err.key == "engine.chunk_size"
    assert "duplicate" in str(err)
    assert "line 3" in str(err)


# --- inline dicts and printing ------------------------------------------------------------


def test_config_from_dict() -> None:
    cfg = config_from_dict({"engine": {"chunk_size": 128, "l1": {"max_size": "1GiB"}}})
    assert cfg.engine.chunk_size == 128
    assert cfg.engine.l1.max_size == GiB


def test_section_from_dict_errors_name_section_and_source() -> None:
    engine = section_from_dict(EngineConfig, {"chunk_size": 64, "layerwise": True})
    assert (engine.chunk_size, engine.layerwise) == (64, True)
    with pytest.raises(ConfigError) as info:
        section_from_dict(EngineConfig, {"chunk_sise": 64}, source="kv_connector_extra_config")
    assert info.value.key == "engine.chunk_sise"
    assert "kv_connector_extra_config" in str(info.value)
    assert "did you mean engine.chunk_size" in str(info.value)


def test_config_to_dict_round_trips() -> None:
    cfg = load_config(env={}, overrides={"engine.l1.max_size": "1536MiB", "engine.chunk_size": 64})
    values = config_to_dict(cfg)
    assert values["engine"]["l1"]["max_size"] == "1.5GiB"
    assert values["engine"]["chunk_size"] == 64
    assert config_from_dict(values) == cfg
    raw = config_to_dict(cfg, human_sizes=False)
    assert raw["engine"]["l1"]["max_size"] == 1536 * MiB
    # Plain builtins: a JSON encoder needs no hooks.
    assert msgspec.json.decode(msgspec.json.encode(raw)) == raw


# --- engine.disk ---------------------------------------------------------------------------


def test_disk_defaults_off_with_no_path() -> None:
    disk = KvmeshConfig().engine.disk
    assert (disk.enabled, disk.path, disk.max_size) == (False, "", 50 * GiB)
    assert (disk.io_threads, disk.o_direct, disk.eviction_policy) == (4, True, "lru")
    assert (disk.retry_s, disk.max_pending_puts) == (30.0, 256)


def test_disk_from_env_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  disk:\n    enabled: true\n    max_size: 2GiB\n")
    env = {"KVMESH_ENGINE__DISK__PATH": "1.0", "KVMESH_ENGINE__DISK__IO_THREADS": "8"}
    disk = load_config(path, env=env).engine.disk
    assert disk.enabled and disk.max_size == 2 * GiB
    assert disk.path == "1.0"  # a string field takes the text as written
    assert disk.io_threads == 8


def test_disk_rules_name_the_key_to_change(tmp_path: Path) -> None:
    err = load_error(write(tmp_path, "engine:\n  disk:\n    enabled: true\n"))
    assert err.key == "engine.disk.path"
    assert "must be set while disk is enabled" in str(err)
    assert "line 3" in str(err)  # where enabled was set
    err = load_error(overrides={"engine.disk": {"enabled": True, "path": "/x", "max_size": "1KiB"}})
    assert err.key == "engine.disk.max_size" and "at least 1MiB" in str(err)
    # Off, nothing is required.
    assert load_config(env={}, overrides={"engine.disk.max_size": 0}).engine.disk.max_size == 0


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("engine.disk.io_threads", 0, ">= 1"),
        ("engine.disk.io_threads", 65, "<= 64"),
        ("engine.disk.retry_s", 0, "> 0"),
        ("engine.disk.max_pending_puts", 0, ">= 1"),
        ("engine.disk.eviction_policy", "lru2", "expected one of"),
        ("engine.disk.o_direct", "maybe", "expected bool"),
        ("engine.disk.max_size", "-5GiB", "negative"),
    ],
)
def test_disk_impossible_values(key: str, value: object, words: str) -> None:
    err = load_error(overrides={key: value})
    assert err.key == key and words in str(err)


def test_plugin_tiers_and_connectors_in_the_engine_config() -> None:
    cfg = config_from_dict(
        {
            "engine": {
                "tiers": [
                    {"plugin": "memdict", "options": {"max_chunks": 8}},
                    {"plugin": "pkg.mod:make_tier"},
                    {"plugin": "pkg.other:make_tier", "name": "fast"},
                ],
                "remote": {"enabled": True, "url": "s3c://bucket/x"},
            }
        }
    )
    assert [t.tier_name for t in cfg.engine.tiers] == ["memdict", "make_tier", "fast"]
    assert cfg.engine.tiers[0].options == {"max_chunks": 8}
    assert cfg.engine.remote.url == "s3c://bucket/x" and cfg.engine.remote.connector == ""


@pytest.mark.parametrize(
    "engine,message",
    [
        ({"tiers": [{"plugin": "x:disk"}]}, "engine.tiers: tier name 'disk' is taken"),
        ({"tiers": [{"plugin": "a:t"}, {"plugin": "b:t"}]}, "tier name 't' is taken"),
        ({"tiers": [{"plugin": " "}]}, "engine.tiers[0].plugin: must name an entry point"),
        ({"tiers": [{"name": "x"}]}, "plugin"),
        ({"tiers": [{"plugin": "m", "optons": {}}]}, "engine.tiers[0].optons: unknown key"),
        ({"remote": {"enabled": True, "url": "no-scheme"}}, "engine.remote.url: must be a URL"),
    ],
)
def test_plugin_config_errors_name_the_key(engine: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"engine": engine})
    assert message in str(err.value)


def test_a_heartbeat_period_over_a_day_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"engine\.controller\.heartbeat_s"):
        config_from_dict({"engine": {"controller": {"heartbeat_s": 86401}}})
    assert config_from_dict({"engine": {"controller": {"heartbeat_s": 86400}}})
