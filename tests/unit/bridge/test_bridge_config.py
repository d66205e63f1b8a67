"""The bridge's section of the config: backends, deadlines, limits, and their rules."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvmesh.common.config import ConfigError, config_from_dict, config_to_dict
from kvmesh.services.cli.bridge_cmd import bridge


def bridge_cfg(**section: object):
    return config_from_dict({"bridge": section}, source="test.yaml").bridge


def test_defaults() -> None:
    cfg = bridge_cfg()
    assert cfg.port == 7630 and cfg.prefillers == [] and cfg.decoders == []
    assert cfg.prefill_timeout_s == 30.0 and cfg.decode_timeout_s == 60.0
    assert cfg.max_body_bytes == 1 << 20 and cfg.health_interval_s > 0


def test_backends_decode_and_round_trip() -> None:
    cfg = bridge_cfg(
        prefillers=[{"url": "http://p1:8100"}, {"url": "https://p2:8100"}],
        decoders=[{"url": "http://d1:8200", "kv_endpoints": ["tcp://10.0.0.5:7650"]}],
        max_body_bytes="4MiB",
    )
    assert [p.url for p in cfg.prefillers] == ["http://p1:8100", "https://p2:8100"]
    assert cfg.decoders[0].kv_endpoints == ["tcp://10.0.0.5:7650"]
    assert cfg.max_body_bytes == 4 << 20
    again = config_from_dict({"bridge": config_to_dict(cfg)})
    assert again.bridge == cfg


D0 = "bridge.decoders[0]"
HTTP_D = {"url": "http://d"}


@pytest.mark.parametrize(
    ("section", "key", "words"),
    [
        ({"decoders": [{"url": "d1:8200"}]}, "bridge.decoders[0].url", "http://"),
        ({"prefillers": [{"url": "ftp://p"}]}, "bridge.prefillers[0].url", "http://"),
        ({"prefillers": [{"url": "http://"}]}, "bridge.prefillers[0].url", "host"),
        ({"prefillers": [{}]}, "bridge.prefillers[0].url", "http://"),
        ({"decoders": [{**HTTP_D, "kv_endpoints": ["d:1"]}]}, f"{D0}.kv_endpoints", "scheme://"),
        ({"decoders": [{**HTTP_D, "kv_endpoint": []}]}, f"{D0}.kv_endpoint", "unknown key"),
        ({"decoders": [HTTP_D, {"url": "http://d/"}]}, "bridge.decoders", "more than once"),
        ({"max_body_bytes": 0}, "bridge.max_body_bytes", "> 0"),
        ({"prefill_timeout_s": 0}, "bridge.prefill_timeout_s", ""),
    ],
)  # fmt: skip
def test_rules_name_the_key_and_the_file(section: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        bridge_cfg(**section)
    issue = info.value.issues[0]
    assert issue.key == key
    assert words in issue.problem
    assert issue.source.kind == "test.yaml"


def test_serve_bridge_without_decoders_exits_2(tmp_path) -> None:
    config = tmp_path / "k.yaml"
    config.write_text("bridge:\n  prefillers: [{url: 'http://p:1'}]\n")
    result = CliRunner().invoke(bridge, ["--config", str(config)])
    assert result.exit_code == 2
    assert "bridge.decoders" in result.output


def test_serve_bridge_with_an_invalid_config_exits_2(tmp_path) -> None:
    config = tmp_path / "k.yaml"
    config.write_text("bridge:\n  decoders: [{url: 'd:1'}]\n")
    result = CliRunner().invoke(bridge, ["--config", str(config)])
    assert result.exit_code == 2
    assert "bridge.decoders[0].url" in result.output


# -- KV-aware routing --------------------------------------------------------------------

LOOKUP = {"lookup_url": "tcp://127.0.0.1:7610"}


def test_lookup_is_off_by_default_and_instance_ids_are_optional_then() -> None:
    cfg = bridge_cfg(decoders=[HTTP_D])
    assert cfg.lookup_url == "" and cfg.decoders[0].instance_id == ""
    assert cfg.lookup_timeout_s == 0.05 and cfg.lookup_min_hit_tokens == 256


def test_lookup_with_instance_ids() -> None:
    cfg = bridge_cfg(
        **LOOKUP,
        prefillers=[{"url": "http://p", "instance_id": "p0"}],
        decoders=[{**HTTP_D, "instance_id": "d0"}],
        lookup_timeout_s=0.2,
    )
    assert cfg.prefillers[0].instance_id == "p0" and cfg.decoders[0].instance_id == "d0"


@pytest.mark.parametrize(
    ("section", "key", "words"),
    [
        ({**LOOKUP, "decoders": [HTTP_D]}, "bridge.decoders", "[0].instance_id (http://d): req"),
        (
            {
                **LOOKUP,
                "decoders": [{**HTTP_D, "instance_id": "a"}],
                "prefillers": [{"url": "http://p"}],
            },
            "bridge.prefillers",
            "[0].instance_id (http://p): required",
        ),
        (
            {
                **LOOKUP,
                "prefillers": [{"url": "http://p", "instance_id": "a"}],
                "decoders": [{**HTTP_D, "instance_id": "a"}],
            },
            "bridge.decoders",
            "also prefillers[0]",
        ),
        ({"lookup_url": "http://l:1"}, "bridge.lookup_url", "tcp://"),
        ({"lookup_timeout_s": 0}, "bridge.lookup_timeout_s", ""),
        ({"lookup_min_hit_tokens": 0}, "bridge.lookup_min_hit_tokens", ""),
        ({"lookup_max_extra_inflight": -1}, "bridge.lookup_max_extra_inflight", ""),
    ],
)  # fmt: skip
def test_lookup_rules_name_the_key(section: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        bridge_cfg(**section)
    issue = info.value.issues[0]
    assert issue.key == key
    assert words in issue.problem


def test_the_lookup_url_option_needs_instance_ids(tmp_path) -> None:
    config = tmp_path / "bridge.yaml"
    config.write_text("bridge:\n  decoders: [{url: 'http://d:1'}]\n")
    result = CliRunner().invoke(
        bridge, ["--config", str(config), "--lookup-url", "tcp://127.0.0.1:7610"]
    )
    assert result.exit_code != 0
    assert "bridge.decoders" in result.output and "instance_id" in result.output
