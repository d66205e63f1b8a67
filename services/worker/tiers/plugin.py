"""Tiers from other packages (`engine.tiers` in the config).

A tier plugin is a factory, `factory(context: TierContext) -> Tier`, registered as an
entry point of the `kvmesh.tiers` group or named as `package.module:factory`. The
engine calls it once at startup and places the tier after the disk tier and before the
remote one, in the order of the config. The tier must implement the Tier protocol
(tiers/base.py) with `name == context.name`; it reads into the `allocator` that `get`
is given and may run coroutines on `context.loop`. What it returns must never be
wrong: a tier that cannot vouch for a chunk's bytes returns a miss.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.common.config import TierPluginConfig
from kvmesh.common.observability import Metrics
from kvmesh.common.plugins import TIERS_GROUP, PluginError, build
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers.base import Tier


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier plugin's factory is given."""

    name: str  # the tier's name: metrics labels, lookup answers
    instance_id: str
    rank: int
    namespace_id: str  # chunks of this engine carry this namespace (tenants add others)
    chunk_bytes: int  # a full chunk's size
    loop: LoopThread  # the engine's event loop thread, for a tier's async work
    metrics: Metrics  # the engine's registry (labels instance, rank)
    options: Mapping[str, Any] = field(default_factory=dict)


def make_plugin_tier(cfg: TierPluginConfig, context: TierContext) -> Tier:
    """Build cfg's tier; PluginError (naming the plugin) if it fails or is not a Tier."""
    tier = build(TIERS_GROUP, cfg.plugin, context)
    if not isinstance(tier, Tier):
        missing = [
            m for m in ("name", "get", "aget", "contains", "submit_put") if not hasattr(tier, m)
        ]
        _close_quietly(tier)
        raise PluginError(
            f"{TIERS_GROUP} plugin {cfg.plugin!r} returned a {type(tier).__name__}, "
            f"which is not a Tier (missing: {', '.join(missing) or 'some methods'})"
        )
    if tier.name != context.name:
        _close_quietly(tier)
        raise PluginError(
            f"{TIERS_GROUP} plugin {cfg.plugin!r} named its tier {tier.name!r}; "
            f"it must use context.name ({context.name!r})"
        )
    wrong = _wrong_kinds(tier)
    if wrong:
        _close_quietly(tier)
        raise PluginError(
            f"{TIERS_GROUP} plugin {cfg.plugin!r} returned a {type(tier).__name__} that "
            f"breaks the Tier protocol: {'; '.join(wrong)}"
        )
    return tier


# The engine awaits `aget` and calls every other method directly: an `aget` that is a
# plain function hands back an object nobody releases (its L1 page leaks), and a
# coroutine where a count or a bool is expected breaks the lookup that adds it up.
_SYNC_METHODS = (
    "contains", "batched_contains", "submit_put", "get", "remove", "clear", "pin", "unpin",
    "touch", "flush", "close",
)  # fmt: skip


def _wrong_kinds(tier: Tier) -> list[str]:
    wrong = [] if inspect.iscoroutinefunction(tier.aget) else ["aget is not async def"]
    for m in _SYNC_METHODS:
        if inspect.iscoroutinefunction(getattr(tier, m)):
            wrong.append(f"{m} is async def")
    return wrong


def _close_quietly(tier: object) -> None:
    """A refused tier was built all the same: let go of what it opened (threads,
    files), since the engine that would close it is not going to exist."""
    close = getattr(tier, "close", None)
    if callable(close) and not inspect.iscoroutinefunction(close):
        # The error worth reporting is the PluginError, not one from closing.
        with contextlib.suppress(Exception):
            close()
