"""The worker's answers to controller commands do not hold the engine's loop: a Pin of
many keys is parsed and applied on a thread (a few keys stay on the loop), and pins and
unpins still apply in the order they came."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace

from kvmesh.common.config import EngineControllerConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.protocol import controller as proto
from kvmesh.services.worker import controller_client
from kvmesh.services.worker.controller_client import ControllerClient
from kvmesh.services.worker.events import KVEventBuffer

NS = "0123456789abcdef"


def client_of(
    pin: Callable[[ChunkKey], bool],
    unpin: Callable[[ChunkKey], bool],
    send: Callable[[proto.CommandReply], object],
) -> ControllerClient:
    """A worker's controller client over an L1 of pin and unpin, its replies to send:
    only the command handling is real (no engine, no controller)."""
    cfg = EngineControllerConfig(enabled=True, url="tcp://127.0.0.1:1")
    engine = SimpleNamespace(
        instance_id="w",
        rank=0,
        storage=SimpleNamespace(l1=SimpleNamespace(pin=pin, unpin=unpin)),
        config=SimpleNamespace(controller=cfg),
        events=KVEventBuffer(),
        curve=None,
    )
    client = ControllerClient(engine, cfg)  # type: ignore[arg-type]
    client._conn = SimpleNamespace(send=send)  # type: ignore[assignment]
    return client


async def test_a_pin_of_many_keys_runs_off_the_loop() -> None:
    threads: set[int] = set()

    def pin(key: ChunkKey) -> bool:
        threads.add(threading.get_ident())
        return True

    sent: list[proto.CommandReply] = []
    client = client_of(pin, pin, sent.append)
    loop_thread = threading.get_ident()
    many = [ChunkKey(NS, i.to_bytes(16, "big")).to_str() for i in range(4 * 256)]
    assert len(many) > controller_client.KEYS_ON_LOOP

    await client._execute(proto.Command(7, "e", "pin", keys=many))
    assert sent[-1].ok and sent[-1].count == len(many)
    assert loop_thread not in threads

    threads.clear()
    await client._execute(proto.Command(8, "e", "unpin", keys=many[:3]))
    assert sent[-1].count == 3 and threads == {loop_thread}


async def test_an_unpin_does_not_pass_a_large_pin_on_its_thread() -> None:
    pinned: set[ChunkKey] = set()

    def pin(key: ChunkKey) -> bool:
        pinned.add(key)
        return True

    def unpin(key: ChunkKey) -> bool:
        pinned.discard(key)
        return True

    client = client_of(pin, unpin, lambda reply: None)
    many = [ChunkKey(NS, i.to_bytes(16, "big")).to_str() for i in range(64 * 256)]
    # As the session loop runs commands: each its own task, in arrival order.
    await asyncio.gather(
        client._execute(proto.Command(1, "e", "pin", keys=many)),
        # A few keys, so on the loop at once, the ones the pin's thread reaches last.
        client._execute(proto.Command(2, "e", "unpin", keys=many[-3:])),
    )
    assert len(pinned) == len(many) - 3
    assert not pinned & {ChunkKey.from_str(k) for k in many[-3:]}
