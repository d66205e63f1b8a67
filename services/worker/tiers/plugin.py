"""Tiers from other packages (`engine.tiers` in the config).

A tier plugin is a factory, `factory(context: TierContext) -> Tier`, registered as an
entry point of the `kvmesh.tiers` group or named as `package.module:factory`. The
engine calls it once at startup and places the tier after the disk tier and before the
remote one, in the order of the config. The tier must implement the Tier protocol
(tiers/base.py) with `name == context.name`; it reads into the `allocator` that `get`
is given and may run coroutines on `context.loop`. What it returns must never be
wrong: a tier that cannot vouch for a chunk's bytes returns a miss.

Its factory has a deadline (plugins.build), and so do `batched_contains` (the storage
manager asks it on a thread of its own) and `aget` (awaited under the I/O deadline).
The other plain methods are called on the caller's thread, as the built-in tiers'
are: a hop to another thread for each would cost every store tens of microseconds a
chunk, and milliseconds when other Python threads hold the GIL (measured in a review),
and a plugin that waits on `context.loop` from one would deadlock the loop. They must
answer from memory (docs/plugins.md says so); slow work goes to the tier's own threads.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.common.config import TierPluginConfig
from kvmesh.common.observability import Metrics
from kvmesh.common.plugins import (
    TIERS_GROUP,
    PluginError,
    build,
    call_on_daemon,
    wrong_kinds,
)
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers.base import Tier

# How long the start waits for a refused tier's close before it reports the refusal.
CLOSE_TIMEOUT_S = 5.0


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
    """Build cfg's tier; PluginError (naming the plugin) if it fails, does not start in
    time or is not a Tier."""
    tier = build(TIERS_GROUP, cfg.plugin, context)
    problem = _problem(tier, context.name)
    if problem:
        _close_quietly(tier)  # built all the same: it may hold threads or files
        raise PluginError(f"{TIERS_GROUP} plugin {cfg.plugin!r} {problem}")
    return tier


# The engine awaits `aget` and calls every other method directly: an `aget` that is a
# plain function hands back an object nobody releases (its L1 page leaks), and a
# coroutine where a count or a bool is expected breaks the lookup that adds it up.
_SYNC_METHODS = (
    "contains", "batched_contains", "submit_put", "get", "remove", "clear", "pin", "unpin",
    "touch", "flush", "close",
)  # fmt: skip


def _problem(tier: object, name: str) -> str:
    """Why tier cannot serve as the tier named name ("" if it can)."""
    kind = type(tier).__name__
    if not isinstance(tier, Tier):
        missing = [
            m for m in ("name", "get", "aget", "contains", "submit_put") if not hasattr(tier, m)
        ]
        listed = ", ".join(missing) or "some methods"
        return f"returned a {kind}, which is not a Tier (missing: {listed})"
    if tier.name != name:
        return f"named its tier {tier.name!r}; it must use context.name ({name!r})"
    wrong = wrong_kinds(tier, ("aget",), _SYNC_METHODS)
    if wrong:
        return f"returned a {kind} that breaks the Tier protocol: {'; '.join(wrong)}"
    return ""


def _close_quietly(tier: object) -> None:
    """Let go of what a refused tier opened: the engine that would close it is not
    going to exist. A close that does not return in time is left running."""
    close = getattr(tier, "close", None)
    if callable(close) and not inspect.iscoroutinefunction(close):
        fut = call_on_daemon(close, name=f"kvmesh-plugin-close-{getattr(tier, 'name', '?')}")
        # The error worth reporting is the PluginError, not one from closing.
        with contextlib.suppress(Exception):
            fut.result(timeout=CLOSE_TIMEOUT_S)
