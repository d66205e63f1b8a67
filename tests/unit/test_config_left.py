"""Config items left by the last audit: YAML alias expansion, the lookup-server's hashing
keys against the engine's, and the ports an engine's ranks listen on."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.common.config import (
    ConfigError,
    RuleError,
    Source,
    config_from_dict,
    config_to_dict,
    load_config,
)
from kvmesh.common.config.layers import MAX_ALIAS_VALUES
from kvmesh.services.worker.engine import KVEngine


def load_error(path: Path | None = None, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, env=kwargs.pop("env", {}), **kwargs)
    return info.value


def nested_aliases(levels: int, indent: str) -> str:
    """`a0` and `levels` anchors each holding the previous one twice: 2**levels leaves."""
    lines = ["a0: &a0 {x: 1, y: 2}"]
    lines += [f"a{i}: &a{i} {{x: *a{i - 1}, y: *a{i - 1}}}" for i in range(1, levels + 1)]
    return indent + f"\n{indent}".join(lines) + "\n"


def timed_load_error(path: Path) -> tuple[ConfigError, float]:
    t0 = time.perf_counter()
    err = load_error(path)
    return err, time.perf_counter() - t0


# -- 1. YAML aliases ---------------------------------------------------------------------


@pytest.mark.parametrize("levels", [10, 12])
def test_nested_aliases_under_an_unknown_key_are_read_once(tmp_path: Path, levels: int) -> None:
    # Below the expansion bound (2**12 leaves): the file is read, and its keys are
    # unknown ones. Each put walked every use of every alias again: 12 levels took 21 s.
    path = tmp_path / "aliases.yaml"
    path.write_text("engine:\n" + nested_aliases(levels, "  "))
    err, took = timed_load_error(path)
    assert took < 0.5, took
    assert [i.key for i in err.issues] == [f"engine.a{i}" for i in range(levels + 1)]
    assert all("unknown key" in i.problem for i in err.issues)


def test_shared_dicts_given_inline_are_read_once() -> None:
    # The same walk for a config given as a dict (kv_connector_extra_config): 40
    # levels of one dict shared twice is 2**40 paths, and 41 objects.
    node: dict[str, Any] = {"x": 1}
    for _ in range(40):
        node = {"x": node, "y": node}
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        config_from_dict({"engine": {"deep": node}})
    assert time.perf_counter() - t0 < 0.5
    assert info.value.key == "engine.deep" and "unknown key" in str(info.value)


@pytest.mark.parametrize(
    ("where", "levels", "key", "line"),
    [
        # An anchor section no key reads, then the bomb at a key that quotes its value
        # in the error (an int key given a mapping): the message alone was 125 MB.
        ("anchors:\n{aliases}engine:\n  chunk_size: *a{n}\n", 22, "anchors.a13.y", 15),
        # A plugin's options are one value, decoded and printed (`config check`) whole.
        (
            "engine:\n  tiers:\n  - plugin: p\n    options:\n{aliases}",
            40,
            "engine.tiers[0].options.a13.y",
            18,
        ),
    ],
)
def test_an_alias_bomb_is_refused_at_once_naming_its_line(
    tmp_path: Path, where: str, levels: int, key: str, line: int
) -> None:
    path = tmp_path / "bomb.yaml"
    indent = "      " if "options" in where else "  "
    text = where.format(aliases=nested_aliases(levels, indent), n=levels)
    path.write_text(text)
    err, took = timed_load_error(path)
    assert took < 0.5, took
    assert len(err.issues) == 1, err
    # 2**13 * 3 values past the first use of a13: the first alias past the bound.
    assert f"{path}, line {line}: {key}: YAML aliases" in str(err), err
    assert str(MAX_ALIAS_VALUES) in str(err)


def test_aliases_within_the_bound_load_as_written(tmp_path: Path) -> None:
    path = tmp_path / "options.yaml"
    path.write_text(
        "engine:\n  tiers:\n  - plugin: p\n    options:\n" + nested_aliases(10, "      ")
    )
    t0 = time.perf_counter()
    options = load_config(path, env={}).engine.tiers[0].options
    assert time.perf_counter() - t0 < 0.5
    node = options["a10"]
    for _ in range(10):
        assert node["x"] == node["y"]
        node = node["x"]
    assert node == {"x": 1, "y": 2}


def test_a_later_layer_writing_into_an_aliased_mapping_changes_only_its_key(
    tmp_path: Path,
) -> None:
    # A mapping kept whole (an unknown key's) is shared with the other uses of its
    # alias: an override into it must not show up under the other key.
    path = tmp_path / "shared.yaml"
    path.write_text("engine:\n  a: &m {x: 1}\n  b: *m\n")
    layers_err = load_error(path, overrides={"engine.a.y": 2})
    assert [i.key for i in layers_err.issues] == ["engine.a", "engine.b"]
    from kvmesh.common.config.layers import Layers, add_file, add_overrides
    from kvmesh.common.config.schema import KvmeshConfig

    layers = Layers(KvmeshConfig)
    add_file(layers, path)
    add_overrides(layers, {"engine.a.y": 2})
    assert layers.data["engine"]["a"] == {"x": 1, "y": 2}
    assert layers.data["engine"]["b"] == {"x": 1}


# -- 2. the lookup-server's hashing keys --------------------------------------------------


def test_the_lookup_hashing_keys_follow_the_engines_unless_set(tmp_path: Path) -> None:
    # One file for both services (compose, a ConfigMap), the lookup's keys left out:
    # the lookup-server hashed with 256 while the engines stored 512-token chunks.
    path = tmp_path / "both.yaml"
    path.write_text("engine:\n  chunk_size: 512\nlookup:\n  port: 7611\n")
    env = {"KVMESH_ENGINE__HASH_ALGORITHM": "blake3"}
    lookup = load_config(path, env=env).lookup
    assert (lookup.chunk_size, lookup.hash_algorithm) == (512, "blake3")
    # What config_to_dict writes (every key) reads back the same.
    cfg = load_config(env={}, overrides={"engine.chunk_size": 64})
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_a_lookup_chunk_size_other_than_the_engines_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("engine:\n  chunk_size: 512\nlookup:\n  chunk_size: 256\n")
    load_config(path, env={})  # an engine's host: the lookup section is not its own
    err = load_error(path, service="lookup")
    assert err.key == "lookup.chunk_size" and err.source.where == f"{path}, line 4"
    assert f"must equal engine.chunk_size (512, from file {path}, line 2), got 256" in str(err)


def test_a_lookup_hash_algorithm_other_than_the_engines_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("engine:\n  hash_algorithm: blake3\nlookup:\n  hash_algorithm: xxh3_128\n")
    err = load_error(path, service="lookup")
    assert err.key == "lookup.hash_algorithm", err
    assert err.source.where == f"{path}, line 4"
    assert "engine.hash_algorithm ('blake3'" in str(err) and "never store" in str(err)
    # Both refused at once, from any layer.
    env = {"KVMESH_LOOKUP__CHUNK_SIZE": "128", "KVMESH_ENGINE__CHUNK_SIZE": "64"}
    err = load_error(path, env=env, service="lookup")
    assert [i.key for i in err.issues] == ["lookup.chunk_size", "lookup.hash_algorithm"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine.chunk_size": 512},  # an engine's own config
        {"lookup.chunk_size": 512},  # a lookup-server's own config
        {"engine.chunk_size": 512, "lookup.port": 7611},  # the lookup's follows
        {"engine.chunk_size": 512, "lookup.chunk_size": 512, "lookup.port": 7611},
        {"engine.hash_algorithm": "blake3", "lookup.hash_algorithm": "blake3"},
    ],
)
def test_hashing_keys_that_agree_or_concern_one_service_load(overrides: dict[str, Any]) -> None:
    load_config(env={}, overrides=overrides, service="lookup")


# -- 3. the ports of an engine's ranks ----------------------------------------------------

P2P = {"engine.p2p.enabled": True, "engine.p2p.port": 7700}


def test_engine_listeners_on_one_port_are_refused_at_load() -> None:
    err = load_error(overrides={**P2P, "engine.metrics_port": 7700})
    assert err.key == "engine.metrics_port"
    assert "must differ from p2p.port (both are 7700)" in str(err)
    assert "engine.p2p.port was set by override engine.p2p.port" in str(err)
    err = load_error(
        overrides={"engine.metrics_port": 7710, "engine.lookup_endpoint": "tcp://h:7710"}
    )
    assert err.key == "engine.lookup_endpoint", err


def test_a_port_left_off_does_not_clash() -> None:
    # P2P disabled: its port is not listened on.
    load_config(env={}, overrides={"engine.p2p.port": 7700, "engine.metrics_port": 7700})


@pytest.mark.parametrize(
    ("overrides", "world_size", "key", "problem"),
    [
        (
            {**P2P, "engine.metrics_port": 7701},
            2,
            "p2p.port",
            "with 2 ranks, rank 1's p2p.port and rank 0's metrics_port are both 7701",
        ),
        (
            {**P2P, "engine.metrics_port": 7708, "engine.lookup_endpoint": "tcp://h:7704"},
            5,
            "p2p.port",
            "rank 4's p2p.port and rank 0's lookup_endpoint are both 7704",
        ),
        (
            {"engine.lookup_endpoint": "tcp://h:77{rank}0", "engine.metrics_port": 7720},
            3,
            "lookup_endpoint",
            "rank 2's lookup_endpoint and rank 0's metrics_port are both 7720",
        ),
        ({"engine.metrics_port": 65535}, 2, "metrics_port", "port 65536"),
    ],
)
def test_rank_ports_that_clash_are_refused(
    overrides: dict[str, Any], world_size: int, key: str, problem: str
) -> None:
    engine = load_config(env={}, overrides=overrides).engine  # rank 0 alone is fine
    with pytest.raises(RuleError) as info:
        engine.check_rank_ports(world_size)
    assert info.value.field == key and problem in str(info.value), info.value


@pytest.mark.parametrize("world_size", [1, 4, 8])
def test_rank_ports_kept_apart_pass(world_size: int) -> None:
    overrides = {**P2P, "engine.metrics_port": 7710, "engine.lookup_endpoint": "tcp://h:7720"}
    load_config(env={}, overrides=overrides).engine.check_rank_ports(world_size)


def test_an_engine_whose_ranks_ports_clash_is_refused_before_it_binds() -> None:
    # rank 1's P2P server would take 7701, rank 0's metrics port
    overrides = {**P2P, "engine.metrics_port": 7701}
    cfg = load_config(env={}, overrides=overrides).engine
    kv = torch.zeros(2, 2, 16, 2, 8)
    threads = set(threading.enumerate())
    with pytest.raises(ConfigError) as info:
        KVEngine("clash", 1, cfg, [kv], world_size=2)
    assert "engine.p2p.port" in str(info.value) and "7701" in str(info.value), info.value
    assert set(threading.enumerate()) <= threads  # refused before its loop or servers


def test_a_lookup_endpoint_with_the_rank_in_its_address_clashes_with_no_other_rank() -> None:
    cfg = load_config(env={}, overrides={"engine.lookup_endpoint": "tcp://10.0.0.{rank}:7720"})
    cfg.engine.check_rank_ports(4)  # each rank its own address, all on port 7720
    in_port = load_config(env={}, overrides={"engine.lookup_endpoint": "tcp://h:772{rank}"})
    assert [in_port.engine.rank_ports(r) for r in (0, 3)] == [
        {"lookup_endpoint": 7720},
        {"lookup_endpoint": 7723},
    ]


def test_ranks_on_other_hosts_are_not_checked_against_this_ones(monkeypatch) -> None:
    """Two 8-GPU hosts, 16 ranks, the chart's ports: each host's ranks use base + 0..7
    or base + 8..15, which never meet; 16 ranks on one host would (rank 10's p2p port
    is rank 0's lookup port)."""
    from kvmesh.services.worker import engine as engine_mod

    overrides = {
        **P2P,
        "engine.p2p.port": 7650,
        "engine.metrics_port": 7640,
        "engine.lookup_endpoint": "tcp://0.0.0.0:7660",
    }
    cfg = load_config(env={}, overrides=overrides).engine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # no GPU here: its count
    engine_mod._check_rank_ports(cfg, 10, 16, on_gpu=True)
    with pytest.raises(ConfigError, match="7660"):
        engine_mod._check_rank_ports(cfg, 10, 16, on_gpu=False)
    with pytest.raises(ConfigError, match="past 65535"):
        far = load_config(env={}, overrides={"engine.metrics_port": 65530}).engine
        engine_mod._check_rank_ports(far, 9, 16, on_gpu=True)


@pytest.mark.parametrize(
    ("p2p_host", "metrics_host", "clash"),
    [
        ("10.1.2.3", "127.0.0.1", False),  # two addresses: Linux binds both
        ("0.0.0.0", "127.0.0.1", True),  # the wildcard takes every address
        ("::", "10.1.2.3", True),
        ("pod-0.svc", "10.1.2.3", True),  # a name may be that address
        ("[::1]", "::1", True),
    ],
)
def test_one_port_on_two_addresses_is_no_clash(p2p_host: str, metrics_host: str, clash: bool):
    overrides = {**P2P, "engine.p2p.host": p2p_host, "engine.metrics_host": metrics_host}
    overrides["engine.metrics_port"] = 7700
    if clash:
        assert "must differ from" in str(load_error(overrides=overrides))
    else:
        load_config(env={}, overrides=overrides)


def test_an_alias_bomb_in_an_environment_variable_is_refused_naming_it() -> None:
    levels = ", ".join(f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, 60))
    bomb = f"[{{plugin: p.m:f, options: {{l0: &l0 [1, 2], {levels}}}}}]"
    started = time.monotonic()
    err = load_error(env={"KVMESH_ENGINE__TIERS": bomb})
    assert time.monotonic() - started < 1.0
    assert err.source == Source("env", "KVMESH_ENGINE__TIERS"), err
    assert "YAML aliases make the env more than" in str(err)
    # Aliases within the bound still load as written.
    ok = "[{plugin: p.m:f, options: {a: &a [1, 2], b: *a}}]"
    tiers = load_config(env={"KVMESH_ENGINE__TIERS": ok}).engine.tiers
    assert tiers[0].options == {"a": [1, 2], "b": [1, 2]}


def test_the_ranks_checked_are_those_on_the_engines_own_host(monkeypatch) -> None:
    """A {rank} in the lookup port breaks base + rank: rank 10 of tcp://h:70{rank} is
    7010, rank 10's P2P port too. Rank 10 on the second 8-GPU host must see it."""
    from kvmesh.services.worker import engine as engine_mod

    overrides = {
        "engine.p2p.enabled": True,
        "engine.p2p.port": 7000,
        "engine.metrics_port": 9000,
        "engine.lookup_endpoint": "tcp://127.0.0.1:70{rank}",
    }
    cfg = load_config(env={}, overrides=overrides).engine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    engine_mod._check_rank_ports(cfg, 3, 16, on_gpu=True)  # ranks 0..7: no clash
    with pytest.raises(ConfigError, match="7010"):
        engine_mod._check_rank_ports(cfg, 10, 16, on_gpu=True)
