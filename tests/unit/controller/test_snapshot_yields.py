"""The controller packs its snapshot one worker at a time and serves between workers
(registry.snapshot_workers, ControllerServer.save_snapshot); what it writes loads back
as the same registry."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from kvmesh.common.config import ControllerConfig
from kvmesh.services.controller.registry import Registry
from kvmesh.services.controller.server import ControllerServer

NS = "0123456789abcdef"


def fill(reg: Registry, workers: int, chunks: int) -> None:
    for w in range(workers):
        entry = reg.register(f"inst{w}", 0, 1, [NS], f"tcp://h:{w + 1}", 1.0, None)
        keys = [f"{NS}-{0:016x}{w:08x}{i:08x}" for i in range(chunks + chunks // 2)]
        reg.apply(entry, [(1, k, "l1") for k in keys[:chunks]])
        reg.apply(entry, [(1, k, "disk") for k in keys[chunks:]])


def test_save_snapshot_serves_between_workers(tmp_path: Path) -> None:
    path = tmp_path / "registry.snap"
    server = ControllerServer(ControllerConfig(snapshot_path=str(path)))
    fill(server.registry, workers=5, chunks=1000)

    ticks = 0
    seen: list[int] = []  # the ticks counted when each worker's part was packed
    real = server.registry.snapshot_workers

    def watched():
        for part in real():
            seen.append(ticks)
            yield part

    server.registry.snapshot_workers = watched  # type: ignore[method-assign]

    async def run() -> None:
        nonlocal ticks
        save = asyncio.ensure_future(server.save_snapshot())
        while not save.done():
            ticks += 1
            await asyncio.sleep(0)
        await save

    asyncio.run(run())
    # Other work ran between every two workers' parts (packed in one go, none would).
    assert len(seen) == 5 and all(b > a for a, b in itertools.pairwise(seen))
    restored = Registry()
    assert restored.load(path.read_bytes()) == 5
    for entry in server.registry.workers.values():
        twin = next(e for e in restored.workers.values() if e.worker_id == entry.worker_id)
        assert twin.tiers == entry.tiers and twin.last_seq == entry.last_seq
    assert restored.chunks_total() == server.registry.chunks_total() == 5 * 1500


def test_snapshot_is_the_workers_parts_in_one_message() -> None:
    reg = Registry()
    fill(reg, workers=3, chunks=10)
    parts = list(reg.snapshot_workers())
    assert [p.worker_id for p in parts] == [e.worker_id for e in reg.workers.values()]
    again = Registry()
    assert again.load(reg.snapshot()) == 3
    assert again.chunks_total() == 3 * 15
