"""Tier and connector plugins from an installed package (tests/plugins/example_plugin,
installed into the test venv by scripts/setup.sh): loaded through their entry points or
a module path, used by a real engine as a tier and as the remote store, and a plugin
that fails is a startup error that names it."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.config import EngineConfig, L1Config, RemoteConfig, TierPluginConfig
from kvmesh.common.plugins import PluginError
from kvmesh.services.worker.engine import KVEngine

BLOCKS, BLOCK = 64, 4
SLOTS = BLOCKS * BLOCK
PROMPT = list(range(500, 564))  # 8 chunks of 8


def config(**kw) -> EngineConfig:
    return EngineConfig(
        chunk_size=8,
        model_name="plugin-test",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        **kw,
    )


def test_the_example_plugin_is_installed_with_its_entry_points() -> None:
    tiers = {ep.name for ep in entry_points(group="kvmesh.tiers")}
    connectors = {ep.name for ep in entry_points(group="kvmesh.connectors")}
    assert {"memdict", "broken-import", "broken-factory"} <= tiers
    assert "memkv" in connectors


@pytest.mark.parametrize(
    "spec,name",
    [("memdict", "memdict"), ("kvmesh_example_plugin.tier:make_tier", "mem2")],
)
def test_a_plugin_tier_serves_what_l1_dropped(spec: str, name: str) -> None:
    view, layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    tiers = [TierPluginConfig(plugin=spec, name=name if name != "memdict" else "")]
    eng = KVEngine("plug", 0, config(tiers=tiers), view)
    try:
        tier = eng.storage.tier(name)
        assert type(tier).__name__ == "MemDictTier" and tier.name == name
        slots = torch.randperm(SLOTS)[:64]
        want = slot_tokens(layers, kind)[:, slots].clone()
        assert eng.store(PROMPT, slots) == 64
        assert tier.flush(5) and tier.puts == 8
        assert eng.stats.metrics.value("memdict_puts_total") == 8  # its own metric
        eng.clear(tier="l1")
        # Wipe the paged cache, then load from the plugin tier only.
        for t in layers:
            t.zero_()
        assert eng.lookup(PROMPT) == 64
        assert bool(eng.retrieve(PROMPT, slots).all())
        assert torch.equal(bits(slot_tokens(layers, kind)[:, slots]), bits(want))
        assert eng.stats.metrics.value("tokens_hit_total", {"tier": name}) == 64
        assert tier.hits == 8
    finally:
        eng.close()


def test_a_plugin_tier_that_fails_its_checksum_is_a_miss() -> None:
    view, _layers, _kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    eng = KVEngine("plug-bad", 0, config(tiers=[TierPluginConfig(plugin="memdict")]), view)
    try:
        tier = eng.storage.tier("memdict")
        slots = torch.arange(64)
        assert eng.store(PROMPT, slots) == 64
        eng.clear(tier="l1")
        keys = [key for _, _, key in eng.chunks(PROMPT)]
        tier.corrupt(keys[3])  # the 4th chunk's bytes no longer match: chunks 4.. recompute
        loaded = eng.retrieve(PROMPT, slots)
        assert int(loaded.sum()) == 24 and bool(loaded[:24].all())
    finally:
        eng.close()


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("broken-import", r"kvmesh.tiers plugin 'broken-import' .*did not load: ModuleNotFound"),
        ("broken-factory", r"'broken-factory' failed to start: RuntimeError: the example store"),
        ("no-such-tier", r"no kvmesh.tiers plugin named 'no-such-tier' \(installed: .*memdict"),
        ("kvmesh_example_plugin.tier:nothing", r"'kvmesh_example_plugin.tier:nothing' did not"),
        ("builtins:repr", r"'builtins:repr' returned a str, which is not a Tier"),
    ],
)
def test_a_plugin_that_fails_is_a_startup_error_naming_it(spec: str, expected: str) -> None:
    view, _, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    cfg = config(tiers=[TierPluginConfig(plugin=spec, name="t")])
    with pytest.raises(PluginError, match=expected):
        KVEngine("plug-fail", 0, cfg, view)


def test_a_tier_that_names_itself_otherwise_is_refused() -> None:
    view, _, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    spec = "kvmesh_example_plugin.tier:make_misnamed_tier"
    cfg = config(tiers=[TierPluginConfig(plugin=spec, name="t")])
    with pytest.raises(PluginError, match=r"named its tier 'memdict'; it must use context.name"):
        KVEngine("plug-fail", 0, cfg, view)


@pytest.mark.parametrize(
    "url,connector",
    [
        ("memkv://shared-a", ""),
        ("any://shared-b", "kvmesh_example_plugin.connector:make_connector"),
    ],
)
def test_a_connector_plugin_is_the_remote_store(url: str, connector: str) -> None:
    src_view, src_layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    dst_view, dst_layers, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    remote = RemoteConfig(enabled=True, url=url, connector=connector, health_interval_s=0.1)
    a = KVEngine("conn-a", 0, config(remote=remote), src_view)
    b = KVEngine("conn-b", 0, config(remote=remote), dst_view)
    try:
        assert a.storage.tier("remote").wait_ready(10)
        assert b.storage.tier("remote").wait_ready(10)
        src, dst = torch.randperm(SLOTS)[:64], torch.randperm(SLOTS)[:64]
        assert a.store(PROMPT, src) == 64
        assert a.storage.tier("remote").flush(5)
        assert b.lookup(PROMPT) == 64
        assert bool(b.retrieve(PROMPT, dst).all())
        want = slot_tokens(src_layers, kind)[:, src]
        assert torch.equal(bits(slot_tokens(dst_layers, kind)[:, dst]), bits(want))
        assert b.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == 64
    finally:
        a.close()
        b.close()


def test_a_connector_plugin_that_fails_names_itself() -> None:
    view, _, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    remote = RemoteConfig(enabled=True, url="memkv://", health_interval_s=0.1)
    with pytest.raises(PluginError, match=r"kvmesh\.connectors plugin 'memkv' failed to start"):
        KVEngine("conn-fail", 0, config(remote=remote), view)
