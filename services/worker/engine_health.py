"""The engine's /health report, served on its metrics port (`engine.metrics_port` + rank).

`status` is "degraded" when a configured tier is down or degraded, when a controller
is configured and the engine is not registered with it, or when the engine's event
loop has stopped or stalled (it runs every tier's I/O and the controller session: a
stalled loop times every load out and misses heartbeats, while each flag above still
reads as it did before the stall); "ok" otherwise. Either way the
answer is HTTP 200: the cache is best effort (a miss means vLLM recomputes), so a
liveness probe on this endpoint must never restart vLLM because a cache-server or the
controller went away. Alerting reads `status` (or the metrics) instead.

The report is built on the HTTP server's request thread from plain attribute reads
(ints, dict sizes, flags the tiers keep): it takes none of the locks that stores and
retrieves hold, so a probe neither waits on the hot path nor slows it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine
    from kvmesh.services.worker.loop_thread import LoopThread

Status = Literal["ok", "degraded"]
# ok/degraded: a tier that says why it is degraded (disk); up/down: one a monitor
# checks (remote); on: one with no state of its own to report (p2p, plugins).
TierState = Literal["ok", "degraded", "up", "down", "on"]
_BAD_STATES = ("degraded", "down")
# A loop late this long behind its beat is reported: far past any callback's normal
# run (microseconds to a few ms), and shorter than the controller's default drop.
LOOP_STALL_S = 2.0
_BEAT_S = 0.5


class L1Health(msgspec.Struct, frozen=True):
    used_bytes: int
    capacity_bytes: int
    chunks: int


class TierHealth(msgspec.Struct, frozen=True):
    state: TierState
    # Why the tier is degraded or down ("" when it is not).
    reason: str = ""


class ControllerHealth(msgspec.Struct, frozen=True):
    configured: bool
    registered: bool
    url: str = ""


class PdHealth(msgspec.Struct, frozen=True):
    role: str
    # Pushes this prefiller is sending, allocations this decoder holds for pushes.
    sending: int = 0
    receiving: int = 0


class EventsHealth(msgspec.Struct, frozen=True):
    # Events the engine's ring overwrote, and those the controller feed lost because
    # it fell behind (the controller resyncs from the full state after such a gap).
    buffer_dropped: int
    controller_dropped: int = 0


class LoopHealth(msgspec.Struct, frozen=True):
    running: bool
    # How long the loop has run no callback beyond its beat (0 while it keeps up).
    stalled_s: float = 0.0


class EngineHealth(msgspec.Struct, frozen=True):
    status: Status
    instance: str
    rank: int
    closed: bool
    l1: L1Health
    # Tiers below L1 by name, in waterfall order.
    tiers: dict[str, TierHealth]
    controller: ControllerHealth
    pd: PdHealth
    events: EventsHealth
    loop: LoopHealth
    # What made the status degraded, one line each.
    problems: list[str] = msgspec.field(default_factory=list)


def tier_health(tier: object) -> TierHealth:
    """A tier's state from what it exposes: `degraded` (a reason or None) as the disk
    tier has, or `up` as the remote tier has. Plugin tiers may offer either."""
    degraded = getattr(tier, "degraded", None)
    if isinstance(degraded, str):
        return TierHealth("degraded", degraded)
    if hasattr(tier, "degraded"):
        return TierHealth("ok")
    up = getattr(tier, "up", None)
    if isinstance(up, bool):
        if up:
            return TierHealth("up")
        monitor = getattr(tier, "health", None)
        return TierHealth("down", str(getattr(monitor, "reason", "")))
    return TierHealth("on")


class _LoopWatch:
    """A callback the engine's loop runs again every _BEAT_S: the time of its last run
    says whether the loop still turns. Reading it takes no lock and waits for
    nothing, so a probe of a stuck loop answers at once."""

    def __init__(self, thread: LoopThread) -> None:
        self.beat = time.monotonic()
        self._thread = thread
        thread.call_soon(self._tick)

    def _tick(self) -> None:
        self.beat = time.monotonic()
        self._thread.loop.call_later(_BEAT_S, self._tick)

    def stalled_s(self) -> float:
        return max(0.0, time.monotonic() - self.beat - _BEAT_S)


# Started by an engine's first report (an engine nobody probes pays nothing); the
# watch holds the loop thread, not the engine, so it goes with the engine.
_watches: weakref.WeakKeyDictionary[KVEngine, _LoopWatch] = weakref.WeakKeyDictionary()
_watches_lock = threading.Lock()


def loop_health(engine: KVEngine) -> LoopHealth:
    """Whether the engine's event loop runs, and how far behind its beat it is."""
    thread = engine.loop
    if not thread.running:
        return LoopHealth(running=False)
    try:
        with _watches_lock:
            watch = _watches.get(engine)
            if watch is None:
                watch = _watches[engine] = _LoopWatch(thread)
    except RuntimeError:  # the loop closed between the check and the call
        return LoopHealth(running=False)
    return LoopHealth(running=True, stalled_s=round(watch.stalled_s(), 3))


def engine_health(engine: KVEngine) -> EngineHealth:
    """The engine's health report now; safe from any thread."""
    storage = engine.storage
    tiers = {tier.name: tier_health(tier) for tier in storage.lower}
    problems = [
        f"tier {name} {t.state}" + (f": {t.reason}" if t.reason else "")
        for name, t in tiers.items()
        if t.state in _BAD_STATES
    ]
    ctl_cfg = engine.config.controller
    client = getattr(engine, "controller_client", None)
    registered = bool(client is not None and client.registered)
    if ctl_cfg.enabled and not registered:
        problems.append(f"not registered with the controller at {ctl_cfg.url}")
    loop = loop_health(engine)
    if not loop.running and not engine.closed:
        problems.append("the engine's event loop has stopped")
    elif loop.stalled_s > LOOP_STALL_S:
        problems.append(
            f"the engine's event loop has run nothing for {loop.stalled_s:.1f}s "
            "(tier I/O and controller heartbeats wait behind it)"
        )
    sender, receiver = engine.pd_sender, engine.pd_receiver
    return EngineHealth(
        status="degraded" if problems else "ok",
        instance=engine.instance_id,
        rank=engine.rank,
        closed=engine.closed,
        l1=L1Health(
            used_bytes=engine.pool.used_bytes,
            capacity_bytes=engine.pool.capacity_bytes,
            chunks=len(storage.l1),
        ),
        tiers=tiers,
        controller=ControllerHealth(
            configured=ctl_cfg.enabled,
            registered=registered,
            url=ctl_cfg.url if ctl_cfg.enabled else "",
        ),
        pd=PdHealth(
            role=engine.config.pd.role,
            sending=sender.inflight if sender is not None else 0,
            receiving=receiver.inflight if receiver is not None else 0,
        ),
        events=EventsHealth(
            buffer_dropped=engine.events.dropped,
            controller_dropped=client.events_dropped if client is not None else 0,
        ),
        loop=loop,
        problems=problems,
    )
