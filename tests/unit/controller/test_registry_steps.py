"""The controller walks large states a step at a time (services/controller/registry.py):
snapshots are packed, full states parsed and gone workers' chunks cleared in steps
of WALK_STEP chunks, other work runs between steps, and what a step leaves half done is
never seen: a snapshot does not tear a worker, a lookup sees a worker's old state until
its new one is complete, and a state abandoned midway leaves no bit behind."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from kvmesh.common.chunk_holders import WALK_STEP as STEP
from kvmesh.common.config import ControllerConfig
from kvmesh.services.controller.registry import Registry, WorkerEntry, chunk_int
from kvmesh.services.controller.server import ControllerServer

NS = "0123456789abcdef"


def keys(w: int, n: int, first: int = 0) -> list[str]:
    return [f"{NS}-{0:016x}{w:08x}{i:08x}" for i in range(first, first + n)]


def fill(reg: Registry, workers: int, chunks: int) -> None:
    for w in range(workers):
        entry = reg.register(f"inst{w}", 0, 1, [NS], f"tcp://h:{w + 1}", 1.0, None)
        ks = keys(w, chunks + chunks // 2)
        reg.apply(entry, [(1, k, "l1") for k in ks[:chunks]])
        reg.apply(entry, [(1, k, "disk") for k in ks[chunks:]])


def test_save_snapshot_packs_in_steps_serving_between_them(tmp_path: Path) -> None:
    path = tmp_path / "registry.snap"
    server = ControllerServer(ControllerConfig(snapshot_path=str(path)))
    reg = server.registry
    fill(reg, workers=3, chunks=2 * STEP)
    first = reg.workers["inst0/0"]
    taken = {t: set(ks) for t, ks in first.tiers.items()}
    ticks = 0
    seen: list[int] = []  # the ticks counted at each step
    real = reg.pack_workers

    def watched(out):
        for _ in real(out):
            seen.append(ticks)
            if len(seen) == 1:  # midway through inst0: a change packing must not tear
                reg.apply(first, [(1, k, "l1") for k in keys(0, 10, first=10 * STEP)])
                first.last_seq += 10
            yield

    reg.pack_workers = watched  # type: ignore[method-assign]

    async def run() -> None:
        nonlocal ticks
        save = asyncio.ensure_future(server.save_snapshot())
        while not save.done():
            ticks += 1
            await asyncio.sleep(0)
        await save

    asyncio.run(run())
    # l1 in 2 steps, disk in 1, then one per worker: 4 a worker, with other work between.
    assert len(seen) == 12 and all(b > a for a, b in itertools.pairwise(seen))
    restored = Registry()
    assert restored.load(path.read_bytes()) == 3
    twin = restored.workers["inst0/0"]
    assert twin.tiers == taken and twin.last_seq == 0  # as when its turn came
    for wid in ("inst1/0", "inst2/0"):
        assert restored.workers[wid].tiers == reg.workers[wid].tiers
    again = Registry()
    assert again.load(reg.snapshot()) == 3 and again.workers["inst0/0"].tiers == first.tiers


def holders_of(reg: Registry, entry: WorkerEntry) -> set[int]:
    bits = entry.slot_bits
    return {k for k, m in reg.holders.items() if m & bits}


def test_a_full_state_takes_effect_only_when_complete() -> None:
    reg = Registry()
    e = reg.register("a", 0, 1, [NS], "tcp://h:1", 1.0, None)
    old = keys(0, 5)
    reg.apply(e, [(1, k, "l1") for k in old])
    new = keys(0, 3 * STEP, first=100)
    steps = reg.replace_steps(e, {"l1": new, "disk": ["not a key", *keys(0, 2)]})
    next(steps)
    # Midway: lookups still see the old state.
    assert reg.locate(old, "asker") == (e, 5) and reg.locate(new[:2], "asker") is None
    for _ in steps:
        pass
    assert reg.locate(old, "asker") is None and reg.locate(new[:9], "asker") == (e, 9)
    assert e.tiers["l1"] == {chunk_int(k) for k in new} and reg.bad_keys == 1
    while not reg.sweep():
        pass
    assert reg.chunks_total() == 3 * STEP + 2 and holders_of(reg, e) == set(reg.holders)


def test_a_full_state_abandoned_midway_leaves_nothing_behind() -> None:
    reg = Registry()
    e = reg.register("a", 0, 1, [NS], "tcp://h:1", 1.0, None)
    reg.apply(e, [(1, k, "l1") for k in keys(0, 5)])
    # Superseded by a later state: the first stops at its next step.
    first = reg.replace_steps(e, {"l1": keys(0, 3 * STEP, first=100)})
    next(first)
    second = reg.replace_steps(e, {"l1": keys(0, 7, first=10**6)})
    assert list(first) == []
    for _ in second:
        pass
    while not reg.sweep():
        pass
    assert set(reg.holders) == e.tiers["l1"] == {chunk_int(k) for k in keys(0, 7, first=10**6)}
    # Its worker dropped midway: the partial state is cleared and every slot is free.
    third = reg.replace_steps(e, {"l1": keys(0, 3 * STEP, first=200)})
    next(third)
    assert reg.drop("a/0") == 7
    assert list(third) == []
    while not reg.sweep():
        pass
    assert reg.holders == {}
    b = reg.register("b", 0, 1, [NS], "tcp://h:2", 1.0, None)
    assert b.slot == 0  # the swept slots are given out again
    # Closed before it ends (its task cancelled): the same.
    steps = reg.replace_steps(b, {"l1": keys(1, 2 * STEP)})
    next(steps)
    steps.close()
    while not reg.sweep():
        pass
    assert reg.holders == {} and b.tiers == {}
